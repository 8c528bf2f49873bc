"""The generation loop on one rank: scheduler -> step metadata -> precompiled graph -> tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from graphc.paged import step_metadata
from graphc.runtime.loader import LoadedRank, load_rank
from graphc.runtime.scheduler import Request, Result, Scheduler
from graphc.sampling import sampler_inputs

__all__ = ["Engine", "Request", "Result"]


class Engine:
    """Serves requests from an artifacts directory; never compiles.

    Args:
        artifacts: a `graphc compile` output directory (verified before anything loads).
    """

    def __init__(self, artifacts: str | Path):
        self.loaded: LoadedRank = load_rank(Path(artifacts))
        manifest = self.loaded.manifest
        self.manifest = manifest
        model = manifest.model
        self.kv_pool = torch.zeros(
            model["num_hidden_layers"], self.loaded.num_blocks, manifest.kv_cache["block_size"],
            model["kv_cache_dim"], dtype=getattr(torch, model["dtype"]),
        )

    def generate(self, requests: list[Request]) -> list[Result]:
        """Run every request to completion; results come back in request order."""
        m = self.manifest
        scheduler = Scheduler(
            requests, prefill=m.buckets["prefill"], decode=m.buckets["decode"],
            context_limit=m.buckets["context_limit"], block_size=m.kv_cache["block_size"],
            num_blocks=self.loaded.num_blocks, max_num_prefilling_tokens=m.runtime["max_num_prefilling_tokens"],
            eos_token_ids=m.model["eos_token_id"],
        )
        with torch.no_grad():
            while not scheduler.done:
                step = scheduler.next_step()
                rows = [(s.blocks, tokens, start) for s, tokens, start in step.rows]
                input_ids, positions, block_table, slots, last = step_metadata(
                    rows, step.bucket.width, m.kv_cache["blocks_per_row"], total_rows=step.bucket.rows)
                sampling = sampler_inputs([s.request.sampling for s, _, _ in step.rows],
                                          [len(s.output) for s, _, _ in step.rows], step.bucket.rows)
                tokens, _ = self.loaded.runners[step.bucket](self.loaded.weights, {
                    "input_ids": input_ids, "positions": positions, "block_table": block_table,
                    "slot_mapping": slots, "kv_pool": self.kv_pool, "logits_index": last, **sampling,
                })
                scheduler.complete(step, tokens[: len(step.rows)].tolist())
        return [scheduler.results[i] for i in range(len(requests))]
