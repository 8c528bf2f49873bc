"""End to end: compile, then serve from the artifacts; tokens equal transformers' `generate` (fp32).

Prompt lengths are chosen against the standard buckets (prefill 8 and 32): 1 token, exactly a
bucket, between buckets, and longer than the largest bucket (chunked: 32 + 32 + 11).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from graphc.runtime import Engine, Request
from support import hf_greedy, load_hf

LENGTHS = [1, 8, 20, 32, 75]
NEW_TOKENS = 24
# Every preset on export; inductor lowers the same ops, so one preset there, in the slow tier with
# the V3.2 sparse ops' (test_v32.py) and V4's (test_parallel_serve.py): its compiles cost ~20 s a
# graph, and the per-commit tier serves inductor artifacts at 2 x 2 ranks (test_parallel_serve.py);
# as stored (test_weights_as_stored.py) and with drafts (test_speculative.py) in the slow tier.
# The first case is the fast tier's one end-to-end compile and serve; the others carry `compiles`.
INDUCTOR = pytest.mark.slow
BACKEND_PRESETS = [("export", "lora-groups")] + [
    pytest.param(backend, preset, marks=pytest.mark.compiles)
    for backend, preset in (("export", p) for p in ("direct-q-yarn", "yarn-mscale", "wide-16e", "v32", "v4"))
] + [pytest.param("inductor", "lora-groups", marks=[pytest.mark.compiles, INDUCTOR])]


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 254 + 2 for i in range(n)] for n in LENGTHS]


def serve(engine: Engine, prompt_list, new_tokens=NEW_TOKENS):
    results = engine.generate([Request(p, new_tokens, stop_at_eos=False) for p in prompt_list])
    assert all(r.error is None and r.finish_reason == "length" for r in results), results
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    cache = {}

    def get(preset):
        if preset not in cache:
            model = load_hf(tiny_checkpoints[preset])
            cache[preset] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts()]
        return cache[preset]

    return get


@pytest.mark.parametrize("backend, preset", BACKEND_PRESETS)
def test_served_tokens_equal_transformers_generate(backend, preset, compiled, reference):
    assert serve(Engine(compiled(preset, backend)), prompts()) == reference(preset)


@pytest.mark.compiles
@pytest.mark.parametrize("backend", ["export", pytest.param("inductor", marks=INDUCTOR)])
def test_prompts_served_together_equal_each_served_alone(backend, compiled):
    engine = Engine(compiled("lora-groups", backend))  # loaded once; each generate has its own scheduler
    together = serve(engine, prompts())
    assert together == [serve(engine, [p])[0] for p in prompts()]


@pytest.mark.compiles
def test_tokens_do_not_depend_on_the_bucket_set(compiled, reference):
    # Bucket choice is host logic, the same whatever the backend: export only.
    assert serve(Engine(compiled("lora-groups", "export", "alternative")), prompts()) == reference("lora-groups")


def test_runtime_imports_nothing_from_the_compiler_side():
    code = (
        "import sys, graphc.runtime\n"
        "heavy = [m for m in sys.modules if m.startswith(('graphc.passes', 'graphc.compiler', 'graphc.tools',"
        " 'graphc.artifacts.writer', 'graphc.backends.', 'graphc.models.deepseek_v3.model', 'graphc.weights.checkpoint',"
        " 'transformers'))]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
