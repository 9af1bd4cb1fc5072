"""A stand-in for Colab's `google.colab` (.ci/wheel-check's Colab-like runtime, never shipped).

Colab's kernel imports google.colab when it starts, and with it numpy: a package the notebooks'
first cell might replace is then already imported. This stand-in does the same.
"""

import numpy  # noqa: F401 - imported at kernel start, as Colab's own google.colab does
from google.colab import output  # noqa: F401
