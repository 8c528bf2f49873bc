"""`graphc serve` as its users meet it: a real server process on a loopback port, driven with the
official `openai` client (and raw HTTP for what the client would refuse to send)."""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest
from tokenizers import Tokenizer

from graphc.runtime import Engine, Request
from graphc.runtime.penalties import Penalties
from graphc.sampling import Sampling
from graphc.server.logprob_format import token_text
from multirank import channel_segments
from servers import Server

pytestmark = pytest.mark.compiles

PRESET, BUCKETS = "lora-groups", "prompt_as_decode"  # its checkpoint has a tokenizer; [B, P] graphs too
CONTEXT_LIMIT = 128


@pytest.fixture(scope="module")
def artifacts(compiled):
    return compiled(PRESET, "export", BUCKETS)


@pytest.fixture(scope="module")
def server(artifacts):
    running = Server(artifacts)
    yield running
    assert running.stop() == 0, "".join(running.lines)


def prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 5 * n) % 250 + 3 for i in range(2 + (7 * n) % 40)] for n in range(count)]


def expected(artifacts: Path, requests: list[Request]) -> list[list[int]]:
    """What `graphc run` serves (its engine, in-process) for the same requests."""
    return [r.output_ids for r in Engine(artifacts).generate(requests)]


def streamed_ids(server: Server, prompt: list[int], **options) -> tuple[list[int], str | None]:
    ids, finish = [], None
    for chunk in server.client.completions.create(model="tiny", prompt=prompt, stream=True, **options):
        ids += chunk.choices[0].model_extra["token_ids"]
        finish = chunk.choices[0].finish_reason or finish
    return ids, finish


def test_completions_give_the_tokens_graphc_run_gives(server, artifacts):
    batch = prompts(4)
    greedy = expected(artifacts, [Request(p, 12) for p in batch])
    sampled = expected(artifacts, [Request(p, 12, Sampling(temperature=0.8, top_p=0.9, seed=7)) for p in batch])
    for prompt, want, want_sampled in zip(batch, greedy, sampled):
        done = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].model_extra["token_ids"] == want
        assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == len(want)
        assert streamed_ids(server, prompt, max_tokens=12, temperature=0)[0] == want
        kept = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8,
                                                top_p=0.9, seed=7)
        assert kept.choices[0].model_extra["token_ids"] == want_sampled


def test_a_text_prompt_is_encoded_and_the_text_decoded_with_the_tokenizer(server, artifacts):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(artifacts / "tokenizer.json"))
    done = server.client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    [want] = expected(artifacts, [Request(tokenizer.encode("Hello there").ids, 6)])
    assert done.choices[0].model_extra["token_ids"] == want
    assert done.choices[0].text == tokenizer.decode(want)
    chunks = server.client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(want)


def test_thirty_two_concurrent_streams_all_get_their_tokens(server, artifacts):
    batch = prompts(32)
    want = expected(artifacts, [Request(p, 10) for p in batch])
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: streamed_ids(server, p, max_tokens=10, temperature=0)[0], batch))
    assert got == want
    assert server.metrics()['graphc_steps_total{bucket="decode-4x4"}'] > 0  # short prompts joined running decodes


@pytest.mark.parametrize("body, says", [
    ('{"model": "tiny", "prompt": [5, 6', "JSON"),
    ({"model": "tiny", "prompt": [5, 6], "max_tokens": 4, "best_of": 2}, "best_of: Extra inputs are not permitted"),
    ({"model": "tiny", "prompt": [5, 6], "max_tokens": "4"}, "max_tokens"),
    ({"model": "tiny", "prompt": [5, 6], "temperature": -1}, "temperature: -1"),
    ({"model": "tiny", "prompt": [5, 999]}, "token id 999 is outside the vocabulary"),
    ({"model": "tiny", "prompt": list(range(3, 3 + CONTEXT_LIMIT))}, "leaves no room under context_limit"),
    ({"model": "tiny", "prompt": [5, 6], "max_tokens": CONTEXT_LIMIT}, "maximum context length is 128 tokens"),
    ({"model": "tiny", "prompt": [5, 6], "n": 9}, "n: 9 is more than the 8 choices"),
    ({"model": "tiny", "prompt": []}, "empty prompt"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "messages.0: content is null or missing"),
])
def test_bad_requests_get_400_with_an_openai_error_and_the_next_is_served(server, body, says):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx2.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError):  # the client sees it as the error it knows
        server.client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4, temperature=-1)
    assert server.client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3


