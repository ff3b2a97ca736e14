"""``python -m kvroute.bench.perf.listener``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.listener import main

if __name__ == "__main__":
    sys.exit(main())
