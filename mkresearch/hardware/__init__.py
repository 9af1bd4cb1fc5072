"""The chips and how a kernel runs on them: per-chip figures (HBM and VMEM sizes, bandwidths,
clocks), TPU interpret mode when no TPU is present, and the one place that chooses it; the links
between chips: slices as tori (`topology`) and what a collective's messages cost on them
(`interconnect`: link figures and prices by phases). The links sit here, below the model, because
the model chooses how a kernel sends its reductions from them (`kernels.sharded.plan`) and the
kernel is built with that choice, never by importing the prediction layer.

Imports: JAX only (no other mkresearch package).
"""
