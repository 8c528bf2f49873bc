"""graphc's Neuron runtime binding (runtime/neuron_runner.py) against a stand-in libnrt that enforces
the documented contract (standin_nrt/nrt_standin.c: nrt.h, the "Neuron Runtime configuration
guide", the "runtime developer guide") and records every call, one log a process; its NEFFs come
from a neuronx-cc stand-in (standin_nrt/neuronx_cc.py) that writes each program's tensor table
from its HLO, through `graphc neuron-finish`.

Recording mode (the default): the stand-in's nrt_execute fills the outputs with zeros, so those
tests show what graphc asks of the runtime (framework, cores, vnc, root of the collectives, tensor
names and sizes, frees): the tokens are all 0. Executing mode runs each NEFF's module on XLA:CPU
over the stand-in's buffers (standin_nrt/nrt_standin_executor.py): tokens equal to graphc's own
XLA:CPU runner's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphc.cli import cli
from graphc.errors import GraphcError
from graphc.runtime import Engine, Request
from graphc.runtime.neuron_runner import EFA_ENVIRONMENT, runtime_environment
from servers import Server

pytestmark = [pytest.mark.compiles]

STANDIN = Path(__file__).parent / "standin_nrt"
PRESET = "lora-groups"
GRAPHC = Path(sys.executable).parent / "graphc"


@pytest.fixture(scope="session")
def standin_libnrt(tmp_path_factory) -> Path:
    """A folder holding the stand-in built as libnrt.so.1 with the system C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc) on this host to build the stand-in libnrt")
    folder = tmp_path_factory.mktemp("standin-libnrt")
    python_headers = sysconfig.get_paths()["include"]  # the executing mode calls into the rank's Python
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{python_headers}", "-o",
                    str(folder / "libnrt.so.1"), str(STANDIN / "nrt_standin.c")], check=True, capture_output=True,
                   text=True)
    return folder


@pytest.fixture(scope="session")
def finished(compiled, tmp_path_factory):
    """finished(cp=1, ep=1, buckets="small", preset=PRESET, speculative=0, broken=None, dp=1, tp=1,
    prompt_logprobs=False): tiny neuron artifacts through `graphc neuron-finish` with the neuronx-cc
    stand-in (`broken`: the NEFF tensor it writes at a wrong size), once per session."""
    folder = tmp_path_factory.mktemp("standin-neuronx-cc")
    (folder / "neuronx-cc").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN / "neuronx_cc.py"}" "$@"\n')
    (folder / "neuronx-cc").chmod(0o755)
    made: dict[tuple, Path] = {}

    def get(cp: int = 1, ep: int = 1, buckets: str = "small", preset: str = PRESET, speculative: int = 0,
            broken: str | None = None, dp: int = 1, tp: int = 1, prompt_logprobs: bool = False) -> Path:
        key = (cp, ep, buckets, preset, speculative, broken, dp, tp, prompt_logprobs)
        if key not in made:
            artifacts = compiled(preset, "neuron", buckets, cp, ep, dp=dp, tp=tp, speculative=speculative,
                                 prompt_logprobs=prompt_logprobs)
            out = tmp_path_factory.mktemp("finished") / "artifacts"
            env = {"PATH": f"{folder}:{os.environ['PATH']}", "GRAPHC_STANDIN_NEURONX_CC_BREAK": broken}
            result = CliRunner().invoke(cli, ["neuron-finish", str(artifacts), "-o", str(out), "--target", "trn2"],
                                        env=env)
            assert result.exit_code == 0, result.output
            made[key] = out
        return made[key]

    return get


PROMPTS = ([3, 1, 4, 1, 5], [2, 7, 1, 8])
SAMPLED = ("--temperature", "0.9", "--seed", "11")


