"""What a user runs: `mkresearch` (`main`) and its commands (`common`, `predict`, `ranks`,
`speculative`), the decode bench (`bench`), the workload bench (`workload`: `bench --workload`),
`make figures` (`figures`) and `make recorded`.

Imports: anything in mkresearch; nothing imports it.
"""
