"""Per-step cost of publishing host metadata to the followers: graphc's shared-memory StepChannel
against `torch.distributed.broadcast_object_list` (gloo), and the channel of a job that spans
hosts (`CrossHostChannel`: the record broadcast once per host to its relay, which republishes it
on its host's segment) at `--hosts` hosts of `world / hosts` ranks, all measured in the same run.

    .venv/bin/python bench/bench_channel.py [--steps 2000] [--world 2 4] [--hosts 2 4] [--rows 8] [--width 1]

Each step carries what the engine publishes for a decode step of `rows` sequences (token ids,
positions, logits index, every rank's block table and slot mapping). The leader publishes
`steps` steps back to back and every follower reads each one; per-step cost = wall time between
two barriers / steps, on the slowest rank. Ratios are the result; absolute times are context.
The "hosts" here share one machine and talk over loopback TCP: the figures are the channel's
own host overhead (gloo, copies, republishing), not a network's latency, which adds to it once
per step (one broadcast) on a real cluster.
"""

from __future__ import annotations

import argparse
import time
import uuid

import torch
import torch.distributed as dist

from graphc.buckets.selection import Bucket
from graphc.runtime.channel import StepChannel
from graphc.runtime.cross_host import CrossHostChannel, cross_host_groups
from graphc.runtime.hosts import HostLayout
from ranks import run_ranks

BLOCKS_PER_ROW = 16


def step_fields(world: int, rows: int, width: int, step: int) -> dict[str, torch.Tensor]:
    """Every rank's inputs of a decode step, as the engine publishes them ([world, ...] each)."""
    cells = torch.arange(rows * width, dtype=torch.int64).view(rows, width) + step
    per_rank = lambda t: torch.stack([t] * world)  # noqa: E731
    return {"input_ids": per_rank(cells % 256), "positions": per_rank(cells),
            "logits_index": per_rank(torch.full((rows,), width - 1)),
            "block_table": torch.arange(world * rows * BLOCKS_PER_ROW).view(world, rows, BLOCKS_PER_ROW),
            "slot_mapping": per_rank(cells), "temperature": per_rank(torch.full((rows,), 0.7)),
            "top_k": per_rank(torch.zeros(rows, dtype=torch.int64)), "top_p": per_rank(torch.ones(rows)),
            "seed": per_rank(torch.arange(rows) + step)}


def timed(fn, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(steps)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def worker(rank, world, port, results, args, channel_name):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layouts = [HostLayout(hosts, world // hosts) for hosts in args.hosts if world % hosts == 0 and hosts <= world]
    groups = [cross_host_groups(layout, timeout=600.0) for layout in layouts]  # collective: every rank, in order
    channels = {1: StepChannel(channel_name, world, args.rows, args.width, BLOCKS_PER_ROW, rank)}
    for layout, pair in zip(layouts, groups):
        host_ranks = layout.ranks(layout.host_of(rank))
        local = StepChannel(f"{channel_name}-{layout.hosts}-{layout.host_of(rank)}", world, args.rows, args.width,
                            BLOCKS_PER_ROW, rank, publisher=host_ranks[0], readers=tuple(host_ranks[1:]))
        channels[layout.hosts] = CrossHostChannel(local, layout, pair)
    dist.barrier()  # every segment created before followers attach
    bucket = Bucket("decode", args.rows, args.width)
    payloads = [step_fields(world, args.rows, args.width, s) for s in range(2)]

    def over(channel):
        def steps_over_channel(steps):
            for step in range(steps):
                if rank == 0:
                    channel.publish(step, bucket, payloads[step % 2])
                else:
                    channel.receive(step)  # the closing barrier waits for the followers' last read
        return steps_over_channel

    def over_broadcast(steps):
        for step in range(steps):
            message = [{"bucket": bucket, **payloads[step % 2]}] if rank == 0 else [None]
            dist.broadcast_object_list(message, src=0)

    try:
        costs = {}
        for hosts, channel in channels.items():
            over(channel)(50)  # warm-up
            costs[hosts] = timed(over(channel), args.steps)
        over_broadcast(50)
        costs["broadcast"] = timed(over_broadcast, args.steps)
        results[rank] = {"costs": costs, "record_bytes": 8 * (2 + channels[1].slot_words)}
        dist.barrier()
    finally:
        for channel in channels.values():
            channel.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4],
                        help="Hosts the cross-host channel spans (those that divide the world).")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=1)
    args = parser.parse_args()
    print(f"per-step host metadata, decode step of {args.rows} x {args.width}, {args.steps} steps")
    for world in args.world:
        results = run_ranks(worker, world, args, f"graphc-bench-{uuid.uuid4().hex[:8]}")
        cost = {key: max(r["costs"][key] for r in results) for key in results[0]["costs"]}
        channel, broadcast = cost.pop(1), cost.pop("broadcast")
        print(f"world {world}: shared-memory channel {channel * 1e6:8.1f} us/step, broadcast_object_list "
              f"{broadcast * 1e6:8.1f} us/step -> channel is {broadcast / channel:.1f}x cheaper")
        for hosts, seconds in cost.items():
            print(f"  {hosts} hosts x {world // hosts} ranks: {seconds * 1e6:8.1f} us/step "
                  f"({seconds / channel:.1f}x one host's channel, +{(seconds - channel) * 1e6:.1f} us); "
                  f"the step record ({results[0]['record_bytes']} B) crosses to each of {hosts - 1} other "
                  "host(s) once a step")


if __name__ == "__main__":
    main()
