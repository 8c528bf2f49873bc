"""`graphc compile`, `graphc run`, `graphc inspect` and `graphc serve`'s start-up: the serving side
of the command line.

`run` must print what the in-process `Engine` generates; bad input is one `error: ...` line and
exit status 2; a request that cannot be served fails alone. Export backend only.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from graphc.artifacts.manifest import FORMAT_VERSION, MANIFEST
from graphc.cli import cli
from graphc.passes.registry import PASS_NAMES, backend_passes
from graphc.runtime import Engine, Request
import graphc.runtime.graph_loaders
from graphc.sampling import Sampling

from support import TEST_BUCKETS, model_yaml

pytestmark = pytest.mark.compiles

EXIT_BAD_INPUT = 2
PRESET = "lora-groups"
BUCKETS = ["prefill-8", "prefill-32", "decode-1", "decode-4"]
PASSES = [name for name, _ in backend_passes("export")]  # the passes the export backend runs
EOS_PROMPT = [8, 15]
"""Greedy generation from this prompt hits EOS (id 1) at its second token with the tiny model."""


def invoke(*args, env: dict | None = None) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr, result.exception)
    return result


def error_line(result: Result) -> str:
    """Assert a bad-input exit: status 2 and exactly one stderr line, `error: ...` (after `run`'s
    one line saying what it loads, if it got that far); return it."""
    assert result.exit_code == EXIT_BAD_INPUT, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def compile_error_line(result: Result) -> str:
    """A bad-input exit of `compile`: status 2 and one `error: ...` line, the last on stderr
    (`compile` echoes the resolved config first; see test_compile_errors_are_the_only_stderr_line)."""
    assert result.exit_code == EXIT_BAD_INPUT, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    return errors[0]


def records(result: Result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def ids(prompt: list[int]) -> str:
    return ",".join(map(str, prompt))


def prompt_of(length: int, mult: int = 7) -> list[int]:
    return [(mult * i + 3 * length) % 254 + 2 for i in range(length)]


def write_yaml(folder: Path, checkpoint: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(model_yaml(checkpoint, TEST_BUCKETS["standard"])))
    return path


def cli_compile(tmp_path_factory, tiny_checkpoints, name: str, *flags) -> tuple[Path, Path, Result]:
    root = tmp_path_factory.mktemp(name)
    out, dumps = root / "artifacts", root / "dumps"
    result = ok(invoke("compile", write_yaml(root, tiny_checkpoints[PRESET]), "-o", out,
                       "--dump-graphs", dumps, "--verify-passes", *flags))
    return out, dumps, result


@pytest.fixture(scope="module")
def cli_compiled(tmp_path_factory, tiny_checkpoints):
    """`graphc compile` of the standard buckets (the same programs as the session's, so cached)."""
    return cli_compile(tmp_path_factory, tiny_checkpoints, "cli-standard")


@pytest.fixture(scope="module")
def no_lowering(tmp_path_factory, tiny_checkpoints):
    """`graphc compile --disable-pass lower_trivial_collectives`: other programs, compiled here."""
    return cli_compile(tmp_path_factory, tiny_checkpoints, "cli-no-lowering",
                       "--disable-pass", "lower_trivial_collectives")


@pytest.fixture(scope="module")
def engine(cli_compiled) -> Engine:
    return Engine(cli_compiled[0])


@pytest.fixture
def artifacts(compiled) -> Path:
    """The session's standard export artifacts (read-only: copy before changing anything)."""
    return compiled(PRESET, "export")


@pytest.fixture
def graphs_never_run(monkeypatch):
    """Input validation must fail before any step runs: stand the graphs in with ones that refuse
    to run (this also skips loading them, which keeps these tests fast)."""
    def load(path, collectives, context):
        def call(*args, **kwargs):
            raise AssertionError(f"a graph ran although the input was invalid ({path.name})")
        return call

    monkeypatch.setattr(graphc.runtime.graph_loaders, "load_export", load)


def serve(engine: Engine, requests: list[Request]):
    return engine.generate(requests)


# --- compile, then run ------------------------------------------------------------------------------

def test_compile_reports_what_it_wrote(cli_compiled):
    out, _, result = cli_compiled
    # The last stdout line (a progress bar may precede it when the cache misses).
    assert result.stdout.splitlines()[-1] == f"wrote {out}: 4 graphs over 1 rank(s), 4 distinct, backend export"
    assert "context_limit=128" in result.stderr and "backend    export" in result.stderr
    assert (out / MANIFEST).is_file()


def test_run_json_equals_the_engine(cli_compiled, engine):
    out = cli_compiled[0]
    prompts = [[5], EOS_PROMPT, prompt_of(8), prompt_of(20), prompt_of(45)]  # 45 is chunked: 32 + 13
    args = [a for p in prompts for a in ("--prompt-ids", ids(p))]
    lines = records(ok(invoke("run", out, *args, "--max-new-tokens", 10, "--json")))
    expected = serve(engine, [Request(p, 10) for p in prompts])
    assert [r["prompt_ids"] for r in lines] == prompts
    assert [r["output_ids"] for r in lines] == [r.output_ids for r in expected]
    assert [r["finish_reason"] for r in lines] == [r.finish_reason for r in expected]
    assert lines[1]["finish_reason"] == "eos" and lines[1]["output_ids"][-1] == 1
    assert {r["finish_reason"] for r in lines[2:]} == {"length"}
    assert all(len(r["output_ids"]) == 10 for r in lines[2:])
    assert all("error" not in r for r in lines)
    # Each request's TTFT (from the start of serving) and time per output token after the first.
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in lines[2:])


