"""`graphc serve` with speculative decoding: streams carry several tokens a step where drafts are
accepted, the text is the Engine's (greedy), and /metrics counts the drafts per position."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from graphc.runtime import Engine, Request
from servers import Server

pytestmark = pytest.mark.compiles

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass ", "    for i in range("]


def test_streams_give_the_engines_text_and_metrics_count_the_drafts(compiled):
    artifacts = compiled("trained", "export", "prompt_as_decode", speculative=2)
    engine = Engine(artifacts)
    server = Server(artifacts)
    try:
        def stream(text):
            return "".join(chunk.choices[0].text for chunk in server.client.completions.create(
                model="tiny", prompt=text, max_tokens=30, temperature=0, stream=True))

        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(stream, TEXTS))
        tokenizer = Tokenizer.from_file(str(artifacts / engine.manifest.tokenizer))
        want = engine.generate([Request(tokenizer.encode(t).ids, 30) for t in TEXTS])
        assert texts == [tokenizer.decode(r.output_ids) for r in want]
        metrics = server.metrics()
        proposed, accepted = metrics["graphc_spec_draft_tokens_total"], metrics["graphc_spec_accepted_tokens_total"]
        assert 0 < accepted < proposed
        first, second = (metrics[f'graphc_spec_acceptance_rate{{position="{j}"}}'] for j in (1, 2))
        assert 0 < second < first <= 1
        assert metrics["graphc_generated_tokens_total"] == sum(len(r.output_ids) for r in want)
    finally:
        assert server.stop() == 0
