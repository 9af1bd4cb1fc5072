"""What a step costs on a chip and across chips, predicted: the timeline model over a DMA log
(one chip, every rank), scale-out programs and their simulation,
a log scaled to another config, a step's schedule against the roofline, calibration against the
published numbers, and speculative decoding's prediction.

Imports: every package below it (hardware, model, sharding, decoding, mkresearch.kernels).
"""
