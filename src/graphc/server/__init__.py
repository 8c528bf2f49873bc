"""`graphc serve`: an OpenAI-compatible HTTP server over compiled artifacts.

    limits.py     what one request may take: body bytes, template time, stop strings (and defaults)
    auth.py       --api-key: a Bearer token on every route but /health
    body.py       a request body read within its bound (413) and parsed into its schema (400)
    schemas.py    the request bodies (pydantic, unknown fields refused) and OpenAI-style errors
    translate.py  a request body as the engine's request (`graphc.request`'s checks, OpenAI's)
    templates.py  a chat rendered with the checkpoint's template in worker processes, time-bounded
    template_worker.py  such a worker process
    routes.py     the routes (FastAPI) over `graphc.runtime.online.OnlineEngine`
    streaming.py  a request's tokens as text cut at stop strings: server-sent events or one body
    launch.py     `serve_http`: uvicorn on one rank or the leader's, draining on SIGTERM
    metrics.py    Prometheus metrics: queue, running requests, KV blocks, tokens, latencies, steps
"""
