"""Train the tiny DeepSeek-V3 checkpoint that `graphc checkpoint make-tiny --preset trained` ships.

A small V3 (MLA with q LoRA, grouped top-2 routing over 8 experts, one dense layer) and its
multi-token-prediction (MTP) layer, trained jointly as the DeepSeek-V3 report trains them (section
2.2): the main model's next-token loss plus `MTP_WEIGHT` times the MTP layer's loss on the token
after next. The MTP layer at position i takes the main model's final (normed) hidden state h_i and
the embedding of token i + 1, each RMS-normed (`hnorm`, `enorm`), concatenated and projected back
to the hidden size (`eh_proj`), runs one decoder layer at position i, and predicts token i + 2
through its own final norm (`shared_head.norm`) and the shared output head. The checkpoint stores
the embedding and head again under the MTP layer, as DeepSeek's releases do.

Text: the Python standard library's own source (what every machine with Python has), bytes as
tokens (the byte-level tokenizer of the tiny presets); the last files in sorted order are held out.
Deterministic from `--seed` on one machine (fixed thread count, sorted files); the held-out losses
are printed and written to `training.json` beside the weights.

Needs transformers (the test extra): `pip install -e '.[test]'`, then
    .venv/bin/python scripts/train_tiny.py --out src/graphc/weights/trained
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from graphc.models.deepseek_v3.presets import BASE_CONFIG
from graphc.weights.tiny import TINY_TOKENIZER_CONFIG, byte_level_tokenizer

CONFIG = {**BASE_CONFIG, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
          "num_hidden_layers": 4, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32,
          "qk_rope_head_dim": 16, "v_head_dim": 32, "max_position_embeddings": 1024, "eos_token_id": 0,
          "bos_token_id": 0}
"""The trained model: the `lora-groups` preset's architecture, twice as wide and a layer deeper
(1.4 M parameters with its MTP layer). EOS is byte 0, which source text never holds."""
MTP_WEIGHT = 0.3
"""The MTP loss's weight (the report's lambda for the first 10 T tokens)."""
SEQUENCE = 256
BATCH = 16
HELD_OUT_FILES = 40


def corpus() -> tuple[bytes, bytes]:
    """The standard library's top-level modules, sorted by name: training text, held-out text."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_bytes().replace(b"\0", b"") for f in files]
    return b"\n".join(texts[:-HELD_OUT_FILES]), b"\n".join(texts[-HELD_OUT_FILES:])


class MultiTokenPrediction(nn.Module):
    """One MTP depth over the main model's hidden states (names as the released layout stores them)."""

    def __init__(self, model, layer: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        config, d = model.config, model.config.hidden_size
        self.enorm = DeepseekV3RMSNorm(d, config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer)
        self.head_norm = DeepseekV3RMSNorm(d, config.rms_norm_eps)

    def forward(self, model, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] (the main model's final states), next_ids [B, T] (token i + 1 at i) ->
        logits [B, T, V] for token i + 2."""
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None]
        x = self.block(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=None,
                       position_ids=positions)
        return model.lm_head(self.head_norm(x[0] if isinstance(x, tuple) else x))


def losses(model, mtp: MultiTokenPrediction, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token and token-after-next cross-entropies (nats per byte) of [B, T] bytes."""
    hidden = model.model(input_ids=batch[:, :-1]).last_hidden_state  # [B, T-1, D], after the final norm
    main = nn.functional.cross_entropy(model.lm_head(hidden).flatten(0, 1), batch[:, 1:].flatten())
    draft = mtp(model, hidden[:, :-1], batch[:, 1:-1])
    return main, nn.functional.cross_entropy(draft.flatten(0, 1), batch[:, 2:].flatten())


def batches(text: torch.Tensor, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(text) - SEQUENCE - 1, (BATCH,), generator=generator)
        yield torch.stack([text[s: s + SEQUENCE + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, mtp, text: torch.Tensor) -> tuple[float, float]:
    windows = text[: (len(text) - 1) // SEQUENCE * SEQUENCE + 1]
    chunks = torch.stack([windows[i: i + SEQUENCE + 1] for i in range(0, len(windows) - SEQUENCE, SEQUENCE)][:64])
    main, draft = losses(model, mtp, chunks)
    return main.item(), draft.item()


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers decoder layer's tensors with its fused routed experts (`gate_up_proj` [E, 2I, D],
    gate rows first; `down_proj` [E, D, I]) split into the released layout's per-expert tensors
    (what `save_pretrained` writes for the main layers)."""
    out = {name: t for name, t in state.items() if not name.startswith("mlp.experts.")}
    for e, (gate_up, down) in enumerate(zip(state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"])):
        gate, up = gate_up.chunk(2)
        out.update({f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up,
                    f"mlp.experts.{e}.down_proj.weight": down})
    return out


def released_tensors(model, mtp: MultiTokenPrediction) -> dict[str, torch.Tensor]:
    """The main model in its released layout (per-expert tensors, as transformers saves them) and
    the MTP layer as layer `num_hidden_layers`."""
    from safetensors.torch import load_file

    scratch = Path(f"/tmp/graphc-train-{time.time_ns()}")
    model.save_pretrained(scratch)
    tensors = load_file(scratch / "model.safetensors")
    layer = f"model.layers.{model.config.num_hidden_layers}."
    tensors.update({layer + name: tensor for name, tensor in per_expert(mtp.block.state_dict()).items()})
    tensors.update({layer + "enorm.weight": mtp.enorm.weight, layer + "hnorm.weight": mtp.hnorm.weight,
                    layer + "eh_proj.weight": mtp.eh_proj.weight, layer + "shared_head.norm.weight": mtp.head_norm.weight,
                    layer + "embed_tokens.weight": model.model.embed_tokens.weight,
                    layer + "shared_head.head.weight": model.lm_head.weight})
    return {name: t.detach().contiguous().clone() for name, t in sorted(tensors.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(options.seed)
    torch.set_num_threads(2)
    model = DeepseekV3ForCausalLM._from_config(DeepseekV3ForCausalLM.config_class(**CONFIG),
                                               attn_implementation="sdpa").float()
    mtp = MultiTokenPrediction(model, CONFIG["num_hidden_layers"])
    parameters = [*model.parameters(), *mtp.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / options.steps)))
    train_text, held_text = (torch.frombuffer(bytearray(t), dtype=torch.uint8).long() for t in corpus())
    stream = batches(train_text, torch.Generator().manual_seed(options.seed))
    started = time.monotonic()
    for step in range(options.steps):
        main_loss, draft_loss = losses(model, mtp, next(stream))
        optimizer.zero_grad()
        (main_loss + MTP_WEIGHT * draft_loss).backward()
        nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == options.steps - 1:
            print(f"step {step}: train loss {main_loss.item():.3f} (MTP {draft_loss.item():.3f}), "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    model.eval(), mtp.eval()
    main_held, draft_held = held_out_loss(model, mtp, held_text)
    report = {"held_out_loss_nats_per_byte": round(main_held, 4), "held_out_mtp_loss_nats_per_byte": round(draft_held, 4),
              "steps": options.steps, "batch": BATCH, "sequence": SEQUENCE, "seed": options.seed,
              "training_bytes": len(train_text), "held_out_bytes": len(held_text),
              "seconds": round(time.monotonic() - started)}
    print(json.dumps(report))
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(released_tensors(model, mtp), options.out / "model.safetensors", metadata={"format": "pt"})
    byte_level_tokenizer().save(str(options.out / "tokenizer.json"))
    (options.out / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=2) + "\n")
    (options.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
