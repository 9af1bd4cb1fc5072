"""Speculative decoding in plain JAX: the verify / rollback loop, acceptance rules and drafters.

Imports: mkresearch.hardware, mkresearch.model, mkresearch.sharding.
"""
