"""What the leader's own sampling adds to a decode step (`graphc.runtime.leader_sampling`): the
host time of logprobs (top 20), penalties with logit bias, and a grammar's mask, per row at
DeepSeek-V3's vocabulary (129,280), for a batch of 8 asking rows, beside the step model's decode-8
step of the released V3 layout at tp 16 on trn2 (`graphc plan --device trn2`) and the ratio of the two.

Rows that ask for none of these never reach this path: their cost is unchanged by construction
(one attribute read per row and step). The grammar's mask is llguidance's over the trained tiny
presets' 256-token byte-level tokenizer (no tokenizer of DeepSeek's vocabulary is shipped); its
expansion to a [V] mask and the masked draw are timed at 129,280.

    .venv/bin/python bench/bench_leader_sampling.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from graphc.runtime.constraints import Grammars, json_schema_grammar
from graphc.runtime.leader_sampling import leader_token
from graphc.runtime.logprobs import token_logprobs
from graphc.runtime.penalties import Penalties
from graphc.runtime.scheduler import Request
from graphc.sampling import MAX_TOP_LOGPROBS, Sampling
from graphc.weights.tiny import byte_level_tokenizer
from timing import best_of

VOCAB = 129_280
ROWS = 8
HISTORY = 2_000
ROOT = Path(__file__).resolve().parent.parent


def _decode8_step_ms() -> float:
    plan = subprocess.run([str(Path(sys.executable).parent / "graphc"), "plan", str(ROOT / "examples/released/v3-trn2-tp16.yaml"),
                           "--device", "trn2", "--json"], capture_output=True, text=True, check=True)
    steps = {s["bucket"]: s["step_ms"] for s in json.loads(plan.stdout)["steps"]}
    return steps["decode-8"]


def main() -> None:
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 4
    history = torch.randint(0, VOCAB, (HISTORY,)).tolist()
    penalties = Penalties(presence=0.5, frequency=0.5, repetition=1.2, logit_bias={i: 1.0 for i in range(300)})
    sampled = Sampling(temperature=0.8, top_p=0.95, seed=1)
    plain = Request([1], 1, sampled)
    penalised = Request(history[:100], 1, sampled, penalties=penalties)
    per_row = {
        "logprobs top-20": best_of(20, lambda: token_logprobs(logits, 5, MAX_TOP_LOGPROBS), warmup=2),
        "the draw alone (no adjustment)": best_of(20, lambda: leader_token(logits, plain, history), warmup=2),
        "penalties + 300-token bias + draw": best_of(20, lambda: leader_token(logits, penalised, history), warmup=2),
    }
    grammars = Grammars(byte_level_tokenizer().to_str(), 256, [0])
    grammar = grammars.checked(json_schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}}))
    constraint = grammars.constraint(grammar)
    per_row["grammar mask (llguidance, 256-token vocabulary)"] = best_of(20, constraint.allowed, warmup=2)
    mask = torch.ones(VOCAB, dtype=torch.bool)
    per_row["mask applied at 129,280 + draw"] = best_of(
        20, lambda: leader_token(logits.masked_fill(~mask, float("-inf")), plain, history), warmup=2)
    step_ms = _decode8_step_ms()
    print(f"leader-side sampling at vocabulary {VOCAB:,}, {ROWS} asking rows a step; "
          f"step model: released V3 at tp 16 on trn2, decode-8 step {step_ms:.1f} ms")
    print(f"| what | per row (ms) | {ROWS} rows (ms) | step with it / without |")
    print("|---|---|---|---|")
    for name, seconds in per_row.items():
        added = seconds * 1e3 * ROWS
        print(f"| {name} | {seconds * 1e3:.3f} | {added:.2f} | {(step_ms + added) / step_ms:.3f}x |")


if __name__ == "__main__":
    main()
