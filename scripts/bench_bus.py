"""``python -m kvroute.bench.perf.bus``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.bus import main

if __name__ == "__main__":
    sys.exit(main())
