"""Logprobs (`graphc.runtime.logprobs`) of compiled artifacts against the eager reference's
log-softmax (transformers'), teacher-forced on the tokens they generated (fp32: within 1e-5, the same top-N
tokens): greedy and sampled at one rank and at cp 2 x ep 2, and with MTP drafts on (a row that asks
for logprobs does not draft: its tokens are the tokens without drafts)."""

from __future__ import annotations

import pytest
import torch

from graphc.runtime import Engine, Request
from graphc.runtime.launch import serve
from graphc.runtime.logprobs import token_logprobs
from graphc.runtime.replicas import ReplicatedScheduler
from graphc.runtime.scheduler import Scheduler
from graphc.sampling import Sampling

PRESET, BUCKETS = "wide-16e", "small"  # the buckets test_parallel_serve compiles at 1 and 2 x 2 ranks
PROMPTS = [[(7 * i + n) % 240 + 5 for i in range(n)] for n in (3, 17)]
NEW_TOKENS, TOP = 6, 5
SAMPLING = [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=5)]


def _requests(prompts=PROMPTS, **options) -> list[Request]:
    return [Request(p, NEW_TOKENS, s, stop_at_eos=False, **options) for p in prompts for s in SAMPLING]


def _check_against_the_reference(checkpoint, results) -> None:
    """Against transformers' DeepseekV3ForCausalLM (graphc's reference for V3: `graphc compare`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for result in results:
        prompt, tokens = result.request.prompt, result.output_ids
        assert len(result.logprobs) == len(tokens) == NEW_TOKENS
        with torch.no_grad():
            whole = model(torch.tensor([prompt + tokens])).logits[0]
        want = whole[len(prompt) - 1:-1].float().log_softmax(-1)
        got = torch.tensor([entry.logprob for entry in result.logprobs])
        torch.testing.assert_close(got, want[torch.arange(len(tokens)), torch.tensor(tokens)], rtol=0, atol=1e-5)
        for entry, row in zip(result.logprobs, want):
            values, ids = row.topk(TOP)
            assert [token for token, _ in entry.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), values, rtol=0, atol=1e-5)


def test_a_tokens_logprob_and_the_most_likely_are_the_log_softmaxs():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    entry = token_logprobs(logits, 2, 2)
    expected = logits.log_softmax(-1)
    assert entry.logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in entry.top] == [1, 2] and entry.top[0][1] == pytest.approx(float(expected[1]))
    assert token_logprobs(logits, 0, 0).top == ()


def test_data_parallel_replicas_refuse_logprobs_naming_why():
    replica = dict(prefill=[4], decode=[1], context_limit=32, block_size=4, num_blocks=16,
                   max_num_prefilling_tokens=4, eos_token_ids=[0])
    replicated = ReplicatedScheduler([Scheduler([], **replica), Scheduler([], **replica)])
    assert replicated.refusal(Request([5, 6], 2, logprobs=0)).startswith("logprobs, penalties, logit_bias and response formats are served")
    assert replicated.refusal(Request([5, 6], 2)) is None


@pytest.mark.compiles
def test_one_rank_gives_the_references_logprobs_greedy_and_sampled(compiled, tiny_checkpoints):
    artifacts = compiled(PRESET, "export", BUCKETS)
    with_logprobs = Engine(artifacts).generate(_requests(logprobs=TOP))
    without = Engine(artifacts).generate(_requests())
    assert [r.output_ids for r in with_logprobs] == [r.output_ids for r in without]
    assert all(r.logprobs is None for r in without)
    _check_against_the_reference(tiny_checkpoints[PRESET], with_logprobs)


@pytest.mark.compiles
@pytest.mark.multirank
def test_cp2_ep2_gives_the_references_logprobs(compiled, tiny_checkpoints):
    [outcome] = serve(compiled(PRESET, "export", BUCKETS, 2, 2, True), [_requests(logprobs=TOP)])
    _check_against_the_reference(tiny_checkpoints[PRESET], outcome.results)


@pytest.mark.compiles
def test_with_mtp_drafts_a_row_asking_for_logprobs_gives_the_tokens_without_drafts(compiled, tiny_checkpoints):
    prompts = [[(11 * i + 3) % 200 + 7 for i in range(20)]]
    plain = Engine(compiled("trained", "export", "prompt_as_decode")).generate(_requests(prompts))
    drafting = Engine(compiled("trained", "export", "prompt_as_decode", speculative=2))
    served = drafting.generate(_requests(prompts, logprobs=TOP))
    assert [r.output_ids for r in served] == [r.output_ids for r in plain]
    assert sum(drafting.drafts.proposed) == 0  # rows asking for logprobs never draft
    _check_against_the_reference(tiny_checkpoints["trained"], served)
