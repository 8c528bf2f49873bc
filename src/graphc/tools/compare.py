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

Single-rank artifacts (cp = ep = dp = 1): the teacher-forced steps run the compiled graphs
directly, with the logits they return.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from graphc.buckets.selection import Bucket, chunk_lengths, smallest_fitting
from graphc.errors import GraphcError
from graphc.config import GraphcConfig
from graphc.models.checkpoint import load_reference
from graphc.runtime.engine import Engine
from graphc.runtime.paged import METADATA_FIELDS, BlockAllocator, SequenceBlocks, step_metadata
from graphc.sampling import Sampling, sampler_inputs

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
    if config.family.reference_model is not None:
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


class TeacherForced:
    """The compiled graphs of single-rank artifacts, fed given tokens; their logits per step."""

    def __init__(self, artifacts: Path):
        self.engine = Engine(artifacts)  # refuses multi-rank artifacts, naming `graphc run`
        manifest = self.engine.manifest
        self.buckets = manifest.buckets
        self.block_size, self.blocks_per_row = manifest.kv_cache.block_size, manifest.kv_cache.blocks_per_row
        self.context_limit = manifest.buckets.context_limit

    def logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] fp32: the logits after the prompt, then after each of tokens[:-1]."""
        if len(prompt) + len(tokens) > self.context_limit:
            raise GraphcError(f"a prompt of {len(prompt)} and {len(tokens)} new tokens exceed the artifacts' "
                              f"context_limit {self.context_limit}")
        allocator = BlockAllocator(self.engine.loaded.num_blocks)
        sequence = SequenceBlocks(self.block_size)
        sequence.reserve(len(prompt) + len(tokens), allocator)
        start, out = 0, []
        for length in chunk_lengths(len(prompt), max(self.buckets.prefill)):
            bucket = Bucket("prefill", smallest_fitting(self.buckets.prefill, length))
            logits = self._step(bucket, sequence, prompt[start:start + length], start)
            start += length
        out.append(logits)
        decode = Bucket("decode", min(self.buckets.decode))
        for i, token in enumerate(tokens[:-1]):
            out.append(self._step(decode, sequence, [token], len(prompt) + i))
        allocator.release(sequence.blocks)
        return torch.stack(out)

    def _step(self, bucket: Bucket, sequence: SequenceBlocks, tokens: list[int], start: int) -> torch.Tensor:
        fields = step_metadata([(sequence, tokens, start)], bucket.width, self.blocks_per_row, total_rows=bucket.rows)
        inputs = {**dict(zip(METADATA_FIELDS, fields)), **sampler_inputs([Sampling()], [0], bucket.rows)}
        with torch.no_grad():
            _, logits = self.engine.run_bucket(bucket, inputs)
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
    forced = TeacherForced(artifacts)
    dtype = forced.engine.kv_pool.dtype
    reference = reference_logits(config, dtype)
    neighbours = [reference_logits(config, dtype, seed) for seed in range(seeds)]
    reports = []
    for prompt in prompts:
        tokens, expected = golden(reference, prompt, new_tokens)
        compiled = forced.logits(prompt, tokens)
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
