"""`graphc compare MODEL_YAML ARTIFACTS`: compiled artifacts against the model's reference, judged
by the reference's own noise floor.

Per prompt:
1. golden: the reference generates greedily in the artifacts' dtype (graphc's eager
   `models/deepseek_v41/reference.py` for DeepSeek-V4.1, which transformers lacks; transformers'
   `AutoModelForCausalLM` for the others), keeping its logits r_t at every step;
2. the compiled graphs run teacher-forced on the golden tokens (prefill of the prompt in the
   artifacts' prefill buckets, then one decode step per golden token), giving c_t on the same
   prefixes, so a disagreement never cascades;
3. the noise floor at step t: the largest logit deviation from r_t of the reference run
   teacher-forced with its embedding table perturbed by one rounding step of the dtype (a relative
   2^-8 in bf16, 2^-24 in fp32), over several seeds: how far the reference itself moves under
   noise it cannot tell from its own rounding (in an MoE, one ulp can flip an expert choice).
A step where argmax c_t is not the golden token is inside the floor when the reference's own
margin between the two tokens is at most twice the floor (each logit may be off by one floor);
otherwise it is a failure, and `graphc compare` exits 1. How many golden tokens each perturbed
reference itself keeps (its argmax on the same prefixes) is reported beside the compiled count:
on a checkpoint with near-tied logits the reference loses tokens to its own rounding too, and
that count is the yardstick for the compiled one.

Artifacts of any topology: the teacher-forced steps run as `graphc run` serves (one process per
rank when there are several, the leader publishing each step to the followers), and the leader's
logits are compared (with tensor parallelism, the LM head's vocabulary shards gathered).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from graphc.artifacts.directory import read_manifest
from graphc.backends import backend
from graphc.buckets.selection import Bucket, chunk_lengths, smallest_fitting
from graphc.errors import GraphcError
from graphc.config import GraphcConfig
from graphc.weights.checkpoint import load_reference
from graphc.runtime.engine import Engine
from graphc.runtime.launch import Job, run_job
from graphc.runtime.paged import BlockAllocator, SequenceBlocks
from graphc.runtime.scheduler import Request, Sequence, Step

RELATIVE_STEP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
"""One rounding step of each dtype, relative (half the spacing of its significands)."""
DEFAULT_PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(10, 47)), [9, 8, 7, 6, 5, 4, 3, 2]]
"""Token ids valid in any vocabulary of 256 or more (graphc's tiny checkpoints')."""

Logits = Callable[[list[int]], torch.Tensor]
"""A reference: token ids of one sequence -> fp32 logits at every position [T, V]."""


@dataclass
class Mismatch:
    step: int
    golden: int
    compiled: int
    margin: float
    """The reference's logit of the golden token minus its logit of the compiled one."""
    floor: float
    inside_floor: bool


@dataclass
class PromptReport:
    prompt: list[int]
    golden: list[int]
    matched: int
    cosine: list[float]
    relative_error: list[float]
    floor: list[float]
    reference_matched: list[int]
    """Per perturbation seed: the golden tokens the perturbed reference's own argmax keeps."""
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def worst_step(self) -> int:
        return min(range(len(self.cosine)), key=self.cosine.__getitem__)


def reference_logits(config: GraphcConfig, dtype: torch.dtype, perturbation_seed: int | None = None) -> Logits:
    """The model's reference as a function of a sequence; with `perturbation_seed`, its
    embedding table moved by up to one rounding step of `dtype` (uniform noise of that seed)."""
    checkpoint = config.model.checkpoint
    if config.family.reference.model is not None:
        model = load_reference(checkpoint, dtype)
        embedding = model.embed.weight

        def run(ids: list[int]) -> torch.Tensor:
            return model(torch.tensor([ids]))[0].float()
    else:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise GraphcError("graphc compare takes its reference for this architecture from transformers, which "
                              "is not installed: pip install transformers") from None
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
        embedding = model.get_input_embeddings().weight

        def run(ids: list[int]) -> torch.Tensor:
            return model(torch.tensor([ids])).logits[0].float()
    if perturbation_seed is not None:
        noise = torch.rand(embedding.shape, generator=torch.Generator().manual_seed(perturbation_seed)) * 2 - 1
        with torch.no_grad():
            embedding.copy_((embedding.float() * (1 + RELATIVE_STEP[dtype] * noise)).to(embedding.dtype))
    return torch.no_grad()(run)


@dataclass(frozen=True)
class TeacherForcedJob(Job):
    """The compiled graphs fed given tokens, on every rank of the artifacts: per case (prompt,
    tokens), the leader's logits after the prompt and then after each of tokens[:-1] [len(tokens), V].
    The steps are the scheduler's kind (`Step`s the engine publishes to the followers, the
    sequence's KV blocks over the context-parallel shards, other replicas' rows all padding), so a
    multi-rank compare runs the very path `graphc run` serves."""

    cases: list[tuple[list[int], list[int]]]

    def lead(self, engine: Engine) -> list[torch.Tensor]:
        forced = TeacherForced(engine)
        return [forced.logits(prompt, tokens) for prompt, tokens in self.cases]