def _run(artifacts: Path, libnrt: Path | None, device: Path, env: dict | None = None, timeout: float = 180,
         sampling: tuple[str, ...] = ()):
    """`graphc run` on the Neuron device path over the stand-in (`libnrt` None: on graphc's XLA:CPU
    runner instead); (process, each process's log)."""
    device.mkdir(exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}  # a job given no runtime settings
    environment = {**inherited, **({"GRAPHC_NEURON_DEVICE": "1", "LD_LIBRARY_PATH": str(libnrt)} if libnrt else {}),
                   "GRAPHC_STANDIN_NRT_DIR": str(device), "PYTHONPATH": str(STANDIN), **(env or {})}
    command = [str(GRAPHC), "run", str(artifacts), *(f"--prompt-ids={','.join(map(str, p))}" for p in PROMPTS),
               "--max-new-tokens", "4", "--ignore-eos", "--json", *sampling]
    # Its own process group: a job that hangs is killed whole, ranks included, not left behind.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"graphc run did not end in {timeout} s")
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    return done, [_calls(log) for log in sorted(device.glob("calls-*.log"))]


def _calls(log: Path) -> list[tuple[str, dict[str, str]]]:
    """A process's log: (call, its key=value fields), in order."""
    calls = []
    for line in log.read_text().splitlines():
        name, *fields = line.split()
        calls.append((name, dict(field.split("=", 1) for field in fields if "=" in field)))
    return calls


def _fields(calls, name: str) -> list[dict[str, str]]:
    return [fields for call, fields in calls if call == name]


def _assert_kept_the_contract(calls, world: int) -> None:
    """One process's log: framework NO_FW, one visible core at vnc 0, the collectives' root named
    with several ranks, nothing leaked, nrt_close last."""
    (init,) = _fields(calls, "nrt_init")
    assert init["framework"] == "1"
    assert init["visible_cores"].isdigit()  # one core
    assert (init["root_comm_id"] != "-") == (world > 1)
    loads = _fields(calls, "nrt_load_collectives")
    assert loads and all(load["vnc"] == "0" and load["vnc_count"] == "1" and load["world"] == str(world)
                         for load in loads)
    assert not [call for call, _ in calls if call == "error:"], calls
    assert _fields(calls, "nrt_execute")
    assert len(_fields(calls, "nrt_unload")) == len(loads)
    assert calls[-1] == ("nrt_close", {"leaked_tensors": "0", "leaked_models": "0", "leaked_tensor_sets": "0",
                                       "leaked_tensor_infos": "0"})


def _assert_one_rank_kept_the_contract(logs) -> None:
    """The contract, and its core only with the user's NEURON_RT_EXEC_TIMEOUT=77 untouched and no EFA."""
    (calls,) = logs
    _assert_kept_the_contract(calls, world=1)
    init = _fields(calls, "nrt_init")[0]
    assert init["visible_cores"] == "0" and init["exec_timeout"] == "77"  # the user's timeout, untouched
    assert init["fi_provider"] == "-"  # one host: no EFA


def _assert_two_ranks_kept_the_contract(logs) -> None:
    """The contract in both processes: cores 0 and 1, each its vnc 0, the same root named, ranks 0 and 1."""
    assert len(logs) == 2
    for calls in logs:
        _assert_kept_the_contract(calls, world=2)
    inits = [_fields(calls, "nrt_init")[0] for calls in logs]
    assert sorted(init["visible_cores"] for init in inits) == ["0", "1"]
    assert len({init["root_comm_id"] for init in inits}) == 1  # every rank names the same root
    assert sorted(_fields(calls, "nrt_load_collectives")[0]["rank"] for calls in logs) == ["0", "1"]


def _tokens(done) -> list[list[int]]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["output_ids"] for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def xla_cpu_tokens(tmp_path_factory):
    """xla_cpu_tokens(artifacts, sampling=()) -> the tokens graphc's XLA:CPU runner gives for PROMPTS:
    the device path's references, run once a module for each artifacts and sampling."""
    made: dict[tuple, list[list[int]]] = {}

    def get(artifacts: Path, sampling: tuple[str, ...] = ()) -> list[list[int]]:
        if (artifacts, sampling) not in made:
            done, _ = _run(artifacts, None, tmp_path_factory.mktemp("xla-cpu"), sampling=sampling)
            made[artifacts, sampling] = _tokens(done)
        return made[artifacts, sampling]

    return get


