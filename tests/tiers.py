"""The test tiers, read once: `make test` runs one case per named behaviour; `make test-exhaustive`
(MKRESEARCH_EXHAUSTIVE=1) also every sweep marked `exhaustive` and the longer runs that modules
choose with EXHAUSTIVE (more steps, more batch sizes). Imported by tests/conftest.py and by test
modules as `from tiers import EXHAUSTIVE` (tests/ is on sys.path, like tests/hf_tiny.py)."""

import os

EXHAUSTIVE = os.environ.get("MKRESEARCH_EXHAUSTIVE") == "1"
