"""The model as plain JAX: configs and their rules, the stage registry (`spec`) with the built-in
kinds (`stages/`), the reference decode step and sampling, weights and expert formats, RoPE, the
KV cache's bytes and the roofline (a step's bytes and flops). The spec kernels are tested against.

Imports: mkresearch.hardware.
"""
