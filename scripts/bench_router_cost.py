"""``python -m kvroute.bench.perf.router_cost``: see that module (``--help``)."""

import sys

from kvroute.bench.perf.router_cost import main

if __name__ == "__main__":
    sys.exit(main())
