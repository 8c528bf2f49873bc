"""The README's commands are what CI runs and what a new user types."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    test_commands = [b for b in _bash_blocks() if "pytest" in b]
    assert len(test_commands) == 1
    assert test_commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_main_command_uses_the_example_config_and_the_venv():
    main = [b for b in _bash_blocks() if "make-tiny" in b]
    assert len(main) == 1
    assert "python3 -m venv .venv" in main[0]
    example = re.search(r"compile (\S+\.yaml)", main[0]).group(1)
    assert (ROOT / example).is_file()


def test_ci_and_the_github_workflow_run_sweeps_of_valid_stages():
    import yaml

    from graphc.tools.sweep import parse_topologies

    assert "graphc sweep examples/tiny.yaml" in (ROOT / ".ci" / "run").read_text()
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "sweep.yml").read_text())
    assert set(workflow["jobs"]["sweep"]["strategy"]["matrix"]["backend"]) == {"export", "inductor"}
    for name, job in workflow["jobs"].items():
        assert parse_topologies(",".join(job["strategy"]["matrix"]["topology"])), name  # every stage parses
        steps = " ".join(step.get("run", "") for step in job["steps"])
        swept = re.findall(r"graphc sweep (\S+\.yaml)", steps)
        assert "examples/tiny.yaml" in swept and all((ROOT / example).is_file() for example in swept), name
    neuron = " ".join(step.get("run", "") for step in workflow["jobs"]["sweep-neuron"]["steps"])
    assert neuron.count("--backends neuron") == 4  # V3, V3.2, V4, V4.1


def test_the_nightly_workflow_runs_every_test_the_per_commit_job_deselects():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "full-suite.yml").read_text())
    runs = [step.get("run", "") for step in workflow["jobs"]["tests"]["steps"]]
    assert ".venv/bin/python -m pytest -q" in runs  # no marker: the slow tier too
    assert '-m "not slow"' in (ROOT / ".ci" / "run").read_text()
