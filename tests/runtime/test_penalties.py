"""Penalties and logit bias (`graphc.runtime.penalties`) against a reference of vLLM's semantics
written here: the processing alone on random logits, and greedy tokens of compiled artifacts
against the eager reference model (transformers') processed alike, each field alone and all
together; with MTP drafts on, a row with penalties gives the tokens without drafts."""

from __future__ import annotations

import pytest
import torch

from graphc.runtime import Engine, Request
from graphc.runtime.penalties import Penalties, penalised_logits

VOCAB = 50
PROMPT = [(13 * i) % 200 + 9 for i in range(9)]
NEW_TOKENS = 16  # greedy repeats one token from the 13th on: presence and frequency bite
CASES = {
    "presence": Penalties(presence=1.5),
    "frequency": Penalties(frequency=1.0),
    "repetition": Penalties(repetition=1.8),
    "logit_bias": Penalties(logit_bias={17: 4.0, 101: -100.0}),
    "all": Penalties(presence=0.5, frequency=0.7, repetition=1.3, logit_bias={17: 3.0}),
}


def vllm_processed(logits: torch.Tensor, penalties: Penalties, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's sampler before temperature (vllm/v1/sample: logit bias, then apply_penalties):
    repetition over a prompt-or-output mask, frequency times the output's bin counts, presence
    times the output mask."""
    vocab = logits.shape[-1]
    x = logits.clone()
    for token, bias in penalties.logit_bias.items():
        x[token] += bias
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.tensor(prompt + output, dtype=torch.int64)] = True
    repetition = torch.where(seen, torch.tensor(penalties.repetition), torch.tensor(1.0))
    x = torch.where(x > 0, x / repetition, x * repetition)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).float()
    return x - penalties.frequency * counts - penalties.presence * (counts > 0).float()


@pytest.mark.parametrize("case", CASES)
def test_the_processing_is_vllms(case):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(VOCAB, generator=generator) * 3
    prompt, output = [1, 2, 3, 2], [4, 4, 9, 1, 4]
    penalties = Penalties(**{**CASES[case].__dict__, "logit_bias": {k % VOCAB: v for k, v in CASES[case].logit_bias.items()}})
    torch.testing.assert_close(penalised_logits(logits, penalties, prompt, output),
                               vllm_processed(logits, penalties, prompt, output), rtol=0, atol=1e-6)


def _reference_greedy(checkpoint, penalties: Penalties) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    output: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([PROMPT + output])).logits[0, -1].float()
            output.append(int(vllm_processed(logits, penalties, PROMPT, output).argmax()))
    return output


@pytest.mark.compiles
def test_greedy_tokens_are_the_references_for_each_field_and_all_together(compiled, tiny_checkpoints):
    engine = Engine(compiled("wide-16e", "export", "small"))
    requests = [Request(PROMPT, NEW_TOKENS, stop_at_eos=False, penalties=p) for p in CASES.values()]
    served = [r.output_ids for r in engine.generate([Request(PROMPT, NEW_TOKENS, stop_at_eos=False), *requests])]
    plain, penalised = served[0], served[1:]
    for case, tokens in zip(CASES, penalised):
        assert tokens == _reference_greedy(tiny_checkpoints["wide-16e"], CASES[case]), case
        assert tokens != plain, f"{case} changed nothing: the case would not test it"


@pytest.mark.compiles
def test_with_mtp_drafts_a_penalised_row_gives_the_tokens_without_drafts(compiled):
    penalties = CASES["all"]
    request = Request(PROMPT, NEW_TOKENS, stop_at_eos=False, penalties=penalties)
    [plain] = Engine(compiled("trained", "export", "prompt_as_decode")).generate([request])
    drafting = Engine(compiled("trained", "export", "prompt_as_decode", speculative=2))
    [served] = drafting.generate([request])
    assert served.output_ids == plain.output_ids and sum(drafting.drafts.proposed) == 0
