"""Layouts: which rank holds which slice of every parameter and state (`layout`), which rank
counts split a model (`mkresearch.model.partition`) and the bytes each rank holds (`layout_bytes`).

Imports: mkresearch.hardware, mkresearch.model.
"""