def test_a_model_the_server_does_not_serve_is_404_model_not_found_as_openai_answers(server):
    for path, body in (("/v1/completions", {"model": "gpt-4", "prompt": [5, 6]}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})):
        response = httpx2.post(f"{server.url}{path}", json=body)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        assert "model 'gpt-4' does not exist" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")
    assert server.client.models.retrieve("tiny").id == "tiny"


def test_vllm_request_shapes_benchmark_clients_send(server):
    """GuideLLM streams with vLLM's continuous_usage_stats (usage in every chunk); vLLM's top_k -1
    keeps every token, as 0 does."""
    chunks = list(server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counted == sorted(counted) and counted[-1] == 5 and all(c.usage.prompt_tokens == 3 for c in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
    sampled = [server.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=1.0, seed=3,
                                                extra_body={"top_k": top_k}).choices[0].model_extra["token_ids"]
               for top_k in (-1, 0)]
    assert sampled[0] == sampled[1]


def test_a_batch_of_prompts_gets_a_choice_each_in_order_as_lm_evaluation_harness_sends_it(server, artifacts):
    """`prompt` as a list of token lists (lm-evaluation-harness) or of strings: choice i is prompt
    i's, the tokens a request of its own would get; usage adds up; streamed chunks carry their index."""
    batch = prompts(3)
    want = expected(artifacts, [Request(p, 5) for p in batch])
    done = server.client.completions.create(model="tiny", prompt=batch, max_tokens=5, temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in done.choices] == want
    assert done.usage.prompt_tokens == sum(map(len, batch)) and done.usage.completion_tokens == sum(map(len, want))
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in server.client.completions.create(model="tiny", prompt=batch, max_tokens=5, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra["token_ids"]
    assert list(streamed.values()) == want
    texts = server.client.completions.create(model="tiny", prompt=["Hello there", "Hello"], max_tokens=3, temperature=0)
    alone = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert texts.choices[1].text == alone.choices[0].text


def test_a_batch_with_a_bad_prompt_is_refused_whole_naming_it(server):
    before = server.metrics()
    refused = httpx2.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [[5, 6], [5, 999]]})
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("prompt 1: token id 999")
    too_many = httpx2.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [[5]] * 65})
    assert too_many.status_code == 400 and "a batch of 65 prompts is more than the 64" in too_many.text
    assert server.metrics().get('graphc_requests_total{finish_reason="length"}') == \
        before.get('graphc_requests_total{finish_reason="length"}')  # nothing of either ran


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert httpx2.get(f"{server.url}/health").json() == {"status": "ok"}
    server.client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, extra_body={"ignore_eos": True})
    metrics = server.metrics()
    assert metrics["graphc_kv_blocks_total"] == 64 and metrics['graphc_requests_total{finish_reason="length"}'] > 0
    assert {"graphc_requests_waiting", "graphc_requests_running", "graphc_generated_tokens_total",
            "graphc_time_to_first_token_seconds_count", "graphc_inter_token_latency_seconds_count",
            "graphc_generation_tokens_per_second"} <= set(metrics)


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(server):
    prompt = [(17 * i) % 240 + 9 for i in range(30)]  # 29 positions before its last token: 3 blocks of 8
    before = server.metrics()
    first = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(server.client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    after = server.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24
    assert after["graphc_prefix_cache_queries_total"] - before["graphc_prefix_cache_queries_total"] == 60
    assert after["graphc_prefix_cache_hits_total"] - before["graphc_prefix_cache_hits_total"] == 24
    assert after["graphc_kv_blocks_cached"] >= 3


def test_n_choices_sample_with_their_own_seeds_and_read_their_prompts_blocks_from_the_first(server, artifacts):
    prompt = [(23 * i) % 210 + 13 for i in range(30)]  # 3 blocks of 8 before its last token
    want = expected(artifacts, [Request(prompt, 6, Sampling(temperature=0.9, seed=11 + j)) for j in range(3)])
    before = server.metrics()["graphc_prefix_cache_hits_total"]
    done = server.client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=0.9, seed=11)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in done.choices] == want
    assert len({tuple(ids) for ids in want}) > 1  # the seeds differ, so the choices do
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (30, sum(map(len, want)))
    assert done.usage.prompt_tokens_details.cached_tokens == 0  # the first choice computed the prompt
    assert server.metrics()["graphc_prefix_cache_hits_total"] - before == 2 * 24  # the other two read it


