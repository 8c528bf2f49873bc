"""`model.yaml`: the schema and its strict loader.

The file mirrors these dataclasses section by section; every field's docstring is its
documentation. Loading is strict: an unknown key, a wrong type or an impossible value raises
`ConfigError` naming the key path (`buckets.prefill[2]`), the value and what is allowed.
Relative paths resolve against the YAML file's directory.

Example:

    model:
      checkpoint: ./tiny-ckpt
      dtype: float32
    topology: {dp: 1, cp: 1, ep: 1}
    buckets:
      prefill: [16, 64]
      decode: [1, 4, 8]
      prompt_as_decode: 4
      context_limit: 256
      # or, instead of the three lists, plan them from traffic:
      # auto: {workload: prompt-lengths.txt, graphs: 12, max_decode_batch: 8}
    kv_cache: {block_size: 16, num_blocks: 64}
    runtime:
      max_num_prefilling_tokens: 64
      sampling: {temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0}
    backend: export
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from graphc.backends import BackendName
from graphc.buckets.planner import BucketPlan, plan_buckets, read_workload
from graphc.buckets.selection import Bucket, all_buckets, max_prefill_chunk
from graphc.errors import ConfigError, GraphcError
from graphc.models.family import Family
from graphc.models.moe_forms import MoeFormChoice, MoeLoweringChoice
from graphc.models.registry import FAMILIES, family_of, load_model_args
from graphc.models.step_model import ModelArgs
from graphc.sampling import SAMPLING_RULES, Sampling, sampling_error
from graphc.step import blocks_per_row
from graphc.topology import Topology
from graphc.typed import build


@dataclass(frozen=True)
class SpeculativeSection:
    """Speculative decoding: each decoding row carries drafted tokens that its next step verifies
    (`graphc.models.speculation`), lossless: the tokens are those of decoding without drafts
    (greedy) or distributed as them (sampling)."""

    method: str
    """Who drafts: the checkpoint family's drafter, by name (`Family.drafter`): 'mtp', the
    checkpoint's own multi-token-prediction layer, a token at a time (DeepSeek-V3 / V3.2 / V4);
    'dspark', DeepSeek-V4.1's DSpark stages (its `mtp.` modules), a block of tokens at a time."""
    tokens: int
    """k, tokens drafted per decoding row and step: decode buckets become [B, 1 + k] verify
    graphs (and prompt-as-decode ones at least that wide)."""


@dataclass(frozen=True)
class ModelSection:
    checkpoint: Path
    """Directory of an HF-layout checkpoint (config.json + safetensors); relative to the YAML file."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and activation dtype; the router always runs in float32."""
    weights: Literal["as-stored", "dequantized"] = "as-stored"
    """How FP8 block-quantised checkpoint weights (DeepSeek's release format) reach the artifacts:
    'as-stored' keeps them FP8 with their fp32 block scales, dequantised in each graph next to the
    op that reads them (a rank stores and reads one byte per weight); 'dequantized' converts them
    to `dtype` at compile time, as graphc did before. The same logits either way. Weights stored
    in another dtype are converted to `dtype` in both. On the CPU backends converting FP8 in the
    step costs more time than its bytes save (docs/benchmarks.md, FP8 on CPUs): 'dequantized' is
    the faster choice there, 'as-stored' the one that fits a device."""
    sparse_probabilities: Literal["bf16", "fp32"] | None = None
    """DeepSeek-V3.2 sparse attention only: the precision of the softmax probabilities P in the
    P @ V product. 'bf16' rounds P as FlashMLA's sparse kernel does (its denominator still sums the
    fp32 values); 'fp32' keeps P in fp32, as the public reference implementations do. Default:
    'bf16' for a bfloat16 model, 'fp32' for a float32 one."""
    moe_form: MoeFormChoice = "auto"
    """The routed experts' formulation in every compiled graph: 'gather' (each routed token reads
    its experts' weights by id; for decode-sized steps), 'grouped' (routes sorted by expert, one
    GEMM per expert; for prefill-sized steps), 'dense' (every expert on every token: the
    reference), or 'auto', which picks gather or grouped per bucket by expert weight reads
    (`graphc.models.moe_forms.moe_form_for`). All are exact; `graphc plan` shows the choice."""
    moe_lowering: MoeLoweringChoice = "auto"
    """Where tokens are not replicated over their EP group (data-parallel attention): how they
    reach their experts' ranks. 'ag_rs' (all-gather, reduce-scatter), 'a2a_even' (even
    all-to-all of fixed-position blocks), 'a2a_v' (variable all-to-all over an all-gathered split
    matrix), or 'auto': a2a_v for EP groups of 4 and 8 ranks, else a2a_even. All give the same
    tokens; `graphc compile --moe-lowering` overrides it."""
    speculative: SpeculativeSection | None = None
    """Speculative decoding (off when absent), e.g. `{method: mtp, tokens: 2}`."""


