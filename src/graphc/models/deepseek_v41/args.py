"""`V41Args`: the DeepSeek-V4.1 (text) hyper-parameters graphc needs, read from the released
`config.json` (the text model's fields nested under `text_config`, beside a `vision_config`).

What V4.1 changes from V4 in its configuration: `compress_ratios` per layer in {0, 1, 2, ...}
(0: sliding window only; r > 0: the layer attends to entries of r tokens each), but only the
`kv_source_layer_ids` own a compressor and the other compressed layers read the entries of the
latest source of their ratio; only the `index_source_layer_ids` run an indexer (a source of both
computes the index keys, later index layers of its ratio reuse them), and every other compressed
layer attends to the selection the latest index layer published; the `candidate_source_layer_id`
also picks `candidate_topk_blocks` blocks of `candidate_block_size` entries, and later index
layers choose only among those (two-level top-k); no hash-routed layers; Engram tables at
`engram_layer_ids`; `gate_temp` divides the router logits (1 when absent, as in the release).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphc.errors import CheckpointError
from graphc.weights.hf_config import check_field_types, check_id_lists, eos_token_ids, names_architecture
from graphc.models.deepseek_v41.engram import EngramArgs
from graphc.models.deepseek_v4.args import V4FamilyArgs, shared_fields

V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
V41_MODEL_TYPE = "deepseek_v41"

REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "q_lora_rank", "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok", "o_groups",
            "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "compress_ratios", "kv_source_layer_ids",
            "index_source_layer_ids")
TOKEN_ID_DIGITS = 3
"""A token id is cached as 3 base-256 digits (exact in bf16, ids below 2^24) for Engram's hash."""
ID_LISTS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
            "engram_num_embeddings", "dspark_target_layer_ids")
"""text_config fields that are lists of integers >= 0."""
ENGRAM_FIELDS = ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size")
DSPARK_FIELDS = ("dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
                 "dspark_num_experts_per_tok")


@dataclass(frozen=True)
class DSparkArgs:
    """V4.1's DSpark drafter (`dspark_*` config fields; its stages are the checkpoint's
    `num_nextn_predict_layers` MTP modules, `deepseek_v41/dspark.py`)."""

    block_size: int
    """Tokens one pass drafts: the block [anchor, noise x (block_size - 1)]."""
    noise_token_id: int
    """The id the block's positions after the anchor are embedded as."""
    target_layer_ids: tuple[int, ...]
    """The main layers whose entering residual streams (their mean) the drafter reads."""
    markov_rank: int
    """Width of the Markov head's low-rank bias from the previous token to the next's logits."""
    n_routed_experts: int
    num_experts_per_tok: int
    stages: int


