"""The evaluation and benchmark clients people point at an OpenAI-compatible server, run as their
users run them (their command lines, from the test extra) against `graphc serve` of the trained
tiny checkpoint, on local data only: lm-evaluation-harness's `local-completions` model on a
generate_until task shipped here, and GuideLLM's benchmark on its synthetic data, tokenised
with the checkpoint's own tokenizer. No timing is asserted: the reports are parsed and printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from graphc.runtime import Engine, Request
from servers import Server

pytestmark = pytest.mark.compiles

TASK = Path(__file__).parent / "clients" / "graphc_generate.yaml"
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


def _tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


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
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / TASK.name).write_text(TASK.read_text().replace("DOCS_JSONL", str(tmp_path / "docs.jsonl")))
    model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer={tiny_checkpoints['trained']},"
                  "num_concurrent=1,max_retries=1")
    run = subprocess.run([_tool("lm_eval"), "--model", "local-completions", "--model_args", model_args,
                          "--tasks", "graphc_generate", "--include_path", str(tmp_path), "--batch_size", "4",
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    [samples] = (tmp_path / "out").rglob("samples_graphc_generate_*.jsonl")
    responses = {s["doc_id"]: s["filtered_resps"][0] for s in map(json.loads, samples.read_text().splitlines())}
    assert [responses[n] for n in range(len(CONTEXTS))] == want
    assert json.loads(results.read_text())["results"]["graphc_generate"]["exact_match,none"] == 0.5


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
    assert metrics["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    assert metrics["output_token_count"]["successful"]["total_sum"] == 6 * 16
    medians = {name: metrics[name]["successful"]["median"] for name in
               ("time_to_first_token_ms", "inter_token_latency_ms", "output_tokens_per_second")}
    assert all(value > 0 for value in medians.values()), medians
    print(f"guidellm {profile}: " + ", ".join(f"{name} median {value:.1f}" for name, value in medians.items()))
