"""graphc:: custom ops. Importing this package registers every one of them (a loaded `.pt2`
names them, so the runtime imports it before loading a graph).

    library.py          how an op is defined (schema, kernel, fake)
    paged_attention.py  KV write and MLA attention over the paged pool
    collectives.py      attention combine, MoE all-gather / reduce-scatter, all-reduce (sum, max)
    all_to_all.py       the all-to-all MoE's dispatch and combine (even and variable lowerings)
    sampler.py          the in-graph sampler
    sparse.py           DeepSeek Sparse Attention's indexer and sparse MLA
    moe.py              the routed experts' sparse forms (expert routes, grouped GEMM)
    dequantize.py       block-scaled FP8 weights to the compute dtype, in the graph
    hyper_connections.py  DeepSeek-V4's Sinkhorn normalisation of the stream mixes
    engram.py           DeepSeek-V4.1 Engram's n-gram hash (64-bit on every backend)
    distributed.py      semantic group names to process groups
"""

from graphc.ops import (all_to_all, collectives, dequantize, engram, hyper_connections, moe,  # noqa: F401
                        paged_attention, sampler, sparse)  # (registration)
