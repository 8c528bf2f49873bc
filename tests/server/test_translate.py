"""`graphc.server.translate`: a request body as the engine's request, each refusal naming its field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphc.artifacts.manifest import RuntimeInfo
from graphc.sampling import Sampling
from graphc.server.schemas import CompletionRequest
from graphc.server.translate import BadRequest, encode, generation_request, prompt_char_limit

MANIFEST = SimpleNamespace(  # what a request reads of the manifest
    model=SimpleNamespace(vocab_size=256),
    buckets=SimpleNamespace(context_limit=128),
    runtime=RuntimeInfo(max_num_prefilling_tokens=64, max_new_tokens=16, sampling=Sampling(seed=9)),
)


def translated(prompt: list[int], **fields):
    return generation_request(CompletionRequest(model="m", prompt=prompt, **fields), prompt, MANIFEST)


def test_the_bodys_fields_become_the_engines_request():
    request = translated([1, 2], max_tokens=5, temperature=0.5, ignore_eos=True, min_tokens=2, seed=3)
    assert (request.prompt, request.max_new_tokens, request.stop_at_eos, request.min_new_tokens) == ([1, 2], 5, False, 2)
    assert request.sampling == Sampling(temperature=0.5, seed=3)


def test_a_body_without_a_seed_gets_fresh_noise_unless_the_server_sets_one():
    """As OpenAI and vLLM: identical unseeded requests sample differently (not the manifest's seed
    9, which made them return identical text); the server's --seed makes them reproducible."""
    body = CompletionRequest(model="m", prompt=[1, 2], temperature=1.0)
    seeds = {generation_request(body, [1, 2], MANIFEST).sampling.seed for _ in range(8)}
    assert len(seeds) == 8 and 9 not in seeds
    assert {generation_request(body, [1, 2], MANIFEST, default_seed=5).sampling.seed for _ in range(3)} == {5}
    given = CompletionRequest(model="m", prompt=[1, 2], temperature=1.0, seed=0)
    assert generation_request(given, [1, 2], MANIFEST, default_seed=5).sampling.seed == 0


@pytest.mark.parametrize("prompt, fields, param, says", [
    ([1, 999], {}, "prompt", "token id 999 is outside the vocabulary 0..255"),
    ([1, 2], {"top_p": 0.0}, "top_p", "top_p: 0.0 must be a number in (0, 1]"),
    ([1, 2], {"max_tokens": 0}, "max_tokens", "max_tokens: 0 must be at least 1 (0 only with echo and logprobs, to score "
                                             "a prompt)"),
    ([1, 2], {"max_tokens": 127}, "max_tokens", "this model's maximum context length is 128 tokens; the request "
                                                "asks for 129 (2 in the prompt, 127 for the completion)"),
    ([1] * 120, {"min_tokens": 9}, "min_tokens", "min_tokens: 9 is more than max_tokens (8)"),
])
def test_a_refusal_names_its_field(prompt, fields, param, says):
    with pytest.raises(BadRequest) as refused:
        translated(prompt, **fields)
    assert (str(refused.value), refused.value.param) == (says, param)


def tokenizer(pre_tokenizer=None, normalizer=None, model=None, added: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, models, pre_tokenizers

    made = Tokenizer(model or models.BPE({"a": 0, "b": 1, "ab": 2, "abab": 3}, [("a", "b"), ("ab", "ab")]))
    made.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel()
    if normalizer is not None:
        made.normalizer = normalizer
    made.add_special_tokens(list(added))
    return made


def test_a_prompt_is_bounded_by_its_longest_token_where_nothing_drops_characters():
    from tokenizers import normalizers, pre_tokenizers

    assert prompt_char_limit(tokenizer(), 128) == 127 * 4  # "abab"
    assert prompt_char_limit(tokenizer(added=("<|begin_of_sentence|>",)), 128) == 127 * 21
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.ByteLevel()])
    assert prompt_char_limit(tokenizer(split, normalizers.Sequence([normalizers.Prepend("_")])), 10) == 9 * 4


def test_no_bound_where_a_tokenizer_can_drop_characters():
    from tokenizers import models, normalizers, pre_tokenizers

    assert prompt_char_limit(tokenizer(pre_tokenizers.Whitespace()), 128) is None  # spaces vanish
    assert prompt_char_limit(tokenizer(pre_tokenizers.Split(" ", "removed")), 128) is None
    assert prompt_char_limit(tokenizer(normalizer=normalizers.NFC()), 128) is None  # composing shortens
    assert prompt_char_limit(tokenizer(normalizer=normalizers.Sequence([normalizers.Strip()])), 128) is None
    fused = models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)  # many unknowns, one token
    assert prompt_char_limit(tokenizer(model=fused), 128) is None
    assert prompt_char_limit(tokenizer(model=models.WordPiece({"a": 0, "[UNK]": 1})), 128) is None


def test_a_text_longer_than_the_bound_is_refused_before_it_is_tokenised():
    with pytest.raises(BadRequest) as refused:
        encode("abab" * 150, None, 127 * 4, 128, "prompt", add_special_tokens=True)  # no tokenizer: never reached
    assert (str(refused.value), refused.value.param) == (
        "this model's maximum context length is 128 tokens; a prompt of 600 characters cannot fit it (no 127 tokens "
        "of this tokenizer hold more than 508)", "prompt")
