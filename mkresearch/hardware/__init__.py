"""The chips and how a kernel runs on them: per-chip figures (HBM and VMEM sizes, bandwidths,
clocks), TPU interpret mode when no TPU is present, and the one place that chooses it.

Imports: JAX only (no other mkresearch package).
"""
