"""What a user runs: `mkresearch` (`main`) and its commands (`common`, `predict`, `ranks`,
`speculative`), the decode bench (`bench`), `make figures` (`figures`) and `make recorded`.

Imports: anything in mkresearch; nothing imports it.
"""
