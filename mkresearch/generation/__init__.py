"""The library's decode loop: inputs checked once, then compiled chunks of decode steps (the
megakernel's or the reference's) whose tokens, positions and state stay on the device.

Imports: mkresearch.hardware, mkresearch.model, mkresearch.baselines, mkresearch.kernels.
"""
