"""One stage body per kind (kda, mla, gqa, gqa_sink (GPT-OSS's two kinds), mla_rope; router, experts, ffn_kinds, moe_full, and
gate_up, which streams a rank's gate and up as one where its hidden slice is under whole lanes;
sampling, residuals), each a body over Refs plus a thin `pallas_call` wrapper, registered with
`kernels.base.registry` on import.

Imports: mkresearch.kernels.base and the packages below mkresearch.kernels.
"""
