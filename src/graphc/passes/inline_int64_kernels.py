"""Replace DeepSeek-V4.1's n-gram hash (`graphc::ngram_hash`) by its int64 ATen ops on the backends
that compute in int64 (export, inductor).

The hash is an op so that the neuron backend, whose programs hold no 64-bit values, can lower it
in 32-bit words (`backends/xla/ngram_hash.py`). On the CPU backends it would be a Python kernel
call per Engram layer per step (~60 us each, measured); inlined, inductor fuses it with the rest.
"""

from __future__ import annotations

import torch.fx

from graphc.ops.engram import ngram_hash_reference
from graphc.passes.inline_reference_kernels import inline_kernels
from graphc.passes.manager import PassContext, PassResult

INT64_KERNELS = {"graphc::ngram_hash": ngram_hash_reference}


def inline_int64_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return inline_kernels(gm, INT64_KERNELS)
