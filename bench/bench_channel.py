"""Per-step cost of publishing host metadata to the followers: graphc's shared-memory StepChannel
against `torch.distributed.broadcast_object_list` (gloo), measured in the same run.

    .venv/bin/python bench/bench_channel.py [--steps 2000] [--world 2 4] [--rows 8] [--width 1]

Each step carries what the engine publishes for a decode step of `rows` sequences (token ids,
positions, logits index, every rank's block table and slot mapping). The leader publishes
`steps` steps back to back and every follower reads each one; per-step cost = wall time between
two barriers / steps, on the slowest rank. Ratios are the result; absolute times are context.
"""

from __future__ import annotations

import argparse
import time
import uuid

import torch
import torch.distributed as dist

from graphc.buckets.selection import Bucket
from graphc.runtime.channel import StepChannel
from ranks import run_ranks

BLOCKS_PER_ROW = 16


def step_fields(world: int, rows: int, width: int, step: int) -> dict[str, torch.Tensor]:
    cells = torch.arange(rows * width, dtype=torch.int64).view(rows, width) + step
    return {"input_ids": cells % 256, "positions": cells, "logits_index": torch.full((rows,), width - 1),
            "block_table": torch.arange(world * rows * BLOCKS_PER_ROW).view(world, rows, BLOCKS_PER_ROW),
            "slot_mapping": torch.stack([cells] * world)}


def timed(fn, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(steps)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def worker(rank, world, port, results, args, channel_name):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    channel = StepChannel(channel_name, world, args.rows, args.width, BLOCKS_PER_ROW, rank)
    dist.barrier()  # the leader created the segment before followers attach
    bucket = Bucket("decode", args.rows, args.width)
    payloads = [step_fields(world, args.rows, args.width, s) for s in range(2)]

    def over_channel(steps):
        for step in range(steps):
            if rank == 0:
                channel.publish(step, bucket, payloads[step % 2])
            else:
                channel.receive(step)  # the closing barrier waits for the followers' last read

    def over_broadcast(steps):
        for step in range(steps):
            message = [{"bucket": bucket, **payloads[step % 2]}] if rank == 0 else [None]
            dist.broadcast_object_list(message, src=0)

    try:
        over_channel(50), over_broadcast(50)  # warm-up
        costs = {"channel": timed(over_channel, args.steps), "broadcast": timed(over_broadcast, args.steps)}
        results[rank] = costs
        dist.barrier()
    finally:
        channel.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=1)
    args = parser.parse_args()
    print(f"per-step host metadata, decode step of {args.rows} x {args.width}, {args.steps} steps")
    for world in args.world:
        results = run_ranks(worker, world, args, f"graphc-bench-{uuid.uuid4().hex[:8]}")
        channel = max(r["channel"] for r in results)
        broadcast = max(r["broadcast"] for r in results)
        print(f"world {world}: shared-memory channel {channel * 1e6:8.1f} us/step, broadcast_object_list "
              f"{broadcast * 1e6:8.1f} us/step -> channel is {broadcast / channel:.1f}x cheaper")


if __name__ == "__main__":
    main()
