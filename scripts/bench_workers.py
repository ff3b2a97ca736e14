"""``python -m kvroute.bench.perf.workers``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.workers import main

if __name__ == "__main__":
    sys.exit(main())
