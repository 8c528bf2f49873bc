"""Shared fixtures: tiny checkpoints (graphc's own and transformers-written), built once per session;
and the `inductor` tier marker, put on every test parametrized with the inductor backend."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from graphc.weights.tiny import (PRESETS, TRAINED_PRESET, TRANSFORMERS_PRESETS, make_tiny_checkpoint, preset_config,
                                write_random_checkpoint)
from nightly import NIGHTLY, check_listed
from support import (FP8_BLOCK, FP8_PRESETS, SKEWED, SPARSE_TOPK, SPARSE_V32, TEST_BUCKETS, TEST_KV_BLOCKS, V4_FP4_EXPERTS,
                     model_yaml, randomise_v4_zero_inits, rewrite_config, skew_routes_to_first_experts)

# Lines the tests want a reader of the CI log to see (agreement rates, margins, noise floors).
_REPORT: list[str] = []
# Seconds each distinct artifacts compile of the `compiled` fixture took, by its key: what the
# suite spends compiling (the summary prints them, slowest first).
_COMPILES: dict[tuple, float] = {}


@pytest.fixture(scope="session")
def report():
    return _REPORT.append


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: they must see the nightly marks, and the check every test
def pytest_collection_modifyitems(config, items):
    # A test that takes the backend as a parameter compiles with AOTInductor (about 20 s a graph
    # on two cores) exactly when that parameter is "inductor": mark those cases, not the others.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "inductor" in params.values():
            item.add_marker(pytest.mark.inductor)
        if item.nodeid in NIGHTLY:
            item.add_marker(pytest.mark.slow)
    if not config.args or config.args == ["tests"]:  # the whole suite: every listed test must exist
        check_listed({item.nodeid for item in items})


def pytest_terminal_summary(terminalreporter):
    if _COMPILES:
        terminalreporter.section("compiled artifacts")
        terminalreporter.write_line(f"{len(_COMPILES)} compiles, {sum(_COMPILES.values()):.0f} s in all")
        for key, seconds in sorted(_COMPILES.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {key}")
    if _REPORT:
        terminalreporter.section("graphc measurements")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """graphc `make-tiny` output for every preset, and SPARSE_V32: the v32 preset with an index_topk
    below the tests' contexts, so its attention is sparse."""
    root = tmp_path_factory.mktemp("tiny")
    made = {name: make_tiny_checkpoint(root / name, preset=name, seed=0) for name in [*PRESETS, TRAINED_PRESET]}
    made[SPARSE_V32] = shutil.copytree(made["v32"], root / SPARSE_V32)
    rewrite_config(made[SPARSE_V32], index_topk=SPARSE_TOPK)
    made[SKEWED] = shutil.copytree(made["lora-groups"], root / SKEWED)
    skew_routes_to_first_experts(made[SKEWED], experts=4)
    return made


@pytest.fixture(scope="session")
def fp8_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """`make-tiny --fp8-block FP8_BLOCK` of each of FP8_PRESETS, and V4_FP4_EXPERTS."""
    root = tmp_path_factory.mktemp("fp8")
    made = {name: make_tiny_checkpoint(root / name, preset=name, seed=0, fp8_block=FP8_BLOCK) for name in FP8_PRESETS}
    flash = {**json.loads((made["v4"] / "config.json").read_text()), "expert_dtype": "fp4"}
    flash["quantization_config"]["scale_fmt"] = "ue8m0"
    made[V4_FP4_EXPERTS] = write_random_checkpoint(root / V4_FP4_EXPERTS, flash, seed=0)
    return made


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """For every preset transformers implements, a model initialised *by transformers* and written by its `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in TRANSFORMERS_PRESETS:
        config = preset_config(name)
        model_type = config["model_type"]
        # A wider init than transformers' default 0.02 keeps tiny-model logits decisive.
        config = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
        if model_type == "deepseek_v32":  # its config has no such field (MLA is always interleaved)
            config.pop("rope_interleave")
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config, initializer_range=0.15))
        with torch.no_grad():  # transformers initialises the correction bias to zeros; make it matter
            for layer in model.model.layers:
                if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
            if model_type == "deepseek_v4":
                randomise_v4_zero_inits(model)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def checkpoint_sources(tiny_checkpoints, hf_checkpoints):
    return {"graphc": tiny_checkpoints, "transformers": hf_checkpoints}


# --- compiled artifacts, shared by every test that serves from them ---------------------------------

@pytest.fixture(scope="session", autouse=True)
def isolated_compile_cache(tmp_path_factory):
    """One compile cache per test session: shared by all tests, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAPHC_CACHE_DIR", str(tmp_path_factory.mktemp("graphc-cache")))
        yield


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, tiny_checkpoints):
    """compiled(preset, backend, buckets="standard", cp=1, ep=1, static_moe=True, dp=1,
    moe_lowering="auto", tp=1, dtype="float32", speculative=0, prompt_logprobs=False) -> artifacts
    dir, compiled once per session (static_moe=False disables the static-MoE rewrite; speculative=k
    drafts k tokens with the family's draft layers: MTP, or V4.1's DSpark stages; prompt_logprobs
    compiles the prefill buckets' score twins)."""
    import yaml

    from graphc.config import load_config
    from graphc.compiler.pipeline import CompileOptions, compile
    from graphc.weights.hf_config import read_hf_config
    from graphc.models.registry import family_of_config

    made: dict[tuple, Path] = {}

    def get(preset: str, backend: str, buckets: str = "standard", cp: int = 1, ep: int = 1,
            static_moe: bool = True, dp: int = 1, moe_lowering: str = "auto", tp: int = 1,
            dtype: str = "float32", speculative: int = 0, prompt_logprobs: bool = False) -> Path:
        key = (preset, backend, buckets, cp, ep, static_moe, dp, moe_lowering, tp, dtype, speculative, prompt_logprobs)
        if key not in made:
            form = (("" if static_moe else "-generic") + ("" if moe_lowering == "auto" else f"-{moe_lowering}")
                    + ("" if dtype == "float32" else f"-{dtype}") + (f"-mtp{speculative}" if speculative else "")
                    + ("-scores" if prompt_logprobs else ""))
            root = tmp_path_factory.mktemp(f"art-{preset}-{backend}-{buckets}-dp{dp}-cp{cp}-tp{tp}-ep{ep}{form}")
            config = {**model_yaml(tiny_checkpoints[preset], TEST_BUCKETS[buckets], backend, dtype,
                                   num_blocks=TEST_KV_BLOCKS.get(buckets, 64)),
                      "topology": {"dp": dp, "cp": cp, "tp": tp, "ep": ep}}
            config["model"]["moe_lowering"] = moe_lowering
            config["runtime"]["prompt_logprobs"] = prompt_logprobs
            if speculative:  # the family's own drafter
                method = family_of_config(read_hf_config(tiny_checkpoints[preset])).drafter.method
                config["model"]["speculative"] = {"method": method, "tokens": speculative}
            (root / "model.yaml").write_text(yaml.safe_dump(config))
            options = CompileOptions(verify_passes=True, show_progress=False, workers=2,
                                     disabled_passes=frozenset() if static_moe else frozenset({"static_moe"}))
            started = time.perf_counter()
            compile(load_config(root / "model.yaml"), root / "artifacts", options)
            _COMPILES[key] = time.perf_counter() - started
            made[key] = root / "artifacts"
        return made[key]

    return get
