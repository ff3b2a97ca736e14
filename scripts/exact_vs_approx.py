"""``python -m kvroute.bench.exact_vs_approx``: see that module (``--help``)."""

import sys

from kvroute.bench.exact_vs_approx import main

if __name__ == "__main__":
    sys.exit(main())
