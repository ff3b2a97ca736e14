"""``python -m kvroute.bench.perf.choose``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.choose import main

if __name__ == "__main__":
    sys.exit(main())
