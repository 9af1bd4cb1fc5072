"""mkresearch: TPU decode megakernels for giant Mixture-of-Experts models, taught and tested."""

from mkresearch.hardware import tpu as _tpu

_tpu.select_platform()  # before jax is imported anywhere: CPU unless this machine has a TPU

__version__ = "0.1.0"
