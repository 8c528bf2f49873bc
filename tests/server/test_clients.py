"""The evaluation and benchmark clients people point at an OpenAI-compatible server, run as their
users run them (their command lines, from the test extra) against `graphc serve` of the trained
tiny checkpoint, on local data only: lm-evaluation-harness's `local-completions` model on a
generate_until task and a multiple_choice (loglikelihood) task shipped here, and GuideLLM's
benchmark on its synthetic data, tokenised with the checkpoint's own tokenizer. No timing is
asserted: the reports are parsed and printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from graphc.runtime import Engine, Request
from servers import Server

pytestmark = pytest.mark.compiles

TASK = Path(__file__).parent / "clients" / "graphc_generate.yaml"
CHOICE_TASK = Path(__file__).parent / "clients" / "graphc_choice.yaml"
CONTEXTS = ["def add(a, b):\n    return", "import os\nimport", "class Point:\n    def", "for i in range(",
            "    if x is None:\n        return", "with open(path) as f:\n    "]
MAX_GEN_TOKENS = 12


@pytest.fixture(scope="module")
def artifacts(compiled):
    return compiled("trained", "export", "prompt_as_decode", speculative=2)


@pytest.fixture(scope="module")
def server(artifacts):
    running = Server(artifacts)
    yield running
    assert running.stop() == 0, "".join(running.lines)


@pytest.fixture(scope="module")
def scoring_server(compiled):
    """A server of artifacts with prompt scores (`runtime.prompt_logprobs`)."""
    running = Server(compiled("trained", "export", "scores", prompt_logprobs=True))
    yield running
    assert running.stop() == 0, "".join(running.lines)


def _tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _lm_eval(server: Server, task: Path, docs: list[dict], checkpoint: Path, tmp_path: Path) -> tuple[dict, dict]:
    """lm-evaluation-harness's `local-completions` on `task` over `docs`: its results, and its
    filtered responses by document."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / task.name).write_text(task.read_text().replace("DOCS_JSONL", str(tmp_path / "docs.jsonl")))
    model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer={checkpoint},"
                  "num_concurrent=1,max_retries=1")
    run = subprocess.run([_tool("lm_eval"), "--model", "local-completions", "--model_args", model_args,
                          "--tasks", task.stem, "--include_path", str(tmp_path), "--batch_size", "4",
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    [samples] = (tmp_path / "out").rglob(f"samples_{task.stem}_*.jsonl")
    responses = {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, samples.read_text().splitlines())}
    return json.loads(results.read_text())["results"][task.stem], responses


def _greedy_texts(artifacts: Path) -> list[str]:
    """What graphc generates for each context, greedy, as lm-evaluation-harness asks for it (the
    context's ids without special tokens; the text cut at its first newline)."""
    engine = Engine(artifacts)
    tokenizer = Tokenizer.from_file(str(artifacts / engine.manifest.tokenizer))
    results = engine.generate([Request(tokenizer.encode(c, add_special_tokens=False).ids, MAX_GEN_TOKENS)
                               for c in CONTEXTS])
    return [tokenizer.decode(r.output_ids).split("\n")[0] for r in results]


def test_lm_evaluation_harness_generate_until_scores_graphcs_own_greedy_text(server, artifacts, tiny_checkpoints,
                                                                             tmp_path):
    want = _greedy_texts(artifacts)
    # Every other target is graphc's own text: exact_match must come out at exactly one half.
    docs = [{"context": c, "target": text if n % 2 == 0 else text + " and more"}
            for n, (c, text) in enumerate(zip(CONTEXTS, want))]
    results, responses = _lm_eval(server, TASK, docs, tiny_checkpoints["trained"], tmp_path)
    assert [responses[n][0] for n in range(len(CONTEXTS))] == want
    assert results["exact_match,none"] == 0.5


CHOICES = ["a", "b)", "None", "1", "self"]


def _loglikelihood(model, tokenizer: Tokenizer, context: str, choice: str) -> float:
    """The choice's log-likelihood after the context under `model` (transformers', fp32,
    teacher-forced), its tokens as lm-evaluation-harness cuts them: after the task's target
    delimiter (a space), the context's trailing whitespace moved into the continuation, the
    pair's tokens after the context's."""
    continuation = " " + choice
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(len(context_ids), len(whole))))