def test_a_batch_of_prompts_with_n_choices_numbers_them_prompt_by_prompt_streamed_or_not(server, artifacts):
    batch = [[(29 * i + n) % 200 + 5 for i in range(12)] for n in range(2)]
    want = expected(artifacts, [Request(p, 5, Sampling(temperature=1.0, seed=3 + j)) for p in batch for j in range(2)])
    options = dict(model="tiny", prompt=batch, n=2, max_tokens=5, temperature=1.0, seed=3)
    done = server.client.completions.create(**options)
    assert [(c.index, c.model_extra["token_ids"]) for c in done.choices] == list(enumerate(want))
    streamed = [[] for _ in want]
    for chunk in server.client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra["token_ids"]
    assert streamed == want


def test_completion_logprobs_are_the_engines_streamed_or_not(server, artifacts):
    prompt = [(31 * i) % 190 + 17 for i in range(11)]
    [want] = Engine(artifacts).generate([Request(prompt, 5, Sampling(temperature=0.7, seed=4), logprobs=3)])
    options = dict(model="tiny", prompt=prompt, max_tokens=5, temperature=0.7, seed=4, logprobs=3)
    done = server.client.completions.create(**options).choices[0]
    assert done.model_extra["token_ids"] == want.output_ids
    logprobs = done.logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    tokenizer = Tokenizer.from_file(str(artifacts / "tokenizer.json"))
    text = functools.partial(token_text, tokenizer)
    assert logprobs.tokens == [text(t) for t in want.output_ids]
    for top, entry in zip(logprobs.top_logprobs, want.logprobs):  # keyed by text: tokens that decode alike share one
        assert top == pytest.approx({text(t): lp for t, lp in entry.top}, abs=1e-6)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in server.client.completions.create(stream=True, **options):
        for name in streamed:
            streamed[name] += getattr(chunk.choices[0].logprobs, name) if chunk.choices[0].logprobs else []
    # The stream's prompt comes from the prefix cache, computed in another bucket: fp32 rounding apart.
    assert (streamed["tokens"], streamed["text_offset"]) == (logprobs.tokens, logprobs.text_offset)
    assert streamed["token_logprobs"] == pytest.approx(logprobs.token_logprobs, abs=1e-5)


def test_chat_logprobs_carry_each_tokens_text_bytes_and_alternatives(server):
    messages = [{"role": "user", "content": "hi"}]
    done = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2).choices[0]
    content = done.logprobs.content
    assert len(content) == len(done.model_extra["token_ids"]) == 4
    assert "".join(entry.token for entry in content) == done.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely
    plain = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_give_the_engines_tokens(server, artifacts):
    prompt = [(37 * i) % 180 + 21 for i in range(9)]
    penalties = Penalties(presence=0.5, frequency=0.8, repetition=1.4, logit_bias={42: 2.0})
    [want] = Engine(artifacts).generate([Request(prompt, 8, Sampling(temperature=0.9, seed=2), penalties=penalties)])
    done = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=2, presence_penalty=0.5, frequency_penalty=0.8,
        logit_bias={"42": 2.0}, extra_body={"repetition_penalty": 1.4})
    assert done.choices[0].model_extra["token_ids"] == want.output_ids
    forced = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0,
                                              logit_bias={"42": 100})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 4


SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                "required": ["ok", "n"], "additionalProperties": False}


def test_response_formats_give_json_that_validates_streamed_or_not(server):
    import jsonschema

    schema_format = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL_SCHEMA, "strict": True}}
    done = server.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=40, temperature=1.0, seed=3,
                                            extra_body={"response_format": schema_format}).choices[0]
    jsonschema.validate(json.loads(done.text), SMALL_SCHEMA)
    assert done.finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0, stream=True,
        response_format=schema_format))
    jsonschema.validate(json.loads(streamed), SMALL_SCHEMA)
    # Any JSON object: this random model opens a key and never closes it within max_tokens (whole
    # objects are tested on the trained checkpoint, tests/runtime/test_constraints.py): here, the wiring.
    opened = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=8, temperature=1.0, seed=1,
                                                   response_format={"type": "json_object"}).choices[0]
    assert opened.message.content.startswith('{"') and opened.finish_reason == "length"
    picked = server.client.completions.create(model="tiny", prompt=[9, 8], max_tokens=6, temperature=1.0,
                                              extra_body={"guided_choice": ["red", "green"]})
    assert picked.choices[0].text in ("red", "green")


@pytest.mark.parametrize("body, message, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema: cannot be compiled to a grammar: ", "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex and guided_choice: give one of", "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format: json_schema goes with type", "response_format"),
])
def test_a_grammar_that_cannot_be_followed_is_refused_naming_the_field(server, body, message, param):
    response = httpx2.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [5], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param, error


