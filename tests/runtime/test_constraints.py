"""Structured outputs (`graphc.runtime.constraints`, llguidance) on the trained tiny checkpoint:
every output of a JSON schema with nested objects, enums, arrays and required fields parses and
validates, greedy and sampled; with MTP drafts on, a constrained row gives the tokens without
drafts; a regular expression and a set of choices hold too. The hundred schema outputs are served
at cp 2 x ep 2 and from neuron artifacts (on XLA:CPU) too, nightly: the same texts come out."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from graphc.runtime import Engine, Request
from graphc.runtime.constraints import Grammars, choice_grammar, json_schema_grammar, regex_grammar
from graphc.sampling import Sampling
from servers import Server

pytestmark = pytest.mark.compiles

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["function", "class", "module"]},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"public": {"type": "boolean"}, "doc": {"type": "string", "maxLength": 6}},
                 "required": ["public"], "additionalProperties": False},
    },
    "required": ["name", "kind", "meta"],
    "additionalProperties": False,
}
CONTEXT = 128  # the bucket sets' context_limit: the engine's requests stop there, the server's must ask for no more
TEXTS = ["def parse(", "class Tree:", "import re\n", "    return ", "# the value of"]


@pytest.fixture(scope="module")
def engine(compiled):
    return Engine(compiled("trained", "export", "prompt_as_decode"))


@pytest.fixture(scope="module")
def grammars(compiled, engine) -> tuple[Grammars, object]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(compiled("trained", "export", "prompt_as_decode") / "tokenizer.json"))
    model = engine.manifest.model
    return Grammars(tokenizer.to_str(), model.vocab_size, model.eos_token_id), tokenizer


def _constrained(engine: Engine, grammars, grammar: str, count: int, max_new_tokens: int = 160):
    """The texts and results of `count` requests following `grammar`, greedy and sampled in turn."""
    grammars, tokenizer = grammars
    requests = [Request(tokenizer.encode(TEXTS[n % len(TEXTS)]).ids, max_new_tokens,
                        Sampling(temperature=0.0 if n % 2 == 0 else 1.0, seed=n),
                        constraint=grammars.constraint(grammars.checked(grammar))) for n in range(count)]
    results = engine.generate(requests)
    # The output without its EOS (this tokenizer's EOS, id 0, is an ordinary token: it decodes to "\x00").
    return [tokenizer.decode(r.output_ids[:-1] if r.finish_reason == "eos" else r.output_ids) for r in results], results


def test_a_hundred_json_schema_outputs_parse_and_validate_greedy_and_sampled(engine, grammars):
    texts, results = _constrained(engine, grammars, json_schema_grammar(SCHEMA), 100)
    assert all(r.finish_reason == "eos" for r in results), [r.finish_reason for r in results]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled rows differ: the grammar leaves the model choices


@pytest.mark.slow  # a compile and a 4-rank server each; one rank on export is per commit (above)
@pytest.mark.multirank
@pytest.mark.parametrize("backend, cp, ep", [("export", 2, 2), ("neuron", 1, 1)], ids=["export-cp2-ep2", "neuron"])
def test_a_hundred_json_schema_outputs_are_one_export_ranks_at_other_layouts_and_on_neuron(compiled, engine, grammars,
                                                                                        backend, cp, ep):
    expected, _ = _constrained(engine, grammars, json_schema_grammar(SCHEMA), 100)
    _, tokenizer = grammars
    server = Server(compiled("trained", backend, "prompt_as_decode_small", cp, ep))
    schema = {"type": "json_schema", "json_schema": {"name": "code", "schema": SCHEMA, "strict": True}}

    def served(n: int) -> str:  # as _constrained asks: greedy and sampled in turn, seeded by the request's index
        prompt = tokenizer.encode(TEXTS[n % len(TEXTS)]).ids
        return server.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=CONTEXT - len(prompt), seed=n,
            temperature=0.0 if n % 2 == 0 else 1.0, extra_body={"response_format": schema}).choices[0].text

    try:
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(served, range(100)))
    finally:
        assert server.stop() == 0, "".join(server.lines)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert texts == expected


def test_any_json_object_parses(engine, grammars):
    texts, results = _constrained(engine, grammars, json_schema_grammar({"type": "object"}), 6)
    assert all(isinstance(json.loads(t), dict) for t, r in zip(texts, results) if r.finish_reason == "eos")
    assert sum(r.finish_reason == "eos" for r in results) >= 3, texts


def test_a_grammar_that_breaks_allows_only_eos_and_never_raises():
    from graphc.weights.tiny import byte_level_tokenizer

    grammars = Grammars(byte_level_tokenizer().to_str(), 256, [1])
    constraint = grammars.constraint(grammars.checked(choice_grammar(["yes"])))
    assert constraint.allowed().nonzero().flatten().tolist() == [ord("y")]
    constraint.take(ord("n"))  # not allowed: the grammar breaks instead of raising in the engine thread
    assert constraint.broken and constraint.allowed().nonzero().flatten().tolist() == [1]


def test_a_regex_and_a_choice_hold(engine, grammars):
    texts, _ = _constrained(engine, grammars, regex_grammar(r"[a-z]{2,6}_[0-9]{1,3}"), 6, 16)
    assert all(re.fullmatch(r"[a-z]{2,6}_[0-9]{1,3}", t) for t in texts), texts
    texts, _ = _constrained(engine, grammars, choice_grammar(["yes", "no", "maybe"]), 6, 8)
    assert set(texts) <= {"yes", "no", "maybe"}, texts


def test_with_mtp_drafts_a_constrained_row_gives_the_tokens_without_drafts(engine, grammars, compiled):
    drafting = Engine(compiled("trained", "export", "prompt_as_decode", speculative=2))
    plain, _ = _constrained(engine, grammars, json_schema_grammar(SCHEMA), 2)  # one greedy, one sampled
    drafted, _ = _constrained(drafting, grammars, json_schema_grammar(SCHEMA), 2)
    assert drafted == plain and sum(drafting.drafts.proposed) == 0
