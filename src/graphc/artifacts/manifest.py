"""The manifest: the typed contract between the compiler, which writes it, and the runtime, which
reads it (`graphc.artifacts.directory.read_manifest`, checked by `graphc.artifacts.schema`).
Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import yaml

from graphc.backends import BackendName
from graphc.buckets.selection import Bucket
from graphc.errors import GraphcError
from graphc.sampling import Sampling
from graphc.topology import Topology

FORMAT_VERSION = 7
MANIFEST = "manifest.yaml"


class ArtifactError(GraphcError):
    """Artifacts that cannot be served: missing, tampered with, or from another version."""



@dataclass(frozen=True)
class TensorSpec:
    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class GraphEntry:
    """One bucket's compiled graph on one rank."""

    kind: str
    """"prefill", "score" (a prefill that also returns every position's log-probabilities) or "decode"."""
    size: int
    """The bucket size (prefill tokens or decode rows)."""
    tokens_per_row: int
    """Decode: new tokens per row (1, or the prompt-as-decode size); prefill: 1."""
    file: str
    """Path relative to the artifacts directory."""
    sha256: str
    inputs: dict[str, TensorSpec]
    """Step inputs (not weights) by name, with the shape the graph was compiled for; a dim of -1
    is the pool's block count, which is sized at run time."""
    moe_form: str
    """The routed experts' formulation the graph computes (`graphc.models.moe_forms.MOE_FORMS`)."""
    moe_exchange: str
    """How the graph's tokens reach their experts' ranks (`graphc.models.moe_forms.MOE_EXCHANGES`):
    the same on every rank of a bucket."""

    @property
    def bucket(self) -> Bucket:
        return Bucket(self.kind, self.size, self.tokens_per_row)


@dataclass(frozen=True)
class RankEntry:
    rank: int
    weights: str
    """Safetensors file of this rank's weights, in the order the graphs take them."""
    weights_sha256: str
    weight_names: list[str]
    graphs: list[GraphEntry]
    samples: bool
    """Whether this rank samples its replica's tokens (the first rank of each attention replica)."""
    coordinates: list[int]
    """This rank's `coordinates` step input (`graphc.step.COORDINATES`: cp rank, ep rank, whether
    it samples): what lets ranks share graph files."""


@dataclass(frozen=True)
class ChatTemplate:
    """The checkpoint's chat template (transformers' Jinja format, from tokenizer_config.json) and
    the special tokens templates refer to."""

    template: str
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs of the model: its architecture, vocabulary and EOS ids, the KV
    pool's layer count, width and dtype (written at compile time from the checkpoint's config)."""

    architecture: str
    """The checkpoint's config.json `architectures` name (`DeepseekV3ForCausalLM`, ...: its family's)."""
    vocab_size: int
    eos_token_id: list[int]
    cache_layers: int
    """The pool's layers (the model's `cache_layers`): one per decoder layer for DeepSeek-V3, two
    for DeepSeek-V4 (tokens, compressed entries), and V4.1's one more for Engram's token ids."""
    kv_cache_dim: int
    dtype: Literal["float32", "bfloat16"]
    sparse_probabilities: Literal["bf16", "fp32"] | None = None
    chat_template: ChatTemplate | None = None
    """None: the checkpoint has none, and `graphc serve` refuses chat completions."""


@dataclass(frozen=True)
class BucketTable:
    """model.yaml's resolved buckets: every rank has one graph per bucket of this table."""

    prefill: list[int]
    decode: list[int]
    prompt_as_decode: int
    context_limit: int
    draft_tokens: int = 0
    """Speculative decoding's k (model.yaml's `model.speculative.tokens`; 0: off): tokens the
    model's MTP layer drafts per decoding row, verified by the next step in [B, 1 + k] graphs."""
    prompt_logprobs: bool = False
    """model.yaml's `runtime.prompt_logprobs`: each prefill bucket has a score twin
    (`graphc.buckets.selection`), so requests may ask for their prompt's log-probabilities."""

    @property
    def returned_width(self) -> int:
        """int64 words a step returns per row: its sampled token, or with drafts its verdict
        (`graphc.models.speculation`: the accepted count, 1 + k tokens, k drafts)."""
        return 2 + 2 * self.draft_tokens if self.draft_tokens else 1

    @property
    def widest(self) -> int:
        """The most tokens a step row holds."""
        return max(*self.prefill, self.prompt_as_decode, 1 + self.draft_tokens)


@dataclass(frozen=True)
class KVCacheInfo:
    """The paged pool: tokens per block, blocks (overridable at run time), blocks per row."""

    block_size: int
    num_blocks: int
    blocks_per_row: int


@dataclass(frozen=True)
class RuntimeInfo:
    """Scheduler and sampling defaults from model.yaml's runtime section."""

    max_num_prefilling_tokens: int
    max_new_tokens: int
    sampling: Sampling
    prefix_caching: bool = True


@dataclass(frozen=True)
class Manifest:
    graphc_version: str
    torch_version: str
    backend: BackendName
    model_fingerprint: str
    model: ModelInfo
    topology: Topology
    buckets: BucketTable
    kv_cache: KVCacheInfo
    runtime: RuntimeInfo
    ranks: list[RankEntry]
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """Compile-time facts kept for `graphc inspect` (op counts per graph, pass log)."""
    shapes_only: bool = False
    """Compiled from config.json alone: every program, no weights (each rank's weights entry names
    a file of their names, shapes and dtypes); `graphc run` and `serve` refuse it."""

    def to_yaml(self) -> str:
        # Absent optional model fields (a V3 model's sparse_probabilities) stay absent.
        data = asdict(self)
        data["model"] = {k: v for k, v in data["model"].items() if v is not None}
        return yaml.safe_dump(data, sort_keys=False)


@dataclass(frozen=True)
class GraphContext:
    """One graph file as the verified manifest describes it: what a loader checks a file that
    declares its own signature (a neuron archive) against, before running any of it."""

    manifest: Manifest
    rank: RankEntry
    """A rank that runs the file."""
    graph: GraphEntry
    """That rank's entry naming the file."""
    weights: list | None = None
    """The rank's weight tensors the graph is called with; None where nothing runs (the lint,
    neuron-finish)."""
