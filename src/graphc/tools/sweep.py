"""`graphc sweep`: every bucket at every topology, tokens checked against one rank and against
transformers — the bucket-sweep CI job.

For each backend, topologies run small to large world sizes (1x1 first: it is the reference).
Each stage compiles once (through the compile cache) and serves every case in one job. Cases
are chosen from the bucket table so that every bucket runs: each prefill bucket hit exactly and
between sizes, a chunked prompt, a prompt-as-decode tail, every [B, P] graph (short prompts
joining a running decode), and every decode batch size filled and padded. Greedy fp32 tokens must equal the 1x1 stage's, and
the external reference's per prompt: transformers' (the checkpoint's own architecture:
`DeepseekV3ForCausalLM`, `DeepseekV32ForCausalLM` or `DeepseekV4ForCausalLM`, when installed), or
for DeepSeek-V4.1, which transformers lacks, graphc's eager reference; when the model is fp32 at
reference numerics.

Reports: JUnit XML (a test suite per backend and topology, a test case per case, failures naming
the buckets the case ran in), a Markdown table (bucket x topology: tokens matched, padding, step
latency) and JSON. Before each stage the sweep checks that the cores the stage needs are free and
says so when they are not, instead of printing misleading latencies.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from graphc.buckets.selection import max_prefill_chunk
from graphc.config import GraphcConfig
from graphc.errors import GraphcError
from graphc.runtime.hosts import HostOptions
from graphc.topology import Topology


@dataclass(frozen=True)
class Case:
    """Prompts served together as one batch, chosen to run certain buckets."""

    name: str
    prompts: list[list[int]]
    new_tokens: int


@dataclass
class CaseResult:
    case: str
    outputs: list[list[int]]
    buckets: dict[str, dict]
    """Bucket name -> steps, tokens, padding, seconds (the leader's)."""
    failures: list[str] = field(default_factory=list)


@dataclass
class Stage:
    backend: str
    topology: str
    cases: list[CaseResult]
    cores_note: str | None
    unexercised: list[str] = field(default_factory=list)
    """Compiled buckets no case ran (the runtime cannot reach them with this config)."""


def parse_topologies(text: str) -> list[Topology]:
    """"1x1,2x2,2x1x2,1x1x2x2" -> the stages' topologies (CPxEP, DPxCPxEP for data-parallel
    replicas, DPxCPxTPxEP with tensor parallelism), sorted by world size, 1x1 first."""
    out = []
    for item in text.split(","):
        try:
            sizes = [int(v) for v in item.strip().lower().split("x")]
            if len(sizes) not in (2, 3, 4):
                raise ValueError
        except ValueError:
            raise GraphcError(f"--topologies: {item.strip()!r} is not CPxEP, DPxCPxEP or DPxCPxTPxEP "
                              "(e.g. 2x2, 2x1x2, 1x1x2x2)") from None
        dp, cp, tp, ep = {2: lambda: (1, sizes[0], 1, sizes[1]), 3: lambda: (*sizes[:2], 1, sizes[2]),
                          4: lambda: tuple(sizes)}[len(sizes)]()
        try:
            out.append(Topology(cp, ep, dp, tp))
        except GraphcError as e:
            raise GraphcError(f"--topologies: {item.strip()!r}: {e}") from None
    return sorted(set(out) | {Topology()}, key=lambda t: (t.world, t.dp, t.cp, t.tp, t.ep))


def stage_name(topology: Topology) -> str:
    """CPxEP, DPxCPxEP with data-parallel replicas, DPxCPxTPxEP with tensor parallelism."""
    if topology.tp > 1:
        return f"{topology.dp}x{topology.cp}x{topology.tp}x{topology.ep}"
    return f"{topology.cp}x{topology.ep}" if topology.dp == 1 else f"{topology.dp}x{topology.cp}x{topology.ep}"


def _prompt(length: int, salt: int, vocab: int) -> list[int]:
    return [(7 * i + 13 * salt + length) % (vocab - 3) + 3 for i in range(length)]


def sweep_cases(config: GraphcConfig, vocab: int, new_tokens: int) -> list[Case]:
    """Cases that together run every bucket of the config (see the module docstring)."""
    b = config.buckets
    p = b.prompt_as_decode
    chunk = max_prefill_chunk(b.prefill, config.runtime.max_num_prefilling_tokens)
    room = b.context_limit - 1

    def case(name: str, lengths: list[int]) -> Case:
        lengths = [min(n, room - 1) for n in lengths]
        tokens = max(1, min(new_tokens, room - max(lengths)))
        return Case(name, [_prompt(n, i, vocab) for i, n in enumerate(lengths)], tokens)

    cases, previous = [], 0
    for size in b.prefill:
        if size > p:  # prompts of at most P tokens never use a prefill bucket
            cases.append(case(f"prefill-{size} exact", [size]))
            between = max(previous, p) + 1
            if between < size:
                cases.append(case(f"prefill-{size} between", [between]))
        previous = size
    cases.append(case(f"chunked ({chunk} + {max(p + 1, 1)})", [chunk + max(p + 1, 1)]))
    if p >= 1:
        cases.append(case(f"chunked with a prompt-as-decode tail ({chunk} + {p})", [chunk + p]))
    if p > 1:  # every [B, P] graph: B - 1 short prompts join one running decode (B = 1: alone)
        for batch in b.decode:
            shorts = [p if i % 2 == 0 else 1 for i in range(max(1, batch - 1))]
            if batch == 1:
                cases.append(case(f"decode-1x{p}: a short prompt alone", shorts))
            else:
                cases.append(case(f"decode-{batch}x{p}: {batch - 1} short prompt(s) with a running decode",
                                  [chunk, *shorts]))
    previous = 0
    for batch in b.decode:
        short = p + 1  # long enough to prefill: the decode steps then run b sequences together
        cases.append(case(f"decode-{batch} full", [short + i for i in range(batch)]))
        if previous + 1 < batch:
            cases.append(case(f"decode-{batch} padded", [short + i for i in range(previous + 1)]))
        previous = batch
    return cases


def busy_cores_note(world: int) -> str | None:
    """A warning when the stage's `world` ranks will not each find a free core."""
    import psutil

    loads = psutil.cpu_percent(interval=0.5, percpu=True)
    busy = sum(load > 50 for load in loads)
    if world > len(loads):
        return f"{world} ranks on {len(loads)} cores: step latencies are oversubscribed, not representative"
    if len(loads) - busy < world:
        return (f"{busy} of {len(loads)} cores are busy (>50%) and this stage needs {world}: "
                "step latencies will mislead")
    return None


def run_stage(artifacts: Path, cases: list[Case], hosts: HostOptions = HostOptions()) -> list[CaseResult] | None:
    """The stage's cases served in one job (over `hosts`); None on any host but the leader's."""
    from graphc.runtime import Request
    from graphc.runtime.launch import serve
    from graphc.sampling import Sampling

    batches = [[Request(p, c.new_tokens, Sampling(), stop_at_eos=False) for p in c.prompts] for c in cases]
    outcomes = serve(artifacts, batches, hosts=hosts)
    if outcomes is None:
        return None
    results = []
    for case, outcome in zip(cases, outcomes):
        errors = [r.error for r in outcome.results if r.error]
        result = CaseResult(case.name, [r.output_ids for r in outcome.results],
                            {name: dataclasses.asdict(s) for name, s in sorted(outcome.stats.items())})
        result.failures += [f"request failed: {e}" for e in errors]
        results.append(result)
    return results


def compare(results: list[CaseResult], reference: list[list[list[int]]], what: str) -> None:
    """Record on each case where its tokens differ from `reference` (per case, per prompt)."""
    for result, expected in zip(results, reference):
        for i, (got, want) in enumerate(zip(result.outputs, expected)):
            if got != want:
                first = next((k for k, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
                result.failures.append(f"prompt {i}: tokens differ from {what} at token {first} "
                                       f"(got {got[first:first + 4]}, expected {want[first:first + 4]})")


def external_reference(config: GraphcConfig, cases: list[Case]) -> tuple[str, list[list[list[int]]] | None]:
    """The external reference's name and greedy tokens per prompt (None where there is none)."""
    if config.model.dtype != "float32":
        return "none (not fp32)", None  # bf16 is judged against a noise floor (`graphc compare`), not token for token
    if config.model.sparse_probabilities == "bf16":
        return "none (bf16 P)", None  # FlashMLA's rounded P is not the reference's numerics
    if config.family.reference.model is not None:
        return config.family.reference.name, graphc_reference(config, cases)
    tokens = transformers_reference(config, cases)
    return ("transformers", tokens) if tokens is not None else ("none (transformers not installed)", None)


def graphc_reference(config: GraphcConfig, cases: list[Case]) -> list[list[list[int]]]:
    """The family's eager graphc reference's greedy tokens per prompt (whole sequences, no cache)."""
    import torch

    from graphc.weights.checkpoint import load_reference

    model = load_reference(config.model.checkpoint)
    out = []
    with torch.no_grad():
        for case in cases:
            rows = []
            for prompt in case.prompts:
                sequence = list(prompt)
                for _ in range(case.new_tokens):
                    sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
                rows.append(sequence[len(prompt):])
            out.append(rows)
    return out


def transformers_reference(config: GraphcConfig, cases: list[Case]) -> list[list[list[int]]] | None:
    """transformers' greedy tokens per prompt, or None when it is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return None
    transformers_logging.set_verbosity_error()  # its load report lists the MTP layer we skip on purpose
    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(config.model.checkpoint, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for case in cases:
            rows = []
            for prompt in case.prompts:
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=case.new_tokens, min_new_tokens=0,
                                     do_sample=False)
                rows.append(ids[0, len(prompt):].tolist())
            out.append(rows)
    return out


def stage_hosts(hosts: HostOptions, topology: Topology, index: int) -> HostOptions | None:
    """The hosts stage `index` runs over: all of them where its ranks divide among them (its
    rendezvous on `--master-port` + index, as each stage's store is its own), else host 0 alone
    (None on the others: they sit it out)."""
    if hosts.nnodes == 1:
        return hosts
    if topology.world % hosts.nnodes == 0:
        return dataclasses.replace(hosts, master_port=hosts.master_port + index, nproc_per_node=None)
    return HostOptions() if hosts.node_rank == 0 else None


def sweep(config: GraphcConfig, workdir: Path, topologies: list[Topology], backends: list[str],
          new_tokens: int = 8, log: Callable[[str], None] = print, check_cores: bool = True,
          hosts: HostOptions = HostOptions()) -> list[Stage]:
    """Compile and run every stage; returns them with their failures recorded. Over several
    hosts every host runs the same sweep (each compiling every stage it takes part in) and only
    host 0 checks and reports: the others return no stages."""
    from graphc.config import validate
    from graphc.compiler.pipeline import CompileOptions, compile

    staged = {}
    for topology in topologies:  # every stage's topology checked before any work
        staged[topology] = dataclasses.replace(config, topology=dataclasses.replace(
            config.topology, dp=topology.dp, cp=topology.cp, tp=topology.tp, ep=topology.ep))
        validate(staged[topology])
    cases = sweep_cases(config, config.model_args.vocab_size, new_tokens)
    log(f"{len(cases)} cases: " + "; ".join(c.name for c in cases))
    external_name, external = external_reference(config, cases) if hosts.node_rank == 0 else ("host 0's", None)
    log(f"external reference: {external_name}")
    stages, index = [], itertools.count()
    for backend in backends:
        reference = None
        for topology in topologies:
            name = stage_name(topology)
            over = stage_hosts(hosts, topology, next(index))
            if over is None:
                log(f"[{backend} {name}] on host 0 alone ({topology.world} rank(s) do not divide among "
                    f"{hosts.nnodes} hosts)")
                continue
            note = busy_cores_note(over.layout(topology.world).ranks_per_host) if check_cores else None
            if note:
                log(f"[{backend} {name}] note: {note}")
            out = workdir / f"{backend}-{name}"
            log(f"[{backend} {name}] compiling into {out}")
            compile(staged[topology], out, CompileOptions(backend=backend, force=True, show_progress=False))
            spread = f" over {over.nnodes} hosts" if over.nnodes > 1 else ""
            log(f"[{backend} {name}] serving {len(cases)} cases on {topology.world} rank(s){spread}")
            results = run_stage(out, cases, over)
            if results is None:
                continue  # another host's part of the stage: host 0 checks it
            if reference is None:
                reference = [r.outputs for r in results]  # 1x1 comes first
            else:
                compare(results, reference, f"{backend} 1x1")
            if external is not None:
                compare(results, external, external_name)
            failed = sum(bool(r.failures) for r in results)
            log(f"[{backend} {name}] {len(results) - failed}/{len(results)} cases matched")
            ran = {bucket for r in results for bucket in r.buckets}
            unexercised = [b.name for b in config.compiled_buckets if b.name not in ran]
            if unexercised:
                log(f"[{backend} {name}] note: no case ran {', '.join(unexercised)}")
            stages.append(Stage(backend, name, results, note, unexercised))
    return stages


# --- reports --------------------------------------------------------------------------------------


def junit_xml(stages: list[Stage]) -> str:
    suites = ET.Element("testsuites", name="graphc sweep")
    for stage in stages:
        failures = sum(bool(r.failures) for r in stage.cases)
        suite = ET.SubElement(suites, "testsuite", name=f"{stage.backend} {stage.topology}",
                              tests=str(len(stage.cases)), failures=str(failures))
        for result in stage.cases:
            seconds = sum(s["seconds"] for s in result.buckets.values())
            testcase = ET.SubElement(suite, "testcase", classname=f"sweep.{stage.backend}.{stage.topology}",
                                     name=result.case, time=f"{seconds:.3f}")
            if result.failures:
                buckets = ", ".join(result.buckets)
                failure = ET.SubElement(testcase, "failure", message=f"buckets {buckets}: {result.failures[0]}")
                failure.text = "\n".join(result.failures)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def bucket_table(stages: list[Stage]) -> dict[str, dict[str, dict]]:
    """bucket -> "backend topology" -> matched, failed cases, steps, padding share, ms per step."""
    table: dict[str, dict[str, dict]] = {}
    for stage in stages:
        column = f"{stage.backend} {stage.topology}"
        for result in stage.cases:
            for bucket, stats in result.buckets.items():
                cell = table.setdefault(bucket, {}).setdefault(
                    column, {"matched": True, "failed_cases": [], "steps": 0, "tokens": 0, "padding": 0, "seconds": 0.0})
                if result.failures:
                    cell["matched"] = False
                    cell["failed_cases"].append(result.case)
                for key in ("steps", "tokens", "padding", "seconds"):
                    cell[key] += stats[key]
    return table


def markdown(stages: list[Stage]) -> str:
    table = bucket_table(stages)
    columns = [f"{s.backend} {s.topology}" for s in stages]
    lines = ["# graphc sweep", "", "Each cell: tokens matched (✓) or not (✗, with the failing cases), padded share "
             "of the bucket's tokens, mean step latency.", "",
             "| bucket | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for bucket in sorted(table, key=_bucket_order):
        cells = []
        for column in columns:
            cell = table[bucket].get(column)
            if cell is None:
                cells.append("—")
                continue
            mark = "✓" if cell["matched"] else "✗ " + "; ".join(cell["failed_cases"])
            padding = cell["padding"] / max(1, cell["tokens"] + cell["padding"])
            cells.append(f"{mark} · pad {padding:.0%} · {1000 * cell['seconds'] / max(1, cell['steps']):.1f} ms")
        lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    notes = [f"- {s.backend} {s.topology}: {s.cores_note}" for s in stages if s.cores_note]
    suspects = [f"- {s.backend} {s.topology}: {', '.join(names)}" for s in stages if (names := suspect_buckets(s))]
    failures = [f"- {s.backend} {s.topology} / {r.case} (buckets {', '.join(r.buckets)}): {f}"
                for s in stages for r in s.cases for f in r.failures]
    if notes:
        lines += ["", "Core availability:", *notes]
    unexercised = [f"- {s.backend} {s.topology}: {', '.join(s.unexercised)}" for s in stages if s.unexercised]
    if unexercised:
        lines += ["", "Compiled but never run (unreachable with this config, e.g. a prefill bucket above "
                  "runtime.max_num_prefilling_tokens):", *unexercised]
    if suspects:
        lines += ["", "Suspect buckets (run only by failing cases):", *suspects]
    lines += ["", "Failures:" if failures else "All cases matched.", *failures]
    return "\n".join(lines) + "\n"


def suspect_buckets(stage: Stage) -> list[str]:
    """Buckets that only failing cases ran in: where to look first."""
    failing = {b for r in stage.cases if r.failures for b in r.buckets}
    passing = {b for r in stage.cases if not r.failures for b in r.buckets}
    return sorted(failing - passing, key=_bucket_order)


def _bucket_order(name: str) -> tuple:
    kind, _, shape = name.partition("-")
    size, _, width = shape.partition("x")
    return (kind, int(size), int(width or 1))


def write_reports(stages: list[Stage], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"junit": out / "sweep.xml", "markdown": out / "sweep.md", "json": out / "sweep.json"}
    contents = {"junit": junit_xml(stages), "markdown": markdown(stages),
                "json": json.dumps([dataclasses.asdict(s) for s in stages], indent=1) + "\n"}
    for kind, path in paths.items():
        partial = path.with_name(path.name + ".partial")
        partial.write_text(contents[kind])
        os.replace(partial, path)  # a report is whole or absent
    return paths


def passed(stages: list[Stage]) -> bool:
    return all(not r.failures for s in stages for r in s.cases)