class TeacherForced:
    """The leader's side of `TeacherForcedJob`: one sequence at a time over the engine's pool."""

    def __init__(self, engine: Engine):
        self.engine = engine
        manifest = engine.manifest
        self.buckets, self.block_size = manifest.buckets, manifest.kv_cache.block_size
        self.shards, self.replicas = manifest.topology.cp, manifest.topology.dp
        scratch = int(backend(manifest.backend).fixed_pool)  # as the scheduler: the scratch block is never allocated
        self.allocators = [BlockAllocator(engine.loaded.num_blocks - scratch) for _ in range(self.shards)]

    def logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        if len(prompt) + len(tokens) > self.buckets.context_limit:
            raise GraphcError(f"a prompt of {len(prompt)} and {len(tokens)} new tokens exceed the artifacts' "
                              f"context_limit {self.buckets.context_limit}")
        sequence = Sequence(0, Request(prompt, len(tokens)), SequenceBlocks(self.block_size, num_shards=self.shards))
        sequence.blocks.reserve(len(prompt) + len(tokens), self.allocators)
        start, out = 0, []
        for length in chunk_lengths(len(prompt), max(self.buckets.prefill)):
            bucket = Bucket("prefill", smallest_fitting(self.buckets.prefill, length))
            logits = self._step(bucket, sequence, prompt[start:start + length], start)
            start += length
        out.append(logits)
        decode = Bucket("decode", min(self.buckets.decode))
        for i, token in enumerate(tokens[:-1]):
            out.append(self._step(decode, sequence, [token], len(prompt) + i))
        for shard, allocator in enumerate(self.allocators):
            allocator.release(sequence.blocks.shard_blocks(shard))
        return torch.stack(out)

    def _step(self, bucket: Bucket, sequence: Sequence, tokens: list[int], start: int) -> torch.Tensor:
        # One row, in the first replica; every other replica's rows are padding.
        step = Step(bucket, [(sequence, tokens, start)], (1,) + (0,) * (self.replicas - 1) if self.replicas > 1 else ())
        _, logits, _ = self.engine.lead_step(step)
        return logits[0].float()


def golden(reference: Logits, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The reference's greedy tokens and its logits at each step [new_tokens, V]."""
    sequence, steps = list(prompt), []
    for _ in range(new_tokens):
        steps.append(reference(sequence)[-1])
        sequence.append(int(steps[-1].argmax()))
    return sequence[len(prompt):], torch.stack(steps)


def compare(config: GraphcConfig, artifacts: Path, prompts: list[list[int]], new_tokens: int,
            seeds: int) -> list[PromptReport]:
    """Per prompt, the compiled artifacts against the reference of `config`'s model (`seeds` >= 1
    perturbed runs measure its floor)."""
    manifest = read_manifest(artifacts)
    dtype = getattr(torch, manifest.model.dtype)
    reference = reference_logits(config, dtype)
    goldens = [golden(reference, prompt, new_tokens) for prompt in prompts]
    forced = run_job(artifacts, TeacherForcedJob([(prompt, tokens) for prompt, (tokens, _) in zip(prompts, goldens)]),
                     manifest)
    neighbours = [reference_logits(config, dtype, seed) for seed in range(seeds)]
    reports = []
    for prompt, (tokens, expected), compiled in zip(prompts, goldens, forced):
        sequence = prompt + tokens[:-1]
        perturbed = torch.stack([neighbour(sequence)[len(prompt) - 1:] for neighbour in neighbours])  # [seeds, T, V]
        floor = (perturbed - expected).abs().amax(-1).amax(0)  # [new_tokens]
        golden_ids = torch.tensor(tokens)
        reference_matched = [int((p.argmax(-1) == golden_ids).sum()) for p in perturbed]
        cosine = torch.nn.functional.cosine_similarity(compiled, expected, dim=-1)
        error = (compiled - expected).norm(dim=-1) / expected.norm(dim=-1)
        choices = compiled.argmax(-1).tolist()
        report = PromptReport(prompt, tokens, sum(c == g for c, g in zip(choices, tokens)), cosine.tolist(),
                              error.tolist(), floor.tolist(), reference_matched)
        for step, (choice, token) in enumerate(zip(choices, tokens)):
            if choice != token:
                margin = (expected[step, token] - expected[step, choice]).item()
                report.mismatches.append(Mismatch(step, token, choice, margin, floor[step].item(),
                                                  margin <= 2 * floor[step].item()))
        reports.append(report)
    return reports


def as_json(reports: list[PromptReport]) -> list[dict]:
    return [{**asdict(r), "worst_step": r.worst_step} for r in reports]


def summary_lines(reports: list[PromptReport]) -> list[str]:
    lines = []
    for i, r in enumerate(reports):
        worst = r.worst_step
        floor = sorted(r.floor)
        lines.append(f"prompt {i} ({len(r.prompt)} tokens): greedy tokens matched {r.matched}/{len(r.golden)}; "
                     f"worst step {worst}: cosine {r.cosine[worst]:.6f}, relative error {r.relative_error[worst]:.4g}; "
                     f"max relative error {max(r.relative_error):.4g}; noise floor min {floor[0]:.4g}, "
                     f"median {floor[len(floor) // 2]:.4g}, max {floor[-1]:.4g}; the perturbed reference "
                     f"itself keeps {min(r.reference_matched)}-{max(r.reference_matched)}/{len(r.golden)}")
        for m in r.mismatches:
            where = "inside" if m.inside_floor else "OUTSIDE"
            lines.append(f"  step {m.step}: golden {m.golden}, compiled {m.compiled}, reference margin {m.margin:.4g} "
                         f"{where} 2 x floor {m.floor:.4g}")
    return lines
