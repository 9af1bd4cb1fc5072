"""What a user runs: `mkresearch` (`main`: one table of commands, each a module of its own:
`info`, `decode`, `bench_command`, `compile_check`, `plan`, `predict`, `figures`), the convention
they share (`options`) and their checks (`common`); what decode and bench run (`bench`, `ranks`,
`speculative`, `checkpoint`, `workload`: `bench --workload`), `make figures` (`figures`) and
`make recorded` (`record`).

Imports: anything in mkresearch; nothing imports it.
"""
