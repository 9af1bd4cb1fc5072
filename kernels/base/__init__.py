"""What every stage body stands on: DMAs as data and their log (`dma`, `planned`), block sizes,
the kernel side of a stage kind (`registry`), cost estimates, the weight stream, quantized GEMV,
and the KV cache's tile loop and 16-row update block.

Imports: mkresearch.hardware, mkresearch.model, mkresearch.sharding.
"""
