"""``python -m kvroute.bench.perf.overhead``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.overhead import main

if __name__ == "__main__":
    sys.exit(main())
