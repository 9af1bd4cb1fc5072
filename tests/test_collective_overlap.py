"""`measurement.collective_overlap` on a hand-made log: the HBM DMAs in flight when a rank first
waits for a collective, and the picture's rows (the recorded 8-rank step is checked in
tests/sharded/test_partial_sum.py)."""

from mkresearch.kernels.base import dma

from mkresearch.measurement import collective_overlap


def _log():
    def hbm(kind, block):
        return dma.Event(kind, "w", "hbm", "vmem", 100, slot=block % 2, indices={"block": block},
                         rank=0)

    def remote(kind, name):
        return dma.Event(kind, name, "vmem", "vmem", 8, rank=0, src_rank=0, dst_rank=1)

    return dma.DmaLog([hbm("dma_start", 0), hbm("dma_start", 1), hbm("dma_wait", 0),
                       remote("dma_start", "a/all_gather"), remote("dma_wait", "a/all_gather"),
                       hbm("dma_wait", 1), remote("dma_start", "b/all_gather"),
                       remote("dma_wait", "b/all_gather")])


def test_in_flight_at_the_wait_and_the_rows():
    first, second = collective_overlap.collective_overlap(_log(), 0)
    assert (first["name"], first["start"], first["wait"], first["end"]) == ("a/all_gather", 3, 4, 4)
    assert (first["hbm_in_flight"], first["hbm_bytes_in_flight"]) == (1, 100)
    assert (second["name"], second["hbm_in_flight"]) == ("b/all_gather", 0)
    rows = collective_overlap.overlap_rows(_log(), 0)
    assert rows == [{"lane": "HBM", "name": "weights", "start": 0, "end": 5},
                    {"lane": "collective", "name": "a/all_gather", "start": 3, "end": 4},
                    {"lane": "collective", "name": "b/all_gather", "start": 6, "end": 7}]
