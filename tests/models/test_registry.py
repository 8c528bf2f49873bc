"""The family registry: every family through capture, no family named outside its package, and a
family registered from outside graphc compiling and serving with nothing else edited."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import graphc
from graphc.buckets.selection import Bucket
from graphc.cli import cli
from graphc.compiler.capture import StepGraph, capture_bucket, example_step_inputs, model_weights
from graphc.errors import CheckpointError
from graphc.models import deepseek_v3, registry
from graphc.weights.checkpoint import load_model
from graphc.models.deepseek_v3.args import V3Args, v3_args_from_hf_config
from graphc.models.drafter import Drafter
from graphc.models.family import Family, StoredLayout, Support, TinyCheckpoints
from graphc.weights.hf_config import architectures
from graphc.weights.tiny import preset_config, write_random_checkpoint
from graphc.step import STEP_INPUTS, kv_pool_shape
from support import TEST_BUCKETS, model_yaml, one_line_refusal

SOURCE = Path(graphc.__file__).parent


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.name)
def test_every_family_captures_a_step_that_equals_its_eager_step(family, tiny_checkpoints):
    model = load_model(tiny_checkpoints[next(iter(family.tiny.presets))])
    assert registry.family_of(model.args) is family
    bucket, blocks = Bucket("decode", 2), 4
    program = capture_bucket(model, bucket, blocks, num_blocks=8, block_size=8)
    names = [spec.arg.name for spec in program.graph_signature.input_specs]
    assert names[-len(STEP_INPUTS):] == list(STEP_INPUTS)
    pool_shape = kv_pool_shape(model.args.cache_layers, 8, 8, model.args.kv_cache_dim)
    inputs = example_step_inputs(bucket, blocks, pool_shape, model.dtype)
    weights = list(model_weights(model).values())
    exported_inputs = {name: t.clone() for name, t in inputs.items()}
    with torch.no_grad():
        expected = StepGraph(model)(weights, *inputs.values())
        actual = program.module()(weights, *exported_inputs.values())
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(exported_inputs["kv_pool"], inputs["kv_pool"], rtol=0, atol=0)


# --- no family branches outside the family packages -------------------------------------------------


def _family_names() -> list[tuple[str, str]]:
    """(family package, name) for every class a family package defines for its args, model and
    reference, and the package's own module path."""
    names = []
    for family in registry.FAMILIES:
        args = family.args_from_hf_config(next(iter(family.tiny.presets.values())))
        package = type(args).__module__.rsplit(".", 1)[0]
        with torch.device("meta"):
            model = family.build_model(args, None, "fp32")
        classes = [*type(args).__mro__, *type(model).__mro__]
        if family.reference.model is not None:
            classes.append(family.reference.model)
        names += [(package, c.__name__) for c in classes if c.__module__.startswith(package + ".")]
        names.append((package, package))
    return names


def family_mentions(text: str, names: list[tuple[str, str]]) -> list[str]:
    """The family classes and modules `text` names."""
    found = []
    for package, name in names:
        short = package.rsplit(".", 1)[1]
        pattern = (rf"\b{re.escape(package)}\b|from graphc\.models import [\w, ]*\b{short}\b" if name == package
                   else rf"\b{name}\b")
        found += [name] if re.search(pattern, text) else []
    return found


def test_nothing_outside_a_family_package_and_the_registry_names_a_family():
    names = _family_names()
    packages = {package for package, _ in names}
    outside = [path for path in sorted(SOURCE.rglob("*.py"))
               if not any(str(path).startswith(str(SOURCE / p.removeprefix("graphc.").replace(".", "/")) + "/")
                          for p in packages) and path != SOURCE / "models" / "registry.py"]
    assert SOURCE / "compiler" / "pipeline.py" in outside and SOURCE / "weights" / "checkpoint.py" in outside
    mentions = {str(path.relative_to(SOURCE)): family_mentions(path.read_text(), names) for path in outside}
    assert {path: found for path, found in mentions.items() if found} == {}


def test_the_family_scan_finds_a_planted_branch():
    names = _family_names()
    assert family_mentions("if isinstance(args, V41Args):", names) == ["V41Args"]
    assert family_mentions("from graphc.models.deepseek_v4.args import HASH_MOE", names) == ["graphc.models.deepseek_v4"]
    assert family_mentions("from graphc.models import deepseek_v3, registry", names) == ["graphc.models.deepseek_v3"]
    assert family_mentions("DeepseekV4ForCausalLM checkpoints", names) == []


def _drafter_spellings() -> dict[str, Path]:
    """Each family drafter's method name, with the file that defines the drafter (of its `draft`)."""
    return {family.drafter.method: Path(inspect.getsourcefile(family.drafter.draft))
            for family in registry.FAMILIES if family.drafter is not None}