@dataclass(frozen=True)
class AutoBucketsSection:
    """Plan the buckets from traffic (`graphc.buckets.planner.plan_buckets`) instead of listing them."""

    workload: Path
    """Prompt lengths to plan for: a text file, one length per line (or `length count`)."""
    graphs: int
    """Graph budget per rank: prefill, decode and prompt-as-decode graphs together."""
    max_decode_batch: int
    """The most sequences decoded together (the largest decode bucket)."""


@dataclass(frozen=True)
class BucketsSection:
    context_limit: int
    """Longest sequence (prompt + generated tokens) served; <= the model's max positions."""
    prefill: list[int] | None = None
    """Prefill chunk sizes in tokens: one graph each. Sorted on load; each <= `context_limit`."""
    decode: list[int] | None = None
    """Decode batch sizes (sequences per step): one graph each."""
    prompt_as_decode: int | None = None
    """Prompts (or chunk tails) of at most this many tokens run through [B, P] decode-shaped
    graphs with the running decodes; 0 (the default) disables it."""
    auto: AutoBucketsSection | None = None
    """Instead of `prefill`, `decode` and `prompt_as_decode`: plan them from a workload."""


@dataclass(frozen=True)
class KVCacheSection:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 256
    """Blocks in the pool (overridable at run time by GRAPHC_NUM_KV_BLOCKS); must hold at least
    one sequence of `buckets.context_limit` tokens."""


@dataclass(frozen=True)
class RuntimeSection:
    max_num_prefilling_tokens: int = 512
    """Prompt tokens prefilled per step across requests (not divided by cp: chunks run
    replicated on every CP rank)."""
    max_new_tokens: int = 32
    """Default cap on generated tokens per request; `run` and `serve` clip it to what context_limit
    leaves after the prompt (`graphc.request.default_max_new_tokens`)."""
    sampling: Sampling = field(default_factory=Sampling)
    """Default sampling parameters of a request."""
    prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before (`graphc.runtime.prefix_cache`: exact for
    every family); GRAPHC_PREFIX_CACHING=0 turns it off at run time without recompiling."""
    prompt_logprobs: bool = False
    """Compile a score program beside each prefill bucket's, returning every prompt position's
    log-probabilities, so requests can ask for their prompt's (`echo` with `logprobs`: what
    lm-evaluation-harness's loglikelihood tasks send). Costs a compile of each prefill bucket
    again, and, in a scored step only, the vocabulary head at every position."""


@dataclass(frozen=True)
class GraphcConfig:
    """A whole `model.yaml`."""

    model: ModelSection
    """What to serve."""
    buckets: BucketsSection
    """The static shapes to compile."""
    topology: Topology = field(default_factory=Topology)
    """How ranks split the work."""
    kv_cache: KVCacheSection = field(default_factory=KVCacheSection)
    """The paged KV pool."""
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    """Scheduler and sampling defaults."""
    backend: BackendName = "export"
    """How graphs are compiled: torch.export .pt2, AOTInductor packages, or Neuron NEFFs."""
    source: Path | None = field(default=None, metadata={"from_data": False})
    """The YAML file this was loaded from (set by the loader, not a key)."""
    model_args: ModelArgs | None = field(default=None, metadata={"from_data": False}, compare=False)
    """The checkpoint's config.json as its family's args, read once by the loader (not a key)."""

    @property
    def family(self) -> Family:
        """The model family of the checkpoint (`models/registry.py`)."""
        return family_of(self.model_args)

    @property
    def draft_tokens(self) -> int:
        """Speculative decoding's k: tokens drafted per decoding row (0: off)."""
        return self.model.speculative.tokens if self.model.speculative else 0

    @property
    def compiled_buckets(self) -> list[Bucket]:
        """Every bucket compiled, one program a rank each (`graphc.buckets.selection.all_buckets`)."""
        b = self.buckets
        return all_buckets(b.prefill, b.decode, b.prompt_as_decode, self.draft_tokens, self.runtime.prompt_logprobs)