def test_one_rank_keeps_the_runtime_contract(finished, standin_libnrt, tmp_path):
    """Framework NO_FW; its core only, as vnc 0; every NEFF tensor bound by its name (the stand-in
    lists outputs last to first and names the pool's input `input<N>.must_alias_input`) at its
    size; everything freed and nrt_close at exit. Zeros come out (recording mode)."""
    done, logs = _run(finished(), standin_libnrt, tmp_path / "device", {"NEURON_RT_EXEC_TIMEOUT": "77"})
    assert _tokens(done) == [[0, 0, 0, 0]] * 2
    _assert_one_rank_kept_the_contract(logs)


@pytest.mark.multirank
def test_two_ranks_under_the_launcher_each_take_one_core_as_vnc_0_with_the_root_named(finished, standin_libnrt,
                                                                                       tmp_path):
    """Without NEURON_RT_VISIBLE_CORES rank 0 would reserve every core and rank 1's nrt_init fail;
    with the local rank as vnc rank 1's load would fail; without NEURON_RT_ROOT_COMM_ID the
    collective programs would not load."""
    done, logs = _run(finished(cp=2, ep=2), standin_libnrt, tmp_path / "device")
    assert _tokens(done) == [[0, 0, 0, 0]] * 2
    _assert_two_ranks_kept_the_contract(logs)
    assert all(_fields(calls, "loaded")[0]["collectives"] == "1" for calls in logs)


EXECUTING = {"GRAPHC_STANDIN_NRT_EXECUTE": "1"}


@pytest.mark.parametrize("sampling", [(), SAMPLED], ids=["greedy", "sampled"])
def test_executing_the_neffs_gives_the_xla_cpu_runners_tokens(finished, standin_libnrt, xla_cpu_tokens, tmp_path,
                                                              sampling):
    """Executing mode: each nrt_execute runs the NEFF's module on XLA:CPU over the stand-in's own
    buffers, so the tokens come from what graphc wrote into the runtime's tensors and read back
    (weights and pool at load, each step's inputs and noise), through the NEFF's tensor table."""
    artifacts = finished()
    done, logs = _run(artifacts, standin_libnrt, tmp_path / "device", {**EXECUTING, "NEURON_RT_EXEC_TIMEOUT": "77"},
                      sampling=sampling)
    assert _tokens(done) == xla_cpu_tokens(artifacts, sampling)
    assert any(token != 0 for tokens in _tokens(done) for token in tokens)
    _assert_one_rank_kept_the_contract(logs)


@pytest.mark.multirank
def test_executing_two_ranks_with_collectives_gives_the_xla_cpu_runners_tokens(finished, standin_libnrt, xla_cpu_tokens,
                                                                                 tmp_path):
    """Also the two-rank contract, as the recording test checks it (one core a rank as vnc 0, the
    same root named in both)."""
    artifacts = finished(cp=2, ep=2)
    done, logs = _run(artifacts, standin_libnrt, tmp_path / "device", EXECUTING, sampling=SAMPLED)
    assert _tokens(done) == xla_cpu_tokens(artifacts, SAMPLED)
    _assert_two_ranks_kept_the_contract(logs)


@pytest.mark.slow  # a compile and two runs each; cp 2 x ep 2 is per commit
@pytest.mark.multirank
@pytest.mark.parametrize("layout", [dict(dp=2, ep=2, buckets="dp"), dict(tp=2, ep=2),
                                    dict(preset="trained", speculative=1)], ids=["dp2xep2", "tp2xep2", "mtp"])
