"""`python -m mkresearch ...`: the same as the `mkresearch` console script."""

import sys

from mkresearch.cli.main import main

sys.exit(main())
