"""The megakernel: its plan (options, VMEM plan), the composer (one `pallas_call` per step), every
DMA of a step as data (`schedule`), the step on n ranks (`megakernel_sharded`) and speculative
decoding's verify step.

Imports: every other package of mkresearch.kernels and the packages below it.
"""
