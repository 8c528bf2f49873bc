"""graphc:: op of DeepSeek-V4's manifold-constrained hyper-connections (mHC).

`hc_sinkhorn` makes each token's stream-mixing matrix doubly stochastic by Sinkhorn iterations.
It is one op, as a device kernel fuses it: inlined, 20 iterations of (sum, add, divide) twice over
are 912 of the tiny V4 step's ~3300 ATen ops, and they dominated its export, load and AOTInductor
compile times, while the work itself ([T, n, n], n = 4) is nothing beside one call.

Shape letters: T tokens (any leading dims), n streams.
"""

from __future__ import annotations

from torch import Tensor

from graphc.ops.library import define_op


def hc_sinkhorn_reference(comb: Tensor, iterations: int, eps: float) -> Tensor:
    """[..., n, n] positive weights -> doubly stochastic (to `eps`): columns normalised, then
    `iterations` - 1 rounds of rows then columns (DeepSeek's order; transformers' too).

    Args:
        comb: [..., n, n] fp32, positive (a softmax plus eps).
        iterations: Sinkhorn iterations t_max (the first is the column normalisation alone).
        eps: added to every normaliser.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.contiguous()


hc_sinkhorn = define_op("hc_sinkhorn(Tensor comb, int iterations, float eps) -> Tensor", hc_sinkhorn_reference,
                        lambda comb, iterations, eps: comb.new_empty(comb.shape))