def test_requests_with_different_cache_salts_never_hit_each_others_blocks(server):
    prompt = [(13 * i) % 230 + 11 for i in range(30)]  # 3 blocks of 8 before its last token

    def hits(**salt) -> tuple[int, float]:
        before = server.metrics()["graphc_prefix_cache_hits_total"]
        done = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, **salt)
        return done.usage.prompt_tokens_details.cached_tokens, server.metrics()["graphc_prefix_cache_hits_total"] - before

    salted = [{"extra_body": {"cache_salt": s}} for s in ("tenant one", "tenant two")]
    assert [hits(), hits(**salted[0]), hits(**salted[1])] == [(0, 0)] * 3  # each salt computes it
    assert [hits(**salted[1]), hits(**salted[0]), hits()] == [(24, 24)] * 3  # then reuses its own


def test_each_api_key_of_an_isolating_server_has_its_own_cache(artifacts, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-one\nkey-two\n")
    isolating = Server(artifacts, "--api-keys-file", str(keys), "--prefix-cache-isolation", "api-key",
                       "--hide-cached-tokens", api_key="key-one")
    try:
        other = openai.OpenAI(base_url=f"{isolating.url}/v1", api_key="key-two", max_retries=0, timeout=120)
        prompt = [(19 * i) % 220 + 7 for i in range(30)]
        found = []
        for client in (isolating.client, other, other, isolating.client):
            before = _hits(isolating)
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
            found.append(_hits(isolating) - before)
            assert "prompt_tokens_details" not in done.usage.model_dump(exclude_unset=True)
        assert found == [0, 0, 24, 24]
    finally:
        assert isolating.stop() == 0, "".join(isolating.lines)


def _hits(server: Server) -> float:
    return float(re.search(r"^graphc_prefix_cache_hits_total (\S+)$", httpx2.get(
        f"{server.url}/metrics", headers={"authorization": f"Bearer {server.client.api_key}"}).text, re.M).group(1))


def test_fifty_clients_that_disconnect_mid_stream_free_every_block(server):
    def leave_early(n: int) -> int:
        body = {"model": "tiny", "prompt": prompts(50)[n], "max_tokens": 80, "stream": True, "ignore_eos": True}
        with httpx2.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for count, _ in enumerate(response.iter_lines(), start=1):
                if count >= 3:
                    return count  # the connection closes with the request still generating
        return 0

    generated = server.metrics()["graphc_generated_tokens_total"]
    with ThreadPoolExecutor(50) as pool:
        assert all(pool.map(leave_early, range(50)))
    deadline = time.monotonic() + 30
    while (m := server.metrics())["graphc_kv_blocks_in_use"] or m["graphc_requests_running"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m['graphc_requests_total{finish_reason="cancelled"}'] >= 50
    # Cancellation reached the engine: far fewer than the 50 x 80 tokens asked for were generated.
    assert m["graphc_generated_tokens_total"] - generated < 50 * 80 / 4
    assert server.client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3


def test_past_the_admission_queue_requests_get_429_with_retry_after(artifacts):
    # A pool that holds one of these requests at a time (14 of 17 blocks each), and room for two
    # waiting: a burst of eight is served in part, the rest told to come back. On IPv6's loopback,
    # which the server's address shows in brackets.
    server = Server(artifacts, "--max-waiting", "2", "--host", "::1", env={"GRAPHC_NUM_KV_BLOCKS": "17"})
    assert server.url.startswith("http://[::1]:")
    body = {"model": "tiny", "prompt": prompts(1)[0][:8], "max_tokens": 100, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: httpx2.post(f"{server.url}/v1/completions", json=body, timeout=120),
                                      range(8)))
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses and set(statuses) == {200, 429}, statuses
        assert statuses.count(200) <= 3  # one running and two waiting, at most
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
        served = [r.json()["choices"][0]["token_ids"] for r in responses if r.status_code == 200]
        assert all(ids == served[0] and len(ids) == 100 for ids in served)
    finally:
        assert server.stop() == 0


def test_sigterm_under_load_finishes_in_flight_streams_and_exits_0(artifacts):
    server = Server(artifacts, "--grace-period", "60")
    want = expected(artifacts, [Request(p, 40, stop_at_eos=False) for p in prompts(6)])
    first_tokens = threading.Barrier(7)

    def stream(prompt):
        ids, finish = [], None
        for n, chunk in enumerate(server.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, stream=True, temperature=0,
                extra_body={"ignore_eos": True})):
            ids += chunk.choices[0].model_extra["token_ids"]
            finish = chunk.choices[0].finish_reason or finish
            if n == 0:
                first_tokens.wait(60)
        return ids, finish

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, p) for p in prompts(6)]
        first_tokens.wait(60)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        results = [s.result() for s in streams]
    assert server.process.wait(60) == 0, "".join(server.lines)
    assert time.monotonic() - started < 60
    assert [ids for ids, _ in results] == want and {f for _, f in results} == {"length"}
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{server.url}/health")