def drafter_mentions(path: Path, spellings: dict[str, Path]) -> list[str]:
    """The drafter methods `path`'s code spells as a string of its own (a comparison, a key, a
    Literal) outside the file that defines that drafter: where code branches on a drafter by name."""
    constants = {node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return sorted(method for method, home in spellings.items() if method in constants and path != home)


def test_no_code_outside_the_family_packages_and_a_drafters_home_names_a_drafter():
    spellings = _drafter_spellings()
    assert set(spellings) == {"mtp", "dspark"}
    packages = {SOURCE / package.removeprefix("graphc.").replace(".", "/") for package, _ in _family_names()}
    outside = [path for path in sorted(SOURCE.rglob("*.py")) if not any(package in path.parents for package in packages)]
    assert SOURCE / "config.py" in outside and SOURCE / "tools" / "plan.py" in outside
    found = {str(path.relative_to(SOURCE)): drafter_mentions(path, spellings) for path in outside}
    assert {path: methods for path, methods in found.items() if methods} == {}


def test_the_drafter_scan_finds_a_planted_branch(tmp_path):
    planted = tmp_path / "plan.py"
    planted.write_text('def passes(family):\n    """Counts \'dspark\' passes."""\n'
                       '    return 1 if family.drafter.method == "dspark" else 2\n')
    assert drafter_mentions(planted, _drafter_spellings()) == ["dspark"]
    planted.write_text('"""The drafter: \'dspark\' or \'mtp\', as the family says."""\n')
    assert drafter_mentions(planted, _drafter_spellings()) == []  # prose names them, code does not


# --- a fifth family from outside graphc -----------------------------------------------------------------


FAKE_ARCHITECTURE = "FakeSeekForCausalLM"


@dataclasses.dataclass(frozen=True)
class FakeArgs(V3Args):
    @property
    def architecture(self) -> str:
        return FAKE_ARCHITECTURE


def _fake_args(config: dict) -> FakeArgs:
    v3 = v3_args_from_hf_config({**config, "architectures": [deepseek_v3.V3_ARCHITECTURE]})
    return FakeArgs(**{f.name: getattr(v3, f.name) for f in dataclasses.fields(v3)})


def _repeat_drafts(model, k, hidden, input_ids, step, kept_until, picked):
    """A drafter of the test's own: each row's next token, k times (lossless like any deterministic
    draft: the verdict keeps the model's tokens)."""
    return picked.expand(-1, k)  # [B, k]


REPEAT = Drafter("repeat", _repeat_drafts, layer=lambda args: args, served_layers=lambda args: 0,
                 passes=lambda args, tokens, rows, k: [])


FAKE = Family(
    name="FakeSeek",
    architectures=(FAKE_ARCHITECTURE,),
    recognises=lambda config: FAKE_ARCHITECTURE in architectures(config),
    args_from_hf_config=_fake_args,
    build_model=deepseek_v3.DeepseekV3,
    stored=StoredLayout(deepseek_v3.layout.released_sources, skips=deepseek_v3.layout.is_multi_token_prediction,
                        keeps_fp32=deepseek_v3.layout.keeps_fp32),
    support=Support(backends=("export",)),
    tiny=TinyCheckpoints(draft_and_extra_shapes=deepseek_v3.layout.draft_shapes),
    drafter=REPEAT,
)


@pytest.fixture
def fake_family():
    registry.register(FAKE)
    yield FAKE
    registry.unregister(FAKE)


@pytest.mark.compiles
def test_a_registered_family_compiles_and_serves_with_nothing_else_edited(fake_family, tmp_path, compiled):
    from graphc.compiler.pipeline import CompileOptions, compile
    from graphc.config import load_config
    from graphc.runtime import Engine, Request

    # lora-groups' config and, from the same seed, its weights, under another architecture
    config = {**preset_config("lora-groups"), "architectures": [FAKE_ARCHITECTURE], "model_type": "fakeseek"}
    checkpoint = write_random_checkpoint(tmp_path / "fake-ckpt", config, seed=0)
    data = model_yaml(checkpoint, TEST_BUCKETS["small"])
    data["model"]["speculative"] = {"method": "repeat", "tokens": 2}  # its own drafter
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    loaded = load_config(tmp_path / "model.yaml")
    assert loaded.family is FAKE and loaded.draft_tokens == 2
    manifest = compile(loaded, tmp_path / "artifacts", CompileOptions(show_progress=False))
    assert manifest.model.architecture == FAKE_ARCHITECTURE

    requests = [Request([5, 6, 7, 8], 12, stop_at_eos=False), Request(list(range(20, 31)), 12, stop_at_eos=False)]
    engine = Engine(tmp_path / "artifacts")
    served = [r.output_ids for r in engine.generate(requests)]
    as_v3 = [r.output_ids for r in Engine(compiled("lora-groups", "export", "small")).generate(requests)]
    assert served == as_v3 and all(len(tokens) == 12 for tokens in served)
    assert sum(engine.drafts.proposed) > 0  # the steps drafted, with the test's drafter


def test_a_family_refuses_a_backend_it_lacks_and_an_unknown_architecture_lists_every_family(fake_family, tmp_path):
    args = _fake_args(preset_config("lora-groups"))
    from graphc.topology import Topology

    with pytest.raises(graphc.errors.GraphcError, match=r"^model\.checkpoint: FakeSeekForCausalLM has no neuron "
                                                         r"lowering yet; use the export backend$"):
        FAKE.check_compile(args, Topology(), "local", "neuron")
    with pytest.raises(CheckpointError, match=r"architecture NoSuchForCausalLM is not supported; supported: "
                                              r"FakeSeekForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, "
                                              r"DeepseekV4ForCausalLM, DeepseekV41ForCausalLM$"):
        registry.family_of_config({"architectures": ["NoSuchForCausalLM"]})
    with pytest.raises(ValueError, match="already registered"):
        registry.register(FAKE)


def test_tp_not_dividing_what_a_family_splits_is_one_line_and_a_family_without_it_refuses_tp(
        fake_family, tiny_checkpoints, tmp_path):
    config = model_yaml(tiny_checkpoints["v4"], TEST_BUCKETS["small"])
    config["topology"] = {"tp": 4, "ep": 4}  # V4's 4 heads divide, its 2 output groups do not
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "model.yaml")])
    assert one_line_refusal(result) == "error: topology.tp: 4 must divide the checkpoint's o_groups (2); 2 % 4 = 2"
    from graphc.topology import Topology

    with pytest.raises(graphc.errors.GraphcError, match=r"^topology\.tp: 2; FakeSeekForCausalLM is served with tp = 1 "
                                                         r"so far$"):
        FAKE.check_compile(_fake_args(preset_config("lora-groups")), Topology(tp=2), "local", "export")
