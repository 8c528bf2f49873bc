"""`graphc.request`: the checks and defaults `graphc run`, its prompts file and `graphc serve` share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphc.artifacts.manifest import RuntimeInfo
from graphc.errors import GraphcError
from graphc.request import (Asked, default_max_new_tokens, first_sampling_error, merged_sampling,
                            read_prompts_file, run_request, vocabulary_error)
from graphc.sampling import Sampling
from graphc.server.schemas import CompletionRequest
from graphc.server.translate import generation_request

VOCAB, CONTEXT_LIMIT, MAX_NEW_TOKENS = 256, 128, 16
MANIFEST = SimpleNamespace(  # what a request reads of the manifest
    model=SimpleNamespace(vocab_size=VOCAB),
    buckets=SimpleNamespace(context_limit=CONTEXT_LIMIT),
    runtime=RuntimeInfo(max_num_prefilling_tokens=64, max_new_tokens=MAX_NEW_TOKENS,
                        sampling=Sampling(temperature=0.5, top_k=7, seed=9)),
)


def run_of(asked: Asked, max_new_tokens: int | None = None, sampling: dict | None = None):
    return run_request(asked, MANIFEST, None, max_new_tokens, sampling or {}, stop_at_eos=True)


@pytest.mark.parametrize("prompt, bad", [([1, 256], 256), ([-1, 2], -1), ([5, 300, -4], 300)])
def test_a_token_outside_the_vocabulary_is_named_with_the_bound(prompt, bad):
    assert vocabulary_error(prompt, VOCAB) == f"token id {bad} is outside the vocabulary 0..255"


def test_tokens_inside_the_vocabulary_pass():
    assert vocabulary_error([0, 17, 255], VOCAB) is None


def test_the_first_refused_sampling_parameter_is_the_rules_first():
    assert first_sampling_error({"seed": -1, "temperature": float("nan")}) == (
        "temperature", "nan must be a finite number >= 0 (0 is greedy)")
    assert first_sampling_error({"top_p": 0.5, "seed": 3}) is None


def test_sampling_merge_later_overrides_win_and_the_manifest_fills_the_rest():
    options, line = {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.2}
    assert merged_sampling(MANIFEST, options, line) == Sampling(temperature=1.2, top_k=7, top_p=0.9, seed=9)
    assert merged_sampling(MANIFEST) == MANIFEST.runtime.sampling


@pytest.mark.parametrize("prompt_tokens, expected", [
    (3, MAX_NEW_TOKENS),                      # room to spare: the manifest's
    (CONTEXT_LIMIT - 8, 8),                   # clipped to the room left
    (CONTEXT_LIMIT - 1, 1),
    (CONTEXT_LIMIT, 1), (CONTEXT_LIMIT + 5, 1),  # no room: the scheduler refuses the prompt
])
def test_default_max_new_tokens_is_clipped_to_the_context(prompt_tokens, expected):
    assert default_max_new_tokens(MANIFEST, prompt_tokens) == expected


@pytest.mark.parametrize("prompt_tokens", [3, CONTEXT_LIMIT - 8, CONTEXT_LIMIT - 1])
def test_run_and_serve_give_the_same_default_max_new_tokens(prompt_tokens):
    prompt = [5] * prompt_tokens
    ran, error = run_of(Asked(prompt, "prompt 0"))
    # A server given the manifest's seed (`graphc serve --seed`); without one it draws fresh noise.
    served = generation_request(CompletionRequest(model="m", prompt=prompt), prompt, MANIFEST,
                                MANIFEST.runtime.sampling.seed)
    assert error is None
    assert ran.max_new_tokens == served.max_new_tokens == default_max_new_tokens(MANIFEST, prompt_tokens)
    assert ran.sampling == served.sampling == MANIFEST.runtime.sampling


def test_run_a_lines_fields_override_the_options_which_override_the_manifest():
    asked = Asked([1, 2], "p.jsonl:1", max_new_tokens=3, sampling={"seed": 4})
    request, _ = run_of(asked, max_new_tokens=5, sampling={"seed": 1, "top_p": 0.5})
    assert request.max_new_tokens == 3 and request.sampling == Sampling(temperature=0.5, top_k=7, top_p=0.5, seed=4)
    assert run_of(Asked([1, 2], "prompt 0"), max_new_tokens=5)[0].max_new_tokens == 5


def test_run_keeps_a_given_max_new_tokens_past_the_context():
    """The scheduler stops it at the context limit (finish reason "context_limit")."""
    assert run_of(Asked([5] * 120, "prompt 0"), max_new_tokens=50)[0].max_new_tokens == 50


def test_run_names_where_a_token_is_outside_the_vocabulary():
    assert run_of(Asked([1, 999], "prompt 2"))[1] == "prompt 2: token id 999 is outside the vocabulary 0..255"
    assert run_of(Asked([], "f.jsonl:3", error="f.jsonl:3: not valid JSON (x)"))[1] == "f.jsonl:3: not valid JSON (x)"


def test_run_refuses_text_without_a_tokenizer():
    with pytest.raises(GraphcError, match="text prompts need a tokenizer.json"):
        run_of(Asked("hello", "prompt 0"))


def test_prompts_file_lines_become_requests_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [1, 2], "max_new_tokens": 3, "seed": 4}\n\n  \n{"prompt": "hi", "top_p": 1}\n')
    assert read_prompts_file(path) == [
        Asked([1, 2], f"{path}:1", 3, {"seed": 4}),
        Asked("hi", f"{path}:4", None, {"top_p": 1}),
    ]


@pytest.mark.parametrize("line, says", [
    ("{not json", "not valid JSON"),
    ('["prompt_ids", [1]]', "expected an object with 'prompt' or 'prompt_ids' and optionally max_new_tokens, "
                            "temperature, top_k, top_p, seed"),
    ('{"prompt_ids": [1], "temprature": 0.5}', "expected an object"),
    ('{"prompt_ids": [1], "prompt": "hi"}', "give 'prompt' or 'prompt_ids', not both"),
    ('{"prompt_ids": [1], "max_new_tokens": "5"}', "max_new_tokens is '5'; expected int"),
    ('{"prompt_ids": [1], "seed": true}', "seed is True; expected int"),
    ('{"prompt_ids": [1.5]}', "prompt_ids must be a list of integers, got [1.5]"),
    ('{"prompt_ids": [1], "max_new_tokens": 0}', "max_new_tokens is 0; it must be >= 1"),
    ('{"prompt_ids": [1], "top_p": 2}', "top_p 2 must be a number in (0, 1]"),
])
def test_a_bad_prompts_file_line_is_a_request_with_its_own_error(tmp_path, line, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [1]}\n' + line + "\n")
    good, bad = read_prompts_file(path)
    assert good.error is None
    assert bad.prompt == [] and bad.error.startswith(f"{path}:2: ") and says in bad.error, bad.error


def test_a_prompts_file_that_is_not_utf8_fails_the_command(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(GraphcError, match=f"--prompts-file {path}: not UTF-8 text"):
        read_prompts_file(path)
