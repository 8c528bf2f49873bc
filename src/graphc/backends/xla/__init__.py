"""XLA lowering of step programs (the `neuron` backend's compiler, and its runner on XLA:CPU).

    collectives.py   cross-replica all-reduce / all-gather / reduce-scatter over replica groups
    aten.py          core ATen -> jax rules
    graphc_ops.py    graphc:: op -> jax rules (KV write, sampler, grouped GEMM, collectives)
    variants.py      the neuron and cpu HLO variants and what differs between them
    lower.py         program -> HloModuleProto and its signature
"""