def load_config(path: str | Path) -> GraphcConfig:
    """Read, type-check and validate a `model.yaml` (including against the checkpoint's config.json)."""
    path = Path(path)
    if not path.is_file():
        raise GraphcError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    config = parse_config(data, base_dir=path.parent)
    return dataclasses.replace(config, source=path)


def parse_config(data: Any, base_dir: Path) -> GraphcConfig:
    """The config with its buckets resolved: lists sorted, or planned when `buckets.auto` is set."""
    config = build(GraphcConfig, data, ConfigError, base_dir)
    b = config.buckets
    if b.auto is not None:
        given = [name for name in ("prefill", "decode", "prompt_as_decode") if getattr(b, name) is not None]
        if given:
            raise ConfigError(f"buckets.{given[0]}: give either buckets.auto or the bucket lists, not both")
        _positive("buckets.context_limit", b.context_limit)
        _positive("runtime.max_num_prefilling_tokens", config.runtime.max_num_prefilling_tokens)
        plan = plan_for(b, config.runtime)
        b = dataclasses.replace(b, prefill=plan.prefill, decode=plan.decode, prompt_as_decode=plan.prompt_as_decode)
    for name in ("prefill", "decode"):
        if getattr(b, name) is None:
            raise ConfigError(f"buckets.{name}: required key is missing (a list of sizes, or plan them with buckets.auto)")
    config = dataclasses.replace(config, buckets=b)
    args = validate(config)
    buckets = dataclasses.replace(b, prefill=sorted(b.prefill), decode=sorted(b.decode),
                                  prompt_as_decode=b.prompt_as_decode or 0)
    return dataclasses.replace(config, buckets=buckets, model_args=args)


