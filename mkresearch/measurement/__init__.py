"""What runs here and compiles say: DMA-log analytics and the runs that record them, profiles,
HLO kernel counts, and compile results recorded for the notebooks (`recorded`, data in
`recorded/`).

Imports: every package below it (up to mkresearch.serve).
"""
