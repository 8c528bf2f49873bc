"""`graphc serve`: an OpenAI-compatible HTTP server over compiled artifacts.

    schemas.py    the request bodies (pydantic, unknown fields refused) and OpenAI-style errors
    translate.py  a request body as the engine's request (`graphc.request`'s checks, OpenAI's)
    routes.py     the routes (FastAPI) over `graphc.runtime.online.OnlineEngine`
    streaming.py  a request's tokens as text cut at stop strings: server-sent events or one body
    launch.py     `serve_http`: uvicorn on one rank or the leader's, draining on SIGTERM
    metrics.py    Prometheus metrics: queue, running requests, KV blocks, tokens, latencies, steps
"""