def test_run_default_max_new_tokens_is_the_manifests(artifacts, engine):
    prompt = prompt_of(3)
    [line] = records(ok(invoke("run", artifacts, "--prompt-ids", ids(prompt), "--ignore-eos", "--json")))
    assert len(line["output_ids"]) == 16  # runtime.max_new_tokens in the test model.yaml
    assert line["output_ids"] == serve(engine, [Request(prompt, 16, stop_at_eos=False)])[0].output_ids


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, compiled):
    """One `run` with every way to give prompts: --prompt-ids, --prompt and a --prompts-file."""
    folder = tmp_path_factory.mktemp("prompts")
    prompts_file = folder / "prompts.jsonl"
    prompts_file.write_text("\n".join([
        json.dumps({"prompt_ids": [5, 6, 7], "max_new_tokens": 3}),
        "",  # blank lines are skipped
        json.dumps({"prompt": "abc", "max_new_tokens": 6, "temperature": 0.8, "seed": 11}),
        json.dumps({"prompt_ids": [9, 10], "temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 2}),
    ]) + "\n")
    result = ok(invoke("run", compiled(PRESET, "export"), "--prompt-ids", "3,4", "--prompt", TEXT,
                       "--prompts-file", prompts_file, "--max-new-tokens", 5, "--json"))
    return records(result)


TEXT = "héllo, wörld"


def test_run_text_prompt_is_tokenized_to_utf8_bytes(mixed_run, engine):
    line = mixed_run[1]
    assert line["prompt_ids"] == list(TEXT.encode("utf-8"))
    assert line["output_ids"] == serve(engine, [Request(line["prompt_ids"], 5)])[0].output_ids
    assert line["text"] == bytes(line["output_ids"]).decode("utf-8", errors="replace")


def test_run_prompts_file_with_per_line_overrides(mixed_run, engine):
    """Order: --prompt-ids, then --prompt, then the file's lines; a line's max_new_tokens and
    sampling fields override the command line's (--max-new-tokens 5, greedy)."""
    expected = [
        Request([3, 4], 5),
        Request(list(TEXT.encode()), 5),
        Request([5, 6, 7], 3),
        Request([97, 98, 99], 6, Sampling(temperature=0.8, seed=11)),
        Request([9, 10], 5, Sampling(temperature=1.0, top_k=5, top_p=0.9, seed=2)),
    ]
    assert [line["prompt_ids"] for line in mixed_run] == [r.prompt for r in expected]
    assert [line["output_ids"] for line in mixed_run] == [r.output_ids for r in serve(engine, expected)]
    for line, request in zip(mixed_run, expected):  # each ran to its own limit, or to EOS
        assert len(line["output_ids"]) == request.max_new_tokens or line["finish_reason"] == "eos", line
    assert [len(line["output_ids"]) for line in mixed_run[2:]] == [3, 6, 5]
    assert all("text" in line for line in mixed_run)  # the artifacts carry a tokenizer


def test_run_ignore_eos_generates_through_eos(artifacts, engine):
    stopped = serve(engine, [Request(EOS_PROMPT, 12)])[0]
    assert stopped.finish_reason == "eos" and len(stopped.output_ids) < 12
    result = ok(invoke("run", artifacts, "--prompt-ids", ids(EOS_PROMPT), "--max-new-tokens", 12, "--ignore-eos"))
    # Without --json: the tokens, a tab, then the decoded text's repr.
    [line] = result.stdout.splitlines()
    tokens, text = line.split("\t")
    tokens = [int(t) for t in tokens.split()]
    assert len(tokens) == 12 and tokens[: len(stopped.output_ids)] == stopped.output_ids
    assert tokens == serve(engine, [Request(EOS_PROMPT, 12, stop_at_eos=False)])[0].output_ids
    assert text == repr(bytes(tokens).decode("utf-8", errors="replace"))


def test_run_sampling_flags_are_deterministic_and_not_greedy(artifacts, engine):
    prompts = [[5], prompt_of(8), prompt_of(20)]
    args = [a for p in prompts for a in ("--prompt-ids", ids(p))]
    flags = ["--temperature", 0.8, "--seed", 3, "--max-new-tokens", 16, "--ignore-eos", "--json"]
    first = [r["output_ids"] for r in records(ok(invoke("run", artifacts, *args, *flags)))]
    second = [r["output_ids"] for r in records(ok(invoke("run", artifacts, *args, *flags)))]
    assert first == second
    assert all(len(tokens) == 16 for tokens in first)
    greedy = [r.output_ids for r in serve(engine, [Request(p, 16, stop_at_eos=False) for p in prompts])]
    assert any(s != g for s, g in zip(first, greedy)), "temperature 0.8 sampled exactly the greedy tokens"
    sampled = serve(engine, [Request(p, 16, Sampling(temperature=0.8, seed=3), stop_at_eos=False) for p in prompts])
    assert first == [r.output_ids for r in sampled]


def test_run_a_request_that_cannot_be_served_fails_alone(artifacts, engine):
    too_long = prompt_of(130)
    at_limit = prompt_of(128, mult=5)
    almost = prompt_of(127, mult=3)  # room for exactly one token under context_limit 128
    prompts = [[5], too_long, at_limit, almost, [6, 7]]
    args = [a for p in prompts for a in ("--prompt-ids", ids(p))]
    result = invoke("run", artifacts, *args, "--max-new-tokens", 4, "--ignore-eos", "--json")
    assert result.exit_code == EXIT_BAD_INPUT, (result.stdout, result.stderr, result.exception)
    lines = records(result)
    assert [line["prompt_ids"] for line in lines] == prompts
    for line, length in ((lines[1], 130), (lines[2], 128)):
        assert line["finish_reason"] == "error" and line["output_ids"] == [] and "text" not in line
        assert f"prompt of {length} tokens" in line["error"] and "context_limit 128" in line["error"], line
    served = serve(engine, [Request(p, 4, stop_at_eos=False) for p in (prompts[0], almost, prompts[4])])
    assert [lines[i]["output_ids"] for i in (0, 3, 4)] == [r.output_ids for r in served]
    assert [lines[i]["finish_reason"] for i in (0, 3, 4)] == ["length", "context_limit", "length"]
    assert len(lines[3]["output_ids"]) == 1
    assert all("error" not in lines[i] for i in (0, 3, 4))


# --- bad input: one `error:` line, exit 2 -----------------------------------------------------------

def test_run_missing_artifacts_dir(tmp_path):
    missing = tmp_path / "nowhere"
    line = error_line(invoke("run", missing, "--prompt-ids", "1,2"))
    assert str(missing) in line and MANIFEST in line


def test_run_tampered_artifacts(artifacts, tmp_path):
    copy = Path(shutil.copytree(artifacts, tmp_path / "copy"))
    graph = yaml.safe_load((copy / MANIFEST).read_text())["ranks"][0]["graphs"][-1]["file"]
    data = bytearray((copy / graph).read_bytes())
    data[len(data) // 3] ^= 0x01
    (copy / graph).write_bytes(bytes(data))
    line = error_line(invoke("run", copy, "--prompt-ids", "1,2"))
    assert graph in line and "sha256" in line and "recompile" in line


def test_run_text_prompt_without_tokenizer(artifacts, tmp_path, graphs_never_run):
    copy = Path(shutil.copytree(artifacts, tmp_path / "copy"))
    (copy / "tokenizer.json").unlink()
    manifest = yaml.safe_load((copy / MANIFEST).read_text())
    assert manifest.pop("tokenizer") == "tokenizer.json"
    manifest.pop("tokenizer_sha256")
    (copy / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    line = error_line(invoke("run", copy, "--prompt", "hello"))
    assert "tokenizer" in line and "--prompt-ids" in line


def served_and_refused(result: Result, engine: Engine, served: list[int], refused: int) -> list[str]:
    """A run where `refused` requests were refused and one served: exit status 2, the served
    prompt's tokens on stdout, one `error: ...` line per refused request (in request order) on
    stderr and nothing else; returns those lines."""
    expected = serve(engine, [Request(served, 16)])[0].output_ids
    printed = [line.split("\t")[0] for line in result.stdout.splitlines()]  # ids, then the decoded text
    assert printed == [" ".join(map(str, expected))], (result.stdout, result.stderr)
    assert result.exit_code == EXIT_BAD_INPUT, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("loading ")]
    assert len(lines) == refused and all(line.startswith("error: ") for line in lines), result.stderr
    return lines


OUTSIDE_THE_VOCABULARY = [("5,256", 256), ("300", 300), ("4,-1,7", -1)]


def test_run_tokens_outside_the_vocabulary_are_refused_alone(artifacts, engine):
    """One run (loading the graphs once): each bad prompt refused with its own line, the good one served."""
    prompts = [arg for prompt, _ in OUTSIDE_THE_VOCABULARY for arg in ("--prompt-ids", prompt)]
    lines = served_and_refused(invoke("run", artifacts, "--prompt-ids", "1,2", *prompts), engine, [1, 2],
                               len(OUTSIDE_THE_VOCABULARY))
    for i, (line, (_, bad)) in enumerate(zip(lines, OUTSIDE_THE_VOCABULARY), start=1):
        assert f"prompt {i}: token id {bad} is outside the vocabulary 0..255" in line


MALFORMED_LINES = [
    ("{not json", "not valid JSON"),
    ('["prompt_ids", [1]]', "expected an object"),
    ('{"max_new_tokens": 3}', "expected an object"),
    ('{"prompt_ids": [1], "temprature": 0.5}', "expected an object"),
    ('{"prompt_ids": [1], "prompt": "hi"}', "give 'prompt' or 'prompt_ids', not both"),
    ('{"prompt_ids": [1], "seed": 10000000000000}', "seed 10000000000000 must be an integer in 0..4294967295"),
    ('{"prompt_ids": [1], "top_k": 99999999999999999999999}', "top_k 99999999999999999999999 must be an integer"),
    ('{"prompt_ids": [1], "temperature": NaN}', "temperature nan must be a finite number"),
    ('{"prompt_ids": [999]}', "token id 999 is outside the vocabulary"),
    # refused by the scheduler, not the line's schema: named by file:line all the same
    ('{"prompt": "' + "x" * 200 + '"}', "prompt of 200 tokens leaves no room under context_limit 128"),
]


def test_run_malformed_prompts_file_lines_are_refused_alone(artifacts, engine, tmp_path):
    """One run over a file of one good line, a blank one and every malformed kind: each bad line
    refused with one line naming its line number, the good one served."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(['{"prompt_ids": [1, 2]}', "", *(bad for bad, _ in MALFORMED_LINES)]) + "\n")
    lines = served_and_refused(invoke("run", artifacts, "--prompts-file", prompts_file), engine, [1, 2],
                               len(MALFORMED_LINES))
    for number, (line, (bad, says)) in enumerate(zip(lines, MALFORMED_LINES), start=3):
        assert line.startswith(f"error: {prompts_file}:{number}:") and says in line, (bad, line)


def test_run_prompts_file_that_is_not_utf8_is_named(artifacts, tmp_path, graphs_never_run):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_bytes(b'{"prompt": "caf\xe9"}\n')
    line = error_line(invoke("run", artifacts, "--prompts-file", prompts_file))
    assert f"--prompts-file {prompts_file}: not UTF-8 text" in line


@pytest.mark.parametrize("option, value, says", [
    ("--seed", "10000000000000", "--seed 10000000000000 must be an integer in 0..4294967295"),
    ("--top-k", "99999999999999999999999", "--top-k 99999999999999999999999 must be an integer in 0..2147483647"),
    ("--temperature", "nan", "--temperature nan must be a finite number >= 0"),
    ("--top-p", "inf", "--top-p inf must be a number in (0, 1]"),
    ("--seed", "-1", "--seed -1 must be an integer in 0..4294967295"),
])
def test_run_sampling_options_out_of_range_fail_before_loading(artifacts, graphs_never_run, option, value, says):
    line = error_line(invoke("run", artifacts, "--prompt-ids", "1,2", option, value))
    assert line == f"error: {says}" or line.startswith(f"error: {says}"), line


@pytest.mark.parametrize("bad_line", [
    '{"prompt_ids": [1, 2], "max_new_tokens": "5"}',
    '{"prompt_ids": [1.5, 2]}',
    '{"prompt_ids": [1, 2], "max_new_tokens": 0}',
], ids=["max_new_tokens-string", "float-token-id", "max_new_tokens-zero"])
def test_run_prompts_file_values_of_the_wrong_type(artifacts, tmp_path, graphs_never_run, bad_line):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(bad_line + "\n")
    error_line(invoke("run", artifacts, "--prompts-file", prompts_file))


def test_serve_on_a_port_taken_fails_before_loading(artifacts, graphs_never_run):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = error_line(invoke("serve", artifacts, "--port", port))
    assert line == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; another process holds the "
                    "port: choose another --port (0: any free one)")


def test_serve_on_a_host_it_cannot_bind_fails_before_loading(artifacts, graphs_never_run):
    line = error_line(invoke("serve", artifacts, "--host", "192.0.2.1", "--port", 0))  # TEST-NET-1: no host's
    assert line == ("error: cannot listen on 192.0.2.1:0: Cannot assign requested address; --host must name an "
                    "address of this host (127.0.0.1, 0.0.0.0, ::1, ::, ...)")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_servers_connections_send_without_waiting_for_acks(host):
    """Nagle's algorithm off on every accepted connection, as asyncio (uvicorn's loop) accepts them:
    with it on, a response's body waits for the client's delayed ACK of its headers, 40 ms a
    request on a kept-alive connection."""
    import asyncio

    from graphc.server.launch import bound_listener

    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    listener = bound_listener(host, 0)

    async def accept_one() -> int:
        accepted = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(handle, sock=listener):
            _, writer = await asyncio.open_connection(host, listener.getsockname()[1])
            nodelay = await accepted
            writer.close()
            return nodelay

    assert asyncio.run(accept_one()) != 0


@pytest.mark.parametrize("how", ["option", "environment"])
def test_serve_refuses_an_api_key_no_bearer_token_can_carry(artifacts, graphs_never_run, how):
    args, env = (["--api-key", "two words"], None) if how == "option" else ([], {"GRAPHC_API_KEY": "two words"})
    line = error_line(invoke("serve", artifacts, *args, env=env))
    assert line == "error: --api-key / GRAPHC_API_KEY must be printable ASCII without spaces (a Bearer token)"


@pytest.mark.parametrize("case", ["no keys", "bad keys file"])
def test_serve_refuses_cache_isolation_it_cannot_keep_before_anything_loads(artifacts, graphs_never_run, tmp_path,
                                                                            case):
    keys = tmp_path / "keys"
    keys.write_text("one\ntwo words\n")
    args = ["--prefix-cache-isolation", "api-key"] + (["--api-keys-file", str(keys)] if case == "bad keys file" else [])
    line = error_line(invoke("serve", artifacts, *args))
    assert line == ("error: --prefix-cache-isolation api-key needs the server's keys: give --api-key or --api-keys-file"
                    if case == "no keys" else
                    f"error: --api-keys-file {keys}:2: a key must be printable ASCII without spaces (a Bearer token)")


def test_compile_unknown_pass(tiny_checkpoints, tmp_path):
    out = tmp_path / "artifacts"
    line = compile_error_line(invoke("compile", write_yaml(tmp_path, tiny_checkpoints[PRESET]), "-o", out,
                                     "--disable-pass", "no_such_pass"))
    assert "no_such_pass" in line and ", ".join(PASS_NAMES) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.yaml"]  # no output, no staging left


def test_compile_into_existing_dir_without_force(tiny_checkpoints, tmp_path):
    out = tmp_path / "artifacts"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    line = compile_error_line(invoke("compile", write_yaml(tmp_path, tiny_checkpoints[PRESET]), "-o", out))
    assert str(out) in line and "--force" in line
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifacts", "model.yaml"]


@pytest.mark.parametrize("case", ["unknown-pass", "existing-output"])
def test_compile_errors_are_the_only_stderr_line(tiny_checkpoints, tmp_path, case):
    out = tmp_path / "artifacts"
    flags = ["--disable-pass", "no_such_pass"] if case == "unknown-pass" else []
    if case == "existing-output":
        out.mkdir()
    error_line(invoke("compile", write_yaml(tmp_path, tiny_checkpoints[PRESET]), "-o", out, *flags))


# --- inspect, dumps, disabled passes ----------------------------------------------------------------

def inspect_lines(artifacts: Path) -> dict[str, str]:
    """`graphc inspect`'s graph lines by bucket label."""
    result = ok(invoke("inspect", artifacts))
    lines = {}
    for line in result.stdout.splitlines():
        words = line.split()
        if line.startswith("  ") and words and words[0] in BUCKETS:
            lines[words[0]] = line
    return lines


def test_inspect_lists_buckets_graph_files_and_graphc_ops(artifacts):
    manifest = yaml.safe_load((artifacts / MANIFEST).read_text())
    result = ok(invoke("inspect", artifacts))
    assert result.stdout.startswith(f"graphc {manifest['graphc_version']}, torch {manifest['torch_version']}, "
                                    f"backend export, format {FORMAT_VERSION}")
    assert manifest["ranks"][0]["weights"] in result.stdout
    lines = inspect_lines(artifacts)
    assert sorted(lines) == sorted(BUCKETS)
    for graph in manifest["ranks"][0]["graphs"]:
        label = f"{graph['kind']}-{graph['size']}"
        counts = manifest["extra"]["op_counts"][label]
        line = lines[label]
        assert graph["file"] in line, line
        assert f"MoE {graph['moe_form']}, exchange {graph['moe_exchange']};" in line, line
        assert f"{sum(counts.values())} ops" in line, line
        for op in ("graphc::kv_write", "graphc::sample"):
            assert f"{op} x{counts[op]}" in line, (op, line)
        # Inlined for the CPU backends; collectives of one-rank groups lowered away.
        for gone in ("paged_mla_attention", "moe_dispatch", "moe_combine"):
            assert gone not in line, line
    assert lines["prefill-8"].count("graphc::kv_write x3") == 1  # one per layer of the 3-layer model


def test_inspect_labels_prompt_as_decode_graphs_by_their_own_bucket(compiled):
    """decode-4x4 is its own graph: a label of kind and size alone showed it as decode-4."""
    artifacts = compiled("lora-groups", "export", "prompt_as_decode")
    manifest = yaml.safe_load((artifacts / MANIFEST).read_text())
    lines = {line.split()[0]: line for line in ok(invoke("inspect", artifacts)).stdout.splitlines()
             if line.startswith("  ")}
    files = {}
    for graph in manifest["ranks"][0]["graphs"]:
        rows = f"x{graph['tokens_per_row']}" if graph["tokens_per_row"] > 1 else ""
        files[f"{graph['kind']}-{graph['size']}{rows}"] = graph["file"]
    assert sorted(lines) == sorted(files) == sorted([*BUCKETS, "decode-1x4", "decode-4x4"])
    for label, file in files.items():
        counts = manifest["extra"]["op_counts"][label]
        assert file in lines[label] and f"{sum(counts.values())} ops" in lines[label], (label, lines[label])


def test_dump_graphs_writes_every_pass_for_every_bucket(cli_compiled):
    dumps = cli_compiled[1]
    assert sorted(p.name for p in dumps.iterdir()) == sorted(BUCKETS)
    names = ["00-capture.py"] + [f"{i:02d}-{name}.py" for i, name in enumerate(PASSES, start=1)]
    for bucket in BUCKETS:
        folder = dumps / bucket  # one program a bucket
        assert sorted(p.name for p in folder.iterdir()) == names
        assert "graphc.attention_combine" in (folder / "00-capture.py").read_text()
        assert "graphc.attention_combine" not in (folder / f"{PASSES.index('lower_trivial_collectives') + 1:02d}-lower_trivial_collectives.py").read_text()
        assert "graphc.kv_write" in (folder / f"{len(PASSES):02d}-dead_code_elimination.py").read_text()


def test_disabled_lowering_keeps_collectives_and_tokens(no_lowering, cli_compiled, engine):
    out, dumps, _ = no_lowering
    manifest = yaml.safe_load((out / MANIFEST).read_text())
    lines = inspect_lines(out)
    assert sorted(lines) == sorted(BUCKETS)
    for bucket in BUCKETS:
        counts = manifest["extra"]["op_counts"][bucket]
        assert counts["graphc::attention_combine"] == 3  # one per layer, over a context-parallel group of one
        assert "graphc::attention_combine x3" in lines[bucket]
        assert not (dumps / bucket / f"{PASSES.index('lower_trivial_collectives') + 1:02d}-lower_trivial_collectives.py").exists()
        assert (dumps / bucket / f"{len(PASSES):02d}-dead_code_elimination.py").is_file()
    standard = yaml.safe_load((cli_compiled[0] / MANIFEST).read_text())
    assert not {g["file"] for g in manifest["ranks"][0]["graphs"]} & {g["file"] for g in standard["ranks"][0]["graphs"]}
    prompts = [[5], prompt_of(20), prompt_of(40)]
    requests = [Request(p, 6, stop_at_eos=False) for p in prompts]
    assert [r.output_ids for r in Engine(out).generate(requests)] == [r.output_ids for r in serve(engine, requests)]
