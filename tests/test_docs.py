"""The documentation site: its generated references name every model.yaml key and every command-line
option (walked here independently of the generator), and it builds with `mkdocs build --strict`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import click

from graphc.cli import cli
from graphc.config import GraphcConfig
from graphc.tools import reference

ROOT = Path(__file__).resolve().parents[1]


def _keys(cls, prefix=""):
    """Every model.yaml key path, as the strict loader (graphc.typed.build) reads them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("from_data", True):
            continue
        path = prefix + f.name
        yield path
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if dataclasses.is_dataclass(tp):
            yield from _keys(tp, path + ".")


def _commands(command=cli, path="graphc"):
    """(command path, command) for `graphc` and every command under it."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            if not sub.hidden:
                yield from _commands(sub, f"{path} {name}")


def _option_names(command):
    ctx = click.Context(command)
    return [name for p in command.get_params(ctx) if isinstance(p, click.Option) and not p.hidden
            for name in p.opts + p.secondary_opts]


KEYS = list(_keys(GraphcConfig))
COMMANDS = list(_commands())


def test_the_walks_find_the_schema_and_the_commands():
    assert {"model.checkpoint", "model.speculative.tokens", "buckets.auto.workload", "runtime.sampling.seed",
            "backend"} <= set(KEYS)
    assert "source" not in KEYS and "model_args" not in KEYS  # set by the loader, not keys
    assert {"graphc compile", "graphc serve", "graphc checkpoint make-tiny"} <= {path for path, _ in COMMANDS}


def test_the_model_yaml_reference_documents_every_key():
    markdown = reference.config_markdown()
    documented = [path for path, _, _, doc in reference.config_keys() if doc]
    for key in KEYS:
        assert f"`{key}`" in markdown, f"model.yaml key {key} is missing from the generated reference"
        assert key in documented, f"model.yaml key {key} has no docstring in src/graphc/config.py"


def test_the_cli_reference_documents_every_command_and_option():
    markdown = reference.cli_markdown()
    for path, command in COMMANDS:
        heading = f"## `{path}`"
        assert heading in markdown, f"{path} is missing from the generated CLI reference"
        section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
        for name in _option_names(command):
            assert f"`{name}" in section or f", {name}" in section, f"{path} {name} is missing from its section"


def test_the_reference_pages_hold_their_markers():
    for page, kind in (("reference/model-yaml.md", "config"), ("reference/cli.md", "cli")):
        text = (ROOT / "docs" / page).read_text()
        assert f"<!-- graphc-reference: {kind} -->" in text.splitlines(), page
        assert "graphc-reference" not in reference.expand(text)


def test_the_readme_says_where_the_docs_are():
    readme = (ROOT / "README.md").read_text()
    assert "mkdocs serve" in readme and "mkdocs build --strict" in readme and "`docs/`" in readme
    assert ".venv/bin/mkdocs build --strict --site-dir build/site" in (ROOT / ".ci" / "run").read_text()


def test_the_site_builds_strictly_with_both_references(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    config_page = (site / "reference" / "model-yaml" / "index.html").read_text()
    for key in KEYS:
        assert f"<code>{key}</code>" in config_page, key
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for path, command in COMMANDS:
        assert f"<code>{path}</code>" in cli_page, path
        for name in _option_names(command):
            assert name in cli_page, (path, name)


def test_the_readme_sections_the_docs_include_exist():
    # The quick start and the test tiers live in the README (CI and tests/test_readme.py read them
    # there) and are included into the docs by section: name the page that lost its section.
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        for line in page.read_text().splitlines():
            if line.startswith('--8<-- "README.md:'):
                section = line.split(":", 1)[1].rstrip('"')
                assert f"--8<-- [start:{section}]" in readme and f"--8<-- [end:{section}]" in readme, (page, section)
