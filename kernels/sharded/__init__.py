"""The pieces of a step on n ranks: collectives between ranks (gathers by remote copy), the
embedding gather and the vocab shards' sampling merge, MLA's sharded attention.

Imports: mkresearch.kernels.base / stages and the packages below mkresearch.kernels.
"""