def test_executing_other_layouts_and_drafts_gives_the_xla_cpu_runners_tokens(finished, standin_libnrt, xla_cpu_tokens,
                                                                             tmp_path, layout):
    artifacts = finished(**layout)
    for sampling in ((), SAMPLED):
        done, logs = _run(artifacts, standin_libnrt, tmp_path / f"device{len(sampling)}", EXECUTING, sampling=sampling)
        assert _tokens(done) == xla_cpu_tokens(artifacts, sampling)
        for calls in logs:
            _assert_kept_the_contract(calls, world=len(logs))


@pytest.mark.slow  # a compile and a server; the score programs run per commit on XLA:CPU (test_prompt_logprobs.py)
def test_the_device_path_gives_the_xla_cpu_runners_prompt_logprobs(finished, standin_libnrt, tmp_path):
    """A score program's five results (the pool, tokens, logits, then the prompt scores) bound by
    their NEFF names and read back: an echoed prompt's logprobs through the stand-in equal the
    XLA:CPU runner's."""
    artifacts = finished(buckets="scores", preset="trained", prompt_logprobs=True)
    prompt = [(11 * i) % 200 + 30 for i in range(37)]  # three chunks of the score program
    [reference] = Engine(artifacts).generate([Request(prompt, 0, prompt_logprobs=2)])
    (tmp_path / "device").mkdir()
    server = Server(artifacts, env={**EXECUTING, "GRAPHC_NEURON_DEVICE": "1", "LD_LIBRARY_PATH": str(standin_libnrt),
                                    "GRAPHC_STANDIN_NRT_DIR": str(tmp_path / "device"), "PYTHONPATH": str(STANDIN)})
    try:
        served = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    finally:
        assert server.stop() == 0, "".join(server.lines)
    logprobs = served.choices[0].logprobs.token_logprobs
    assert logprobs[0] is None
    assert logprobs[1:] == pytest.approx([entry.logprob for entry in reference.prompt_logprobs[1:]], abs=1e-6)
    (calls,) = [_calls(log) for log in (tmp_path / "device").glob("calls-*.log")]
    _assert_kept_the_contract(calls, world=1)


@pytest.mark.multirank
def test_graphc_serve_on_the_device_path_gives_graphc_runs_tokens_to_the_openai_client(finished, standin_libnrt,
                                                                                        xla_cpu_tokens, tmp_path):
    """Over two ranks; stopped, each rank frees what it loaded and closes the runtime (the leader's
    ranks end with os._exit, which skips the exit handlers unless the launcher runs them)."""
    artifacts = finished(cp=2, ep=2)
    (tmp_path / "device").mkdir()
    server = Server(artifacts, env={**EXECUTING, "GRAPHC_NEURON_DEVICE": "1", "LD_LIBRARY_PATH": str(standin_libnrt),
                                    "GRAPHC_STANDIN_NRT_DIR": str(tmp_path / "device"), "PYTHONPATH": str(STANDIN)})
    try:
        served = [server.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.9, seed=11,
                                                   extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"]
                  for prompt in PROMPTS]
    finally:
        assert server.stop() == 0, "".join(server.lines)
    assert served == xla_cpu_tokens(artifacts, SAMPLED)
    _assert_two_ranks_kept_the_contract([_calls(log) for log in sorted((tmp_path / "device").glob("calls-*.log"))])


@pytest.mark.multirank
def test_a_runtime_error_status_reaches_the_user_in_one_line_naming_rank_call_and_status(finished, standin_libnrt,
                                                                                         tmp_path):
    done, _ = _run(finished(cp=2, ep=2), standin_libnrt, tmp_path / "device",
                   {"GRAPHC_STANDIN_NRT_FAIL": "nrt_load_collectives:1:4"})
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1: nrt_load_collectives returned 4 (NRT_RESOURCE)" in errors[0], done.stderr
    assert "the other ranks were stopped" in errors[0]


