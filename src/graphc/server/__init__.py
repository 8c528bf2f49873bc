"""`graphc serve`: an OpenAI-compatible HTTP server over compiled artifacts.

    schemas.py   the request bodies (pydantic, unknown fields refused) and OpenAI-style errors
    metrics.py   Prometheus metrics: queue, running requests, KV blocks, tokens, latencies, steps
    app.py       the routes (FastAPI) over `graphc.runtime.online.OnlineEngine`
"""
