"""The `graphc` op library: how every graphc:: op is defined.

Each op is defined from an explicit schema in the `graphc` library, with a real kernel and a fake
one, so `torch.export` keeps it as one `call_function` node (string and int arguments intact)
that topology passes can find and rewrite. (`torch.library.custom_op` would infer the schemas,
but its Python autograd wrapper costs about 35 us per call: most of a KV write on the CPU.)
The real kernels are the single-device semantics; collectives carry a *semantic* group name
("cp", "ep", "world"), never a rank list.

Every op returns contiguous tensors, from its real kernel and its fake alike: compilers trust the
fake's strides, and a real output laid out differently is read as garbage (seen with AOTInductor
when a fake used `empty_like` of a permuted input).
"""

from __future__ import annotations

import torch
from torch import Tensor

_LIBRARY = torch.library.Library("graphc", "DEF")


def define_op(schema: str, kernel, fake):
    """Register `graphc::<schema>` with its kernel (all devices) and fake; return the op."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphc::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.graphc, name)


Shard = Tensor | int | None
"""A rank's place in its group as ops take it: in a step graph a 0-d int32 tensor sliced from the
step's `coordinates` input (so one graph serves every rank of the group); in eager code an int;
None is shard 0 (one device)."""


def shard_number(shard: Shard) -> Tensor | int:
    """`shard` as index arithmetic takes it (None: 0)."""
    return 0 if shard is None else shard
