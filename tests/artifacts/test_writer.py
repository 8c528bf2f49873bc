"""The compiler's side of the artifacts: the chat template read from a checkpoint."""

from __future__ import annotations

import json

import pytest

from graphc.artifacts.manifest import ChatTemplate
from graphc.artifacts.writer import read_chat_template
from graphc.errors import GraphcError


def _write(folder, data) -> None:
    (folder / "tokenizer_config.json").write_text(data if isinstance(data, str) else json.dumps(data))


def test_a_template_and_its_special_tokens_are_read(tmp_path):
    _write(tmp_path, {"chat_template": "{{ bos_token }}x", "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    assert read_chat_template(tmp_path) == ChatTemplate("{{ bos_token }}x", "<s>", "</s>")


def test_of_several_named_templates_the_default_is_read(tmp_path):
    _write(tmp_path, {"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]})
    assert read_chat_template(tmp_path).template == "d"


@pytest.mark.parametrize("data", [None, {"bos_token": "<s>"}, {"chat_template": [{"name": "tool_use", "template": "t"}]}])
def test_no_template_is_none(tmp_path, data):
    if data is not None:
        _write(tmp_path, data)
    assert read_chat_template(tmp_path) is None


@pytest.mark.parametrize("data, says", [("{not json", "not valid JSON"), ({"chat_template": 3}, "must be a string")])
def test_a_broken_tokenizer_config_is_named(tmp_path, data, says):
    _write(tmp_path, data)
    with pytest.raises(GraphcError, match=says):
        read_chat_template(tmp_path)
