"""Serving-shaped decode: rows that arrive, join a running batch between steps and leave it. The
page allocator (which row owns which page of the paged KV pool), the slots (B rows of one step,
KDA's per-row state among them), the continuous-batching loop over the paged decode step, and the
arrival traces it replays with what each step costs (tokens/s here, the predicted TPU step).

Imports: every package below it (up to mkresearch.prediction).
"""
