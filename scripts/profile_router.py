"""``python -m kvroute.bench.perf.profile``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.profile import main

if __name__ == "__main__":
    sys.exit(main())