def plan_for(buckets: BucketsSection, runtime: RuntimeSection) -> BucketPlan:
    """The planner's answer for `buckets.auto` (errors name the key)."""
    auto = buckets.auto
    _positive("buckets.auto.graphs", auto.graphs)
    _positive("buckets.auto.max_decode_batch", auto.max_decode_batch)
    try:
        lengths = read_workload(auto.workload)
    except OSError as e:
        raise ConfigError(f"buckets.auto.workload: cannot read {str(auto.workload)!r}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"buckets.auto.workload: {e}") from None
    try:
        return plan_buckets(lengths, auto.graphs, buckets.context_limit, runtime.max_num_prefilling_tokens,
                            auto.max_decode_batch)
    except ValueError as e:
        raise ConfigError(f"buckets.auto: {e}") from None


def validate(config: GraphcConfig) -> ModelArgs:
    """Cross-field checks, and checks against the checkpoint's config.json; returns its args."""
    b, kv, rt, topology = config.buckets, config.kv_cache, config.runtime, config.topology
    _positive("buckets.context_limit", b.context_limit)
    for section, sizes in (("buckets.prefill", b.prefill), ("buckets.decode", b.decode)):
        if not sizes:
            raise ConfigError(f"{section}: must list at least one size")
        for i, size in enumerate(sizes):
            _positive(f"{section}[{i}]", size)
        duplicates = sorted({s for s in sizes if sizes.count(s) > 1})
        if duplicates:
            raise ConfigError(f"{section}: size {duplicates[0]} is listed twice; sizes must be unique")
    for i, size in enumerate(b.prefill):
        if size > b.context_limit:
            raise ConfigError(
                f"buckets.prefill[{i}]: {size} is larger than buckets.context_limit ({b.context_limit}); "
                "each prefill chunk must be <= context_limit"
            )
    if b.prompt_as_decode is not None and not 0 <= b.prompt_as_decode <= b.context_limit:
        raise ConfigError(
            f"buckets.prompt_as_decode: {b.prompt_as_decode} must be in 0..context_limit ({b.context_limit})"
        )
    _positive("kv_cache.block_size", kv.block_size)
    _positive("kv_cache.num_blocks", kv.num_blocks)
    if kv.num_blocks * kv.block_size < b.context_limit:
        raise ConfigError(
            f"kv_cache.num_blocks: {kv.num_blocks} blocks * block_size {kv.block_size} = "
            f"{kv.num_blocks * kv.block_size} tokens cannot hold one sequence of context_limit "
            f"{b.context_limit}; need at least {blocks_per_row(b.context_limit, kv.block_size)} blocks"
        )
    _positive("runtime.max_num_prefilling_tokens", rt.max_num_prefilling_tokens)
    _positive("runtime.max_new_tokens", rt.max_new_tokens)
    for name in SAMPLING_RULES:
        problem = sampling_error(name, getattr(rt.sampling, name))
        if problem:
            raise ConfigError(f"runtime.sampling.{name}: {problem}")
    try:
        args = load_model_args(config.model.checkpoint)
    except GraphcError as e:
        raise ConfigError(f"model.checkpoint: {e}") from None
    try:
        topology.experts(0, args.n_routed_experts)
        family_of(args).check_tensor_parallel(args, topology.tp)
    except GraphcError as e:
        raise ConfigError(str(e)) from None
    if b.context_limit > args.max_position_embeddings:
        raise ConfigError(
            f"buckets.context_limit: {b.context_limit} exceeds the checkpoint's max_position_embeddings "
            f"({args.max_position_embeddings})"
        )
    if config.model.speculative is not None:
        if rt.prompt_logprobs:
            raise ConfigError("runtime.prompt_logprobs: prompt scores are not compiled with model.speculative yet; "
                              "drop one of them")
        args = _speculative_args(config, args)
    return args


def _speculative_args(config: GraphcConfig, args: ModelArgs) -> ModelArgs:
    """The args serving the checkpoint's draft layers, or the refusal naming the field."""
    speculative, b = config.model.speculative, config.buckets
    drafter = family_of(args).drafter
    if drafter is None:
        drafting = ", ".join(f"{f.name} with '{f.drafter.method}'" for f in FAMILIES if f.drafter is not None)
        raise ConfigError(f"model.speculative: {args.architecture} has no drafting in graphc yet; families that "
                          f"draft: {drafting}")
    if speculative.method != drafter.method:
        raise ConfigError(f"model.speculative.method: {args.architecture} drafts with '{drafter.method}', not "
                          f"'{speculative.method}'")
    if args.num_nextn_predict_layers < 1:
        raise ConfigError(f"model.speculative: method '{speculative.method}' needs the checkpoint's draft layers "
                          f"(multi-token prediction), and {config.model.checkpoint} has none (config.json "
                          f"num_nextn_predict_layers is {args.num_nextn_predict_layers})")
    try:
        drafter.check(args, speculative.tokens, config.topology)
    except GraphcError as e:
        raise ConfigError(str(e)) from None
    if not 1 <= speculative.tokens < b.context_limit - 1:
        raise ConfigError(f"model.speculative.tokens: {speculative.tokens} must be in 1..{b.context_limit - 2} "
                          f"(a verify row of 1 + tokens must fit under buckets.context_limit {b.context_limit})")
    if max_prefill_chunk(sorted(b.prefill), config.runtime.max_num_prefilling_tokens) < 2:
        raise ConfigError("buckets.prefill: speculative decoding runs each prompt chunk's last token again with the "
                          "next chunk, so chunks need at least 2 tokens; add a prefill bucket of 2 or more")
    return dataclasses.replace(args, draft_layers=drafter.served_layers(args))


def _positive(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: {value} must be a positive integer")
