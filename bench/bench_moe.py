"""The static-MoE rewrite against the generic (gather / reduce-scatter) MoE: expert rows computed
and bytes moved per rank per MoE layer, and the layer's time, on real gloo ranks in the same run.

    .venv/bin/python bench/bench_moe.py [--topologies 2 4] [--repeats 200]

One MoE layer of the 16-expert tiny preset (cp = ep = N: every rank sees every token, as the
runtime serves) runs in both forms on a decode step (8 sequences x 1 token) and a prefill chunk
(32 tokens). Counted on every rank while the layer runs: rows entering the routed experts times
the rank's experts (each local expert runs densely on each row it is given), the bytes each
collective takes in and gives back, and the bytes a rank sends under the ring algorithms
(all-gather (N-1)·n, reduce-scatter (N-1)/N·n, all-reduce 2(N-1)/N·n; n = input bytes). The
static form must cut rows by N. Time is the layer's forward, best of `--repeats` after warm-up,
slowest rank; its ratio is the result.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from graphc import ops
from graphc.models.checkpoint import load_model
from graphc.models.deepseek_v3 import Parallelism
from graphc.models.tiny import make_tiny_checkpoint
from graphc.ops.distributed import register_groups
from graphc.topology import Topology
from ranks import run_ranks

PRESET = "wide-16e"
SHAPES = {"decode 8x1": (8, 1), "prefill 1x32": (1, 32)}
RING_SENT = {"moe_dispatch": lambda n, size: (size - 1) * n, "moe_combine": lambda n, size: (size - 1) * n // size,
             "all_reduce": lambda n, size: 2 * (size - 1) * n // size}


class Counter:
    """Wraps the MoE collectives and the routed experts to count what one forward moves and computes."""

    def __init__(self, ep: int):
        self.ep, self.rows, self.bytes_in, self.bytes_out, self.sent = ep, 0, 0, 0, 0

    def collective(self, name, op):
        def counted(tensor, *args):
            out = op(tensor, *args)
            n = tensor.numel() * tensor.element_size()
            self.bytes_in += n
            self.bytes_out += out.numel() * out.element_size()
            self.sent += RING_SENT[name](n, self.ep)
            return out
        return counted

    def experts(self, forward):
        def counted(module, x, *args):
            self.rows += x.shape[0] * module.gate_proj.shape[0]  # every local expert on every row
            return forward(module, x, *args)
        return counted


def worker(rank, world, port, results, checkpoint, repeats):
    topology = Topology(world, world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=topology.world)
    register_groups(topology, rank)
    try:
        args = load_model(checkpoint).args
        model = load_model(checkpoint, experts=topology.experts(rank, args.n_routed_experts))
        moe = model.model.layers[0].mlp
        counter = Counter(topology.ep)
        for name in RING_SENT:
            setattr(ops, name, counter.collective(name, getattr(ops, name)))
        experts_type = type(moe.experts)
        experts_type.forward = counter.experts(experts_type.forward)
        out = {}
        for static in (True, False):
            parallel = Parallelism(cp_rank=topology.cp_rank(rank), cp=topology.cp, ep_rank=topology.ep_rank(rank),
                                   ep=topology.ep, tokens_replicated=static)
            for shape_name, shape in SHAPES.items():
                x = torch.randn(*shape, args.hidden_size, generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    counter.__init__(topology.ep)
                    moe(x, parallel)
                    counts = (counter.rows, counter.bytes_in, counter.bytes_out, counter.sent)
                    for _ in range(10):
                        moe(x, parallel)
                    best = float("inf")
                    for _ in range(repeats):
                        dist.barrier()
                        start = time.perf_counter()
                        moe(x, parallel)
                        best = min(best, time.perf_counter() - start)
                out["static" if static else "generic", shape_name] = (*counts, best)
        results[rank] = out
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", type=int, nargs="+", default=[2, 4], help="cp = ep = N for each N")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(make_tiny_checkpoint(Path(tmp) / PRESET, preset=PRESET, seed=0))
        print(f"one MoE layer of {PRESET} (16 routed experts, hidden 64, fp32); per rank, per layer, per step")
        print(f"{'cp=ep':>5} {'step':>13} {'form':>8} {'expert rows':>11} {'coll. in B':>10} {'coll. out B':>11} "
              f"{'ring sent B':>11} {'time us':>8}")
        for n in args.topologies:
            per_rank = run_ranks(worker, n, checkpoint, args.repeats)
            for shape_name in SHAPES:
                rows = {}
                for form in ("static", "generic"):
                    measured = [r[form, shape_name] for r in per_rank]
                    assert len({m[:4] for m in measured}) == 1, f"ranks differ: {measured}"  # symmetric topology
                    count_rows, bytes_in, bytes_out, sent, _ = measured[0]
                    slowest = max(m[4] for m in measured)
                    rows[form] = (count_rows, sent, slowest)
                    print(f"{n:>5} {shape_name:>13} {form:>8} {count_rows:>11} {bytes_in:>10} {bytes_out:>11} "
                          f"{sent:>11} {slowest * 1e6:>8.0f}")
                (s_rows, s_sent, s_time), (g_rows, g_sent, g_time) = rows["static"], rows["generic"]
                print(f"{'':>5} {'':>13} {'ratio':>8} {g_rows / s_rows:>10.1f}x {'':>10} {'':>11} "
                      f"{g_sent / s_sent:>10.1f}x {g_time / s_time:>7.2f}x  (generic / static)")


if __name__ == "__main__":
    main()
