"""pytest setup for nbval over notebooks/*.ipynb: CPU (TPU interpret mode) unless there is a TPU.

The notebook kernels nbval starts inherit this process's environment, so JAX_PLATFORMS is decided
here once, exactly as `import mkresearch` decides it inside each notebook's first cell.
"""

from mkresearch import tpu as _tpu

_tpu.select_platform()