def test_lm_evaluation_harness_multiple_choice_scores_the_references_loglikelihoods(scoring_server, tiny_checkpoints,
                                                                                  tmp_path, report):
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoints["trained"]
    docs = [{"context": c, "choices": CHOICES, "gold": n % len(CHOICES)} for n, c in enumerate(CONTEXTS)]
    results, responses = _lm_eval(scoring_server, CHOICE_TASK, docs, checkpoint, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    want = [[_loglikelihood(model, tokenizer, d["context"], choice) for choice in CHOICES] for d in docs]
    got = [[float(ll) for ll, _ in responses[n]] for n in range(len(docs))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)
    accuracy = sum(max(range(len(CHOICES)), key=row.__getitem__) == d["gold"] for row, d in zip(want, docs)) / len(docs)
    assert results["acc,none"] == pytest.approx(accuracy)
    report(f"lm-eval multiple choice: {len(docs) * len(CHOICES)} loglikelihoods, largest |difference| from transformers' "
           f"{(torch.tensor(got) - torch.tensor(want)).abs().max():.2e}; acc {results['acc,none']:.3f}, the reference's "
           f"{accuracy:.3f}")


@pytest.mark.parametrize("profile", ["kind=synchronous", "kind=constant,rate=4"])
def test_guidellm_benchmarks_with_no_failed_request(server, tiny_checkpoints, tmp_path, profile):
    report = tmp_path / "report.json"
    run = subprocess.run([_tool("guidellm"), "run", "--backend", f"kind=openai_http,target={server.url}",
                          "--profile", profile, "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                          "--constraint", "kind=max_requests,count=6",
                          "--tokenizer", f"kind=hf_auto,model={tiny_checkpoints['trained']}",
                          "--output", f"kind=json,path={report}", "--disable-console"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    # No request fails. How many it counts is GuideLLM's: at a constant rate its run has ended at the
    # max_requests constraint with 5 of the 6 counted (none errored or incomplete).
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == totals["total"] > 0, totals
    assert metrics["output_token_count"]["successful"]["total_sum"] == totals["successful"] * 16
    medians = {name: metrics[name]["successful"]["median"] for name in
               ("time_to_first_token_ms", "inter_token_latency_ms", "output_tokens_per_second")}
    assert all(value > 0 for value in medians.values()), medians
    print(f"guidellm {profile}: " + ", ".join(f"{name} median {value:.1f}" for name, value in medians.items()))


def test_echo_gives_the_prompts_text_and_logprobs_before_the_completions_streamed_or_not(scoring_server, compiled):
    """What the multiple-choice task reads, in full: `echo` with `logprobs` is the prompt's text
    and its tokens' logprobs (the first null) from the engine's prompt scores, then the
    completion's, as a request without echo gives them; `max_tokens` 0 scores the prompt alone."""
    artifacts = compiled("trained", "export", "scores", prompt_logprobs=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub"  # 39 tokens: three score chunks
    client = scoring_server.client
    options = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    plain = client.completions.create(**options).choices[0]
    echoed = client.completions.create(**options, echo=True).choices[0]
    assert echoed.text == prompt + plain.text
    ids = Tokenizer.from_file(str(artifacts / "tokenizer.json")).encode(prompt).ids
    [scored] = Engine(artifacts).generate([Request(ids, 0, prompt_logprobs=2)])
    logprobs = echoed.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in scored.prompt_logprobs[1:]],
                                                                abs=1e-6)
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-6)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(ids) + 3)]
    chunks = list(client.completions.create(**options, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    only = client.completions.create(**{**options, "max_tokens": 0}, echo=True)
    assert (only.choices[0].text, only.choices[0].finish_reason, only.usage.completion_tokens) == (prompt, "length", 0)
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs[:len(ids)], abs=1e-6)
