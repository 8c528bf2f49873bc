"""Compiled DeepSeek-V4.1 served at (cp, ep) = (1, 1), (2, 2), (4, 4) gives the eager reference's
greedy tokens (fp32, 3 prompts x 32 tokens), and the eager paged model equals the reference under
chunked prefill, decode and context / expert parallelism.

The prompts (1, 9 and 30 tokens) run in 1, 2 and 4 chunks of the one prefill bucket and decode in
steps of 2 and a padded 1; at 30 tokens and more every selection keeps fewer entries than are
visible and the candidate blocks hold fewer still, and the sliding window has slid."""

from __future__ import annotations

import pytest
import torch

from graphc.weights.checkpoint import load_reference
from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from graphc.topology import Topology
from multirank import greedy_on_rank, run_ranks

PROMPTS = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (1, 9, 30)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoints):
    """The reference's greedy continuation of each prompt (whole sequences, no cache)."""
    model = load_reference(tiny_checkpoints["v41"])
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            sequence = list(prompt)
            for _ in range(NEW_TOKENS):
                sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
            out.append(sequence[len(prompt):])
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("cp, ep", [(1, 1), (2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])  # 4+ ranks: nightly
def test_eager_paged_ranks_equal_the_reference(cp, ep, tiny_checkpoints):
    """Chunks of 7 over blocks of 4, then 12 decode steps: logits within fp32 rounding of the
    reference's on the whole sequence, and its tokens."""
    prompt = PROMPTS[-1]
    reference = load_reference(tiny_checkpoints["v41"])
    results = run_ranks(Topology(cp, ep), greedy_on_rank, str(tiny_checkpoints["v41"]), "static" if ep > 1 else "local",
                        [prompt], 7, 12, 4, 24, 16)
    for logits, tokens in results:
        with torch.no_grad():
            whole = reference(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
        assert tokens == whole.argmax(-1).tolist()
        torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


def _served(artifacts, cp: int) -> list[list[int]]:
    requests = [Request(p, NEW_TOKENS, stop_at_eos=False) for p in PROMPTS]
    if cp == 1:
        return [r.output_ids for r in Engine(artifacts).generate(requests)]
    [outcome] = serve(artifacts, [requests])
    return [r.output_ids for r in outcome.results]


@pytest.mark.multirank
@pytest.mark.compiles
@pytest.mark.parametrize("cp, ep", [(1, 1), (2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_export_serves_the_reference_tokens(cp, ep, compiled, reference_tokens):
    assert _served(compiled("v41", "export", "small", cp, ep), cp) == reference_tokens


@pytest.mark.compiles
@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_serves_the_reference_tokens(compiled, reference_tokens):
    assert _served(compiled("v41", "inductor", "small"), 1) == reference_tokens