@dataclass(frozen=True, kw_only=True)
class V41Args(V4FamilyArgs):
    """DeepSeek-V4.1 text-model hyper-parameters (names follow `text_config`)."""

    compress_ratios: tuple[int, ...]
    """Tokens per compressed entry a layer attends to (0: sliding window only)."""
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    """The index layer that also picks candidate blocks for later index layers (-1: none)."""
    candidate_topk_blocks: int
    candidate_block_size: int
    gate_temp: float
    engram: EngramArgs | None
    dspark: DSparkArgs | None = None
    """The DSpark drafter, where config.json has one (`dspark_block_size`)."""
    draft_layers: int = 0
    """The DSpark stages the model serves as speculative decoding's draft (model.yaml's
    `model.speculative`, not config.json): 0, or all of them. Loaders skip them otherwise."""

    n_shared_experts = 1
    first_k_dense_replace = 0
    sparse_attention = False

    def __post_init__(self) -> None:
        layers, ratios = self.num_hidden_layers, self.compress_ratios
        if len(ratios) != layers:  # before any layer's ratio is read
            raise CheckpointError(f"config.json: compress_ratios has {len(ratios)} entries for {layers} layers")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            stray = [i for i in getattr(self, name) if not 0 <= i < layers or not ratios[i]]
            if stray:
                raise CheckpointError(f"config.json: {name} {list(stray)} are not compressed layers of 0..{layers - 1}")
        checks = [
            (set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids),
             f"kv_source_layer_ids {list(self.kv_source_layer_ids)} must all be index sources "
             f"({list(self.index_source_layer_ids)})"),
            (self.candidate_source_layer_id in (-1, *self.kv_source_layer_ids),
             f"candidate_source_layer_id {self.candidate_source_layer_id} must be -1 or a KV source layer"),
            (self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts ({self.n_routed_experts})"),
            (self.rope_head_dim % 2 == 0 and 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim),
             f"qk_rope_head_dim ({self.rope_head_dim}) must be even and fit head_dim and index_head_dim"),
            ((self.num_attention_heads * self.head_dim) % self.o_groups == 0,
             f"o_groups ({self.o_groups}) must divide num_attention_heads * head_dim"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"config.json: {message}")
        for layer in range(layers):
            if ratios[layer]:
                self.kv_source(layer), self.index_source(layer)  # raise where a layer has none
        if self.tie_word_embeddings:
            raise CheckpointError("config.json: tie_word_embeddings is true; DeepSeek-V4.1 has a separate head")
        if self.engram is not None and not set(self.engram.layer_ids) <= set(range(layers)):
            raise CheckpointError(f"config.json: engram_layer_ids {list(self.engram.layer_ids)} are not all layers "
                                  f"of 0..{layers - 1}")
        if self.dspark is not None:
            self._check_dspark(self.dspark)
        if self.draft_layers not in (0, self.dspark.stages if self.dspark else 0):
            raise CheckpointError(f"model.speculative serves {self.draft_layers} draft layer(s); DeepSeek-V4.1 drafts "
                                  "with all of its DSpark stages or none")

    def _check_dspark(self, dspark: DSparkArgs) -> None:
        layers = self.num_hidden_layers
        checks = [
            (dspark.stages >= 1, "dspark_block_size is set but num_nextn_predict_layers (the DSpark stages) is 0"),
            (set(dspark.target_layer_ids) <= set(range(layers)) and dspark.target_layer_ids,
             f"dspark_target_layer_ids {list(dspark.target_layer_ids)} must be layers of 0..{layers - 1}"),
            (dspark.noise_token_id < self.vocab_size,
             f"dspark_noise_token_id {dspark.noise_token_id} is not a token id of 0..{self.vocab_size - 1}"),
            (dspark.num_experts_per_tok <= dspark.n_routed_experts,
             f"dspark_num_experts_per_tok ({dspark.num_experts_per_tok}) must be <= dspark_n_routed_experts "
             f"({dspark.n_routed_experts})"),
            (self.n_routed_experts % dspark.n_routed_experts == 0,
             f"dspark_n_routed_experts ({dspark.n_routed_experts}) must divide n_routed_experts "
             f"({self.n_routed_experts}): expert parallelism deals both out over the same ranks"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"config.json: {message}")

    @property
    def architecture(self) -> str:
        return V41_ARCHITECTURE

    def _latest(self, layer: int, sources: tuple[int, ...], what: str) -> int:
        found = [s for s in sources if s <= layer and self.compress_ratios[s] == self.compress_ratios[layer]]
        if not found:
            raise CheckpointError(f"config.json: layer {layer} (compress ratio {self.compress_ratios[layer]}) has no "
                                  f"{what} of its ratio at or before it")
        return max(found)

    def kv_source(self, layer: int) -> int:
        """The layer whose compressor makes the entries compressed layer `layer` attends to."""
        return self._latest(layer, self.kv_source_layer_ids, "kv_source_layer_ids entry")

    def index_source(self, layer: int) -> int:
        """The index layer whose selection compressed layer `layer` attends to (itself if it is one)."""
        latest = max(s for s in (*self.index_source_layer_ids, -1) if s <= layer)
        if latest < 0 or self.compress_ratios[latest] != self.compress_ratios[layer]:
            raise CheckpointError(f"config.json: layer {layer} (compress ratio {self.compress_ratios[layer]}) would "
                                  f"reuse the selection of layer {latest}, which is not an index layer of its ratio")
        return latest

    def token_state_dim(self, layer: int) -> int:
        """Width of what one token leaves in its layer's token cache (see `deepseek_v41`): its
        K = V; a pooling KV source's raw kv and gate projections."""
        pools = layer in self.kv_source_layer_ids and self.compress_ratios[layer] > 1
        return self.head_dim * (3 if pools else 1)

    def entry_dim(self, layer: int) -> int:
        """Width of a KV source's entry (then its index key) in its entry cache; 0 elsewhere."""
        return self.head_dim + self.index_head_dim if layer in self.kv_source_layer_ids else 0

    @property
    def kv_cache_dim(self) -> int:
        """C: the cached width, the widest of any layer's token or entry state."""
        return max(max(self.token_state_dim(i), self.entry_dim(i)) for i in range(self.num_hidden_layers))

    @property
    def cache_layers(self) -> int:
        """Pool layers: each model layer's token cache (2i) and entry cache (2i + 1), then with
        Engram the token ids (2L), then the served DSpark stages' context keys (`draft_cache_layer`)."""
        return 2 * self.num_hidden_layers + (self.engram is not None) + self.draft_layers

    def draft_cache_layer(self, stage: int) -> int:
        """The pool layer of DSpark stage `stage`'s context keys (one [head_dim] vector a position)."""
        return 2 * self.num_hidden_layers + (self.engram is not None) + stage

    def uses_candidates(self, layer: int) -> bool:
        """Whether index layer `layer` chooses only among the candidate layer's blocks."""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids


def is_v41_config(config: dict[str, Any]) -> bool:
    return names_architecture(config, V41_ARCHITECTURE, V41_MODEL_TYPE)


def v41_args_from_hf_config(config: dict[str, Any]) -> V41Args:
    """Translate a DeepSeek-V4.1 `config.json` into `V41Args` (the text model's fields)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json: a DeepSeek-V4.1 config nests the text model under 'text_config'; "
                              "it is missing or not an object")
    missing = [k for k in REQUIRED if text.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: text_config lacks required field(s) {', '.join(missing)}")
    check_field_types(text)
    check_id_lists(text, ID_LISTS, "config.json: text_config")
    if isinstance(text.get("candidate_source_layer_id", -1), bool) or \
            not isinstance(text.get("candidate_source_layer_id", -1), int):
        raise CheckpointError(f"config.json: text_config.candidate_source_layer_id is "
                              f"{text['candidate_source_layer_id']!r}; expected a layer id or -1")
    scoring = text.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise CheckpointError(f"config.json: text_config.scoring_func {scoring!r} is not supported; DeepSeek-V4.1 "
                              "uses 'sqrtsoftplus'")
    if text.get("num_key_value_heads", 1) != 1:
        raise CheckpointError(f"config.json: text_config.num_key_value_heads is {text['num_key_value_heads']}; "
                              "DeepSeek-V4.1 attention has one shared K = V head")
    if text.get("n_shared_experts", 1) != 1:
        raise CheckpointError(f"config.json: text_config.n_shared_experts is {text['n_shared_experts']}; "
                              "DeepSeek-V4.1 has 1")
    layers = text["num_hidden_layers"]
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    return V41Args(
        **shared_fields(text),
        num_hidden_layers=layers,
        rope_head_dim=text["qk_rope_head_dim"],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-20)),
        compress_ratios=tuple(text["compress_ratios"][:layers]),  # the release lists its draft layers' too
        kv_source_layer_ids=tuple(text["kv_source_layer_ids"]),
        index_source_layer_ids=tuple(text["index_source_layer_ids"]),
        candidate_source_layer_id=text.get("candidate_source_layer_id", -1),
        candidate_topk_blocks=text.get("candidate_topk_blocks", 2048),
        candidate_block_size=text.get("candidate_block_size", 8),
        gate_temp=float(text.get("gate_temp", 1.0)),
        engram=_engram_args(text),
        dspark=_dspark_args(text),
        num_nextn_predict_layers=text.get("num_nextn_predict_layers") or 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        eos_token_id=eos_token_ids(eos),
    )


def check_loadable(args: V41Args) -> None:
    """Engram hashes token ids folded into the compressed vocabulary (`engram.py`), a map the
    release builds from its tokenizer's normalised token texts, which graphc does not build yet:
    its hash takes the ids as they are, the fold of a compressed vocabulary the size of the
    vocabulary (graphc's tiny models). A released config is planned and compiled shapes-only (the
    programs' shapes do not depend on the map); its weights are not loaded."""
    if args.engram is not None and args.engram.compressed_vocab != args.vocab_size:
        raise CheckpointError(f"config.json: engram_compressed_vocab_size {args.engram.compressed_vocab} differs "
                              f"from vocab_size {args.vocab_size}: Engram hashes token ids folded by the tokenizer's "
                              "normalised texts, which graphc does not build yet; plan this config or compile it "
                              "shapes-only (graphc loads the identity fold only, equal sizes)")


def _dspark_args(text: dict[str, Any]) -> DSparkArgs | None:
    if text.get("dspark_block_size") is None:
        return None
    missing = [k for k in DSPARK_FIELDS if text.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: dspark_block_size is set but text_config lacks {', '.join(missing)}")
    return DSparkArgs(block_size=text["dspark_block_size"], noise_token_id=text["dspark_noise_token_id"],
                      target_layer_ids=tuple(text["dspark_target_layer_ids"]), markov_rank=text["dspark_markov_rank"],
                      n_routed_experts=text["dspark_n_routed_experts"],
                      num_experts_per_tok=text["dspark_num_experts_per_tok"],
                      stages=text.get("num_nextn_predict_layers") or 0)


def _engram_args(text: dict[str, Any]) -> EngramArgs | None:
    layer_ids = tuple(text.get("engram_layer_ids") or ())
    if not layer_ids:
        return None
    missing = [k for k in ENGRAM_FIELDS if text.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: engram_layer_ids is set but text_config lacks {', '.join(missing)}")
    compressed = text.get("engram_compressed_vocab_size") or text["vocab_size"]
    if not 0 < compressed <= text["vocab_size"]:
        raise CheckpointError(f"config.json: engram_compressed_vocab_size {compressed} is not in 1..vocab_size "
                              f"{text['vocab_size']}")
    if text["engram_max_ngram_size"] < 2:
        raise CheckpointError(f"config.json: engram_max_ngram_size is {text['engram_max_ngram_size']}; Engram hashes "
                              "n-grams of orders 2..N, so N must be at least 2")
    pad = text.get("engram_pad_token_id", 2)
    if not 0 <= pad < compressed:
        raise CheckpointError(f"config.json: engram_pad_token_id {pad} is not a token id of 0..{compressed - 1}")
    args = EngramArgs(layer_ids=layer_ids, max_ngram=text["engram_max_ngram_size"], heads=text["engram_n_heads"],
                      head_dim=text["engram_head_dim"], vocab_base=text["engram_vocab_size"],
                      compressed_vocab=compressed, pad_id=pad)
    stated = text.get("engram_num_embeddings")
    if stated is not None and list(stated) != [args.table_rows()[layer] for layer in layer_ids]:
        raise CheckpointError(f"config.json: engram_num_embeddings {list(stated)} are not the hash tables' sizes "
                              f"{[args.table_rows()[layer] for layer in layer_ids]} (the sums of each layer's primes "
                              f"above engram_vocab_size {args.vocab_base})")
    return args