@pytest.mark.multirank
def test_a_rank_stuck_loading_names_itself_and_the_job_stops(finished, standin_libnrt, tmp_path):
    done, _ = _run(finished(cp=2, ep=2), standin_libnrt, tmp_path / "device",
                   {"GRAPHC_STANDIN_NRT_HANG": "1", "GRAPHC_NEURON_LOAD_TIMEOUT": "3"}, timeout=90)
    assert done.returncode == 2
    stuck = [line for line in done.stderr.splitlines() if "has not returned in 3 s" in line]
    assert len(stuck) == 1 and stuck[0].startswith("rank 1: nrt_load_collectives of "), done.stderr
    assert "error: rank 1 failed with exit code 1" in done.stderr


@pytest.mark.slow  # its own MTP compile (~40 s); the plain step's binding is per commit
def test_a_speculative_program_returns_its_verdict_at_its_shape(finished, standin_libnrt, tmp_path):
    """An MTP step's tokens output is [rows, 2 + 2k] (the verdict), not the plain step's [rows]."""
    done, logs = _run(finished(preset="trained", speculative=1), standin_libnrt, tmp_path / "device")
    assert len(_tokens(done)[0]) == 4
    _assert_kept_the_contract(logs[0], world=1)


def test_a_neff_whose_tensors_do_not_match_the_program_is_refused_in_one_line(finished, standin_libnrt, tmp_path):
    done, _ = _run(finished(broken="output1"), standin_libnrt, tmp_path / "device")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 2 and done.stderr.startswith("loading "), done.stderr  # the echo, then one line
    assert "the NEFF's output 'output1' (tokens) holds 8 bytes; the program's holds 4" in done.stderr


def test_the_runtime_environment_of_a_rank():
    # One core a process: the local rank's, or its entry of the cores the job was given.
    assert runtime_environment({"GRAPHC_LOCAL_DEVICE": "1"}, 1, None) == {"NEURON_RT_VISIBLE_CORES": "1"}
    assert runtime_environment({"GRAPHC_LOCAL_DEVICE": "1", "NEURON_RT_VISIBLE_CORES": "4-7"}, 2, 9)[
        "NEURON_RT_VISIBLE_CORES"] == "5"
    assert runtime_environment({"NEURON_RT_VISIBLE_CORES": "3,6"}, 1, None)["NEURON_RT_VISIBLE_CORES"] == "3"
    # Several ranks: rank 0's host and port for the collectives' root, unless the user named one.
    assert runtime_environment({"MASTER_ADDR": "10.0.0.5"}, 2, 29501)["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.5:29501"
    assert "NEURON_RT_ROOT_COMM_ID" not in runtime_environment({"NEURON_RT_ROOT_COMM_ID": "h:1"}, 2, 29501)
    # EFA only when the job spans hosts, the user's values kept; NEURON_RT_EXEC_TIMEOUT never touched.
    one_host = runtime_environment({"GROUP_WORLD_SIZE": "1", "NEURON_RT_EXEC_TIMEOUT": "5"}, 2, 1)
    assert not set(EFA_ENVIRONMENT) & set(one_host) and "NEURON_RT_EXEC_TIMEOUT" not in one_host
    hosts = runtime_environment({"GROUP_WORLD_SIZE": "2", "FI_EFA_FORK_SAFE": "0"}, 4, 1)
    assert hosts["FI_PROVIDER"] == "efa" and hosts["FI_EFA_USE_DEVICE_RDMA"] == "1" and "FI_EFA_FORK_SAFE" not in hosts
    # The logical core size the NEFFs were compiled at (the manifest's), which the runtime's must equal.
    assert runtime_environment({}, 1, None, 2)["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert runtime_environment({"NEURON_LOGICAL_NC_CONFIG": "2"}, 1, None, 2)["NEURON_LOGICAL_NC_CONFIG"] == "2"
    with pytest.raises(GraphcError, match=r"^NEURON_LOGICAL_NC_CONFIG='1': the NEFFs were compiled at --lnc 2, and the "
                                          r"runtime must run them at that logical core size; unset it, or run "
                                          r"`graphc neuron-finish --lnc 1`$"):
        runtime_environment({"NEURON_LOGICAL_NC_CONFIG": "1"}, 1, None, 2)
