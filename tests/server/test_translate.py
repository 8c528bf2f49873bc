"""`graphc.server.translate`: a request body as the engine's request, each refusal naming its field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphc.artifacts.manifest import RuntimeInfo
from graphc.sampling import Sampling
from graphc.server.schemas import CompletionRequest
from graphc.server.translate import BadRequest, generation_request

MANIFEST = SimpleNamespace(  # what a request reads of the manifest
    model=SimpleNamespace(vocab_size=256),
    buckets=SimpleNamespace(context_limit=128),
    runtime=RuntimeInfo(max_num_prefilling_tokens=64, max_new_tokens=16, sampling=Sampling(seed=9)),
)


def translated(prompt: list[int], **fields):
    return generation_request(CompletionRequest(model="m", prompt=prompt, **fields), prompt, MANIFEST)


def test_the_bodys_fields_become_the_engines_request():
    request = translated([1, 2], max_tokens=5, temperature=0.5, ignore_eos=True, min_tokens=2)
    assert (request.prompt, request.max_new_tokens, request.stop_at_eos, request.min_new_tokens) == ([1, 2], 5, False, 2)
    assert request.sampling == Sampling(temperature=0.5, seed=9)


@pytest.mark.parametrize("prompt, fields, param, says", [
    ([1, 999], {}, "prompt", "token id 999 is outside the vocabulary 0..255"),
    ([1, 2], {"top_p": 0.0}, "top_p", "top_p: 0.0 must be a number in (0, 1]"),
    ([1, 2], {"max_tokens": 0}, "max_tokens", "max_tokens: 0 must be at least 1"),
    ([1, 2], {"max_tokens": 127}, "max_tokens", "this model's maximum context length is 128 tokens; the request "
                                                "asks for 129 (2 in the prompt, 127 for the completion)"),
    ([1] * 120, {"min_tokens": 9}, "min_tokens", "min_tokens: 9 is more than max_tokens (8)"),
])
def test_a_refusal_names_its_field(prompt, fields, param, says):
    with pytest.raises(BadRequest) as refused:
        translated(prompt, **fields)
    assert (str(refused.value), refused.value.param) == (says, param)
