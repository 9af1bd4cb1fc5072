"""Pallas TPU kernels, installed as ``mkresearch.kernels`` (never import a top-level ``kernels``)."""
