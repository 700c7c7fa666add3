"""``python -m benchmarks [--quick] [--only SECTION,...] [--out DIR] [--no-plots]``: see suite.py."""

import sys

from benchmarks.suite import main

sys.exit(main())