@pytest.mark.multirank
def test_two_rank_artifacts_serve_the_one_rank_tokens_and_stop_cleanly(compiled, artifacts):
    """The server runs in the leader rank's process; the follower runs its steps and idles with it."""
    before = channel_segments()
    server = Server(compiled(PRESET, "export", "prompt_as_decode_small", 2, 2), "--grace-period", "60")
    batch = prompts(6)
    want = expected(artifacts, [Request(p, 12) for p in batch])
    try:
        time.sleep(2)  # idle between requests: the follower must still be there afterwards
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: streamed_ids(server, p, max_tokens=12, temperature=0)[0], batch))
        assert got == want
        done = server.client.completions.create(model="tiny", prompt=batch[0], max_tokens=12, temperature=0)
        assert done.choices[0].model_extra["token_ids"] == want[0]
    finally:
        started = time.monotonic()
        assert server.stop() == 0, "".join(server.lines)
    assert time.monotonic() - started < 60
    assert channel_segments() == before


def test_chat_completions_render_the_checkpoints_template_as_transformers_does(server, artifacts, tiny_checkpoints):
    from transformers import PreTrainedTokenizerFast

    checkpoint = tiny_checkpoints[PRESET]
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    reference = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), chat_template=template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = reference(text, add_special_tokens=False)["input_ids"]
    [want] = expected(artifacts, [Request(prompt, 8)])

    done = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert done.choices[0].model_extra["token_ids"] == want
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == reference.decode(want)
    assert done.usage.prompt_tokens == len(prompt)
    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_is_refused_clearly_where_the_checkpoint_has_no_template(tiny_checkpoints, tmp_path):
    import shutil

    import yaml

    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile
    from support import TEST_BUCKETS, model_yaml

    checkpoint = shutil.copytree(tiny_checkpoints[PRESET], tmp_path / "checkpoint")
    (checkpoint / "tokenizer_config.json").unlink()
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(checkpoint, TEST_BUCKETS["small"])))
    compile(load_config(tmp_path / "model.yaml"), tmp_path / "artifacts", CompileOptions(show_progress=False))
    server = Server(tmp_path / "artifacts")
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert server.client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        assert server.stop() == 0


def test_a_stop_string_cuts_the_text_and_min_tokens_holds_it_off(server, artifacts):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(artifacts / "tokenizer.json"))
    whole = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    start = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])  # a stop string past the start
    stop = text[start:start + 2]
    cut = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                                stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    held = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                            extra_body={"ignore_eos": True, "min_tokens": 12})
    assert held.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert held.choices[0].finish_reason == "length" and tokenizer.decode(whole.choices[0].model_extra["token_ids"]) == text


def test_stop_strings_inside_and_across_the_first_min_tokens_stream_the_text_they_return(server):
    """min_tokens 8 with 20 stop strings of the greedy text: some occur only inside the first 8
    tokens' text (exempt: the stream may have sent them), some across that boundary or after it.
    The streamed deltas add up to the unstreamed text either way."""
    options = dict(model="tiny", max_tokens=12, temperature=0)
    cases = []
    for prompt in ("Hello", "Hi", "The"):
        whole = server.client.completions.create(prompt=prompt, **options, extra_body={"ignore_eos": True})
        text = whole.choices[0].text
        cases += [(prompt, text[i:i + n]) for n in (1, 2) for i in range(len(text) - n + 1)
                  if "\ufffd" not in text[i:i + n]]
    assert len(cases) >= 20

    def both(case):
        prompt, stop = case
        body = dict(prompt=prompt, stop=[stop], **options, extra_body={"ignore_eos": True, "min_tokens": 8})
        streamed = "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **body))
        unstreamed = server.client.completions.create(**body).choices[0]
        return streamed, unstreamed.text, unstreamed.finish_reason

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(both, cases[:20]))
    assert [streamed for streamed, _, _ in texts] == [unstreamed for _, unstreamed, _ in texts]
    assert {finish for _, _, finish in texts} == {"stop", "length"}  # some cut, some exempt
