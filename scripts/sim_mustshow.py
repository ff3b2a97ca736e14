"""``python -m kvroute.bench.sim_check``: see that module (``--help``)."""

import sys

from kvroute.bench.sim_check import main

if __name__ == "__main__":
    sys.exit(main())
