"""The MoE's exchange lowerings under data-parallel attention: bytes each rank sends and
receives per MoE layer, and the layer's time, for `a2a_even` and `a2a_v` against `ag_rs`, on real
gloo ranks in the same run; and the static MoE (tokens replicated over the group) for scale.

    .venv/bin/python bench/bench_moe.py [--worlds 2 4 8] [--repeats 50]

One MoE layer of the 16-expert tiny preset (hidden 64, 4 experts per token, fp32) at
(dp, cp, ep) = (N, 1, N): every rank holds its own tokens and 16 / N experts. Steps: decode (8
rows x 1 token) and prefill (1 x 64). Bytes are payloads between distinct ranks, counted on
each rank around torch.distributed's calls while the layer runs: an all-gather sends its input
to N - 1 ranks and receives N - 1 inputs; a reduce-scatter sends the N - 1 blocks that are
not its own and receives N - 1 of its own; an all-to-all sends (receives) every block but its
own, with `a2a_v` at its split sizes. `ag_rs` moves every token to every rank; the all-to-alls
move a token only to the ranks holding one of its experts (at most min(K, N) of N), `a2a_v`
without the zero rows. The static form is the cp = ep = N layout (every rank sees every token):
not an alternative for DP, shown as what replication costs. Time: the layer's forward, best of
`--repeats` after warm-up, slowest rank; the ratio column is ag_rs over the lowering.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from graphc.weights.checkpoint import load_model
from graphc.models.step_model import Parallelism, StepInputs
from graphc.weights.tiny import make_tiny_checkpoint
from graphc.ops.distributed import register_groups
from graphc.topology import Topology
from ranks import run_ranks

PRESET = "wide-16e"
SHAPES = {"decode 8x1": (8, 1), "prefill 1x64": (1, 64)}
EXCHANGES = ("ag_rs", "a2a_even", "a2a_v", "static")


class ByteCounter:
    """Wraps torch.distributed's collectives to add up what this rank sends and receives."""

    def __init__(self):
        self.sent = self.received = 0
        self._originals = {}

    def install(self) -> None:
        def bytes_of(tensor) -> int:
            return tensor.numel() * tensor.element_size()

        def all_gather_single(output, input, group=None, **kwargs):
            others = dist.get_world_size(group) - 1
            self.sent += others * bytes_of(input)
            self.received += others * bytes_of(input)
            return self._originals["all_gather_single"](output, input, group=group, **kwargs)

        def reduce_scatter_single(output, input, group=None, **kwargs):
            others = dist.get_world_size(group) - 1
            self.sent += bytes_of(input) - bytes_of(output)
            self.received += others * bytes_of(output)
            return self._originals["reduce_scatter_single"](output, input, group=group, **kwargs)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            size, me = dist.get_world_size(group), dist.get_rank(group)
            row_in = bytes_of(input) // max(1, input.shape[0])
            row_out = bytes_of(output) // max(1, output.shape[0])
            send = input_split_sizes or [input.shape[0] // size] * size
            receive = output_split_sizes or [output.shape[0] // size] * size
            self.sent += (sum(send) - send[me]) * row_in
            self.received += (sum(receive) - receive[me]) * row_out
            return self._originals["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                                        group=group, **kwargs)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, **kwargs):
            # Reduce-scatter then all-gather: the least any algorithm moves.
            others = dist.get_world_size(group) - 1
            self.sent += 2 * others * bytes_of(tensor) // (others + 1)
            self.received += 2 * others * bytes_of(tensor) // (others + 1)
            return self._originals["all_reduce"](tensor, op=op, group=group, **kwargs)

        for name, wrapper in (("all_gather_single", all_gather_single), ("reduce_scatter_single", reduce_scatter_single),
                              ("all_to_all_single", all_to_all_single), ("all_reduce", all_reduce)):
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, wrapper)

    def reset(self) -> None:
        self.sent = self.received = 0


def worker(rank, world, port, results, checkpoint, repeats):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data_parallel, replicated = Topology(1, world, world), Topology(world, world)
    try:
        args = load_model(checkpoint).args
        moe = load_model(checkpoint, experts=data_parallel.experts(rank, args.n_routed_experts)).model.layers[1].mlp
        counter = ByteCounter()
        counter.install()
        register_groups(data_parallel, rank)  # the EP group is the world in both layouts, all the MoE uses
        out = {}
        for exchange in EXCHANGES:
            topology = replicated if exchange == "static" else data_parallel
            parallel = Parallelism(cp_rank=topology.cp_rank(rank), cp=topology.cp, ep_rank=topology.ep_rank(rank),
                                   ep=topology.ep, moe_exchange=exchange)
            for shape_name, shape in SHAPES.items():
                # Each rank its own tokens, except where the static form needs them replicated.
                seed = 0 if exchange == "static" else rank
                x = torch.randn(*shape, args.hidden_size, generator=torch.Generator().manual_seed(seed))
                step = StepInputs(None, None, torch.zeros(shape, dtype=torch.int64), None, parallel)
                with torch.no_grad():
                    for _ in range(5):
                        moe(x, step)
                    counter.reset()
                    moe(x, step)
                    moved = (counter.sent, counter.received)
                    best = float("inf")
                    for _ in range(repeats):
                        dist.barrier()
                        start = time.perf_counter()
                        moe(x, step)
                        best = min(best, time.perf_counter() - start)
                out[exchange, shape_name] = (*moved, best)
        results[rank] = out
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="dp = ep = N for each N")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(make_tiny_checkpoint(Path(tmp) / PRESET, preset=PRESET, seed=0))
        print(f"one MoE layer of {PRESET} (16 routed experts, 4 per token, hidden 64, fp32); per rank per layer")
        print(f"{'N':>3} {'step':>13} {'exchange':>9} {'sent B (max)':>12} {'recv B (max)':>12} {'time us':>8} "
              f"{'ag_rs / this':>18}")
        for world in args.worlds:
            per_rank = run_ranks(worker, world, checkpoint, args.repeats)
            for shape_name in SHAPES:
                measured = {}
                for exchange in EXCHANGES:
                    ranks = [r[exchange, shape_name] for r in per_rank]
                    measured[exchange] = (max(m[0] for m in ranks), max(m[1] for m in ranks), max(m[2] for m in ranks))
                base_sent, _, base_time = measured["ag_rs"]
                for exchange, (sent, received, seconds) in measured.items():
                    ratio = f"{base_sent / sent:5.2f}x B {base_time / seconds:5.2f}x t" if sent else ""
                    print(f"{world:>3} {shape_name:>13} {exchange:>9} {sent:>12} {received:>12} {seconds * 1e6:>8.0f} "
                          f"{ratio:>18}")


if __name__ == "__main__":
    main()
