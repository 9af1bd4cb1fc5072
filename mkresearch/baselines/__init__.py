"""Decode steps built the way one would build them on one TPU today from JAX's own kernels, not
ours: the yardsticks the megakernel is measured against (`jax_kernels`: megablox gmm for the
routed experts, ragged paged attention for a paged GQA cache, XLA for the rest). Peers of the
reference: each takes the reference's weights and state and is checked against it.

Imports: mkresearch.hardware, mkresearch.model (never mkresearch.kernels).
"""
