"""Prometheus metrics of a running server, in their own registry (text format at /metrics).

The engine's state (queue, running requests, KV blocks, steps per bucket) is read at scrape time
from what the engine thread last published; tokens and latencies are recorded as they happen.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from graphc.runtime.online import OnlineEngine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW_SECONDS = 10.0


class ServerMetrics:
    def __init__(self, online: OnlineEngine):
        self.registry = CollectorRegistry()
        self.online = online
        self.tokens = Counter("graphc_generated_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("graphc_requests", "Requests ended, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.first_token = Histogram("graphc_time_to_first_token_seconds", "From arrival to the first token",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("graphc_inter_token_latency_seconds", "Between a request's tokens",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self._recent: deque[float] = deque()  # times of recent tokens, for tokens/s
        self._lock = threading.Lock()
        self.registry.register(_EngineCollector(self))

    def token(self) -> None:
        self.tokens.inc()
        now = time.monotonic()
        with self._lock:
            self._recent.append(now)
            self._forget(now)

    def tokens_per_second(self) -> float:
        with self._lock:
            self._forget(time.monotonic())
            return len(self._recent) / RATE_WINDOW_SECONDS

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0] < now - RATE_WINDOW_SECONDS:
            self._recent.popleft()


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        state = self.metrics.online.state
        for name, doc, value in (
            ("graphc_requests_waiting", "Requests waiting for admission (KV blocks)", state.waiting),
            ("graphc_requests_running", "Requests admitted and generating", state.running),
            ("graphc_kv_blocks_in_use", "KV blocks held by admitted requests (every shard)", state.blocks_in_use),
            ("graphc_kv_blocks_total", "KV blocks in the pool (every shard)", state.num_blocks),
            ("graphc_kv_blocks_cached", "Full KV blocks kept by the prefix cache, in use or idle (every shard)",
             state.cached_blocks),
            ("graphc_generation_tokens_per_second", f"Tokens over the last {RATE_WINDOW_SECONDS:.0f} s",
             self.metrics.tokens_per_second()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        queried, hit = state.prefix_cache_tokens
        yield CounterMetricFamily("graphc_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=queried)
        yield CounterMetricFamily("graphc_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=hit)
        drafts = state.drafts
        yield CounterMetricFamily("graphc_spec_draft_tokens", "Draft tokens verified (speculative decoding)",
                                  value=sum(drafts.proposed))
        yield CounterMetricFamily("graphc_spec_accepted_tokens", "Draft tokens accepted (speculative decoding)",
                                  value=sum(drafts.accepted))
        acceptance = GaugeMetricFamily("graphc_spec_acceptance_rate",
                                       "Accepted over verified drafts, by draft position (1: the first after a row's "
                                       "last token)", labels=["position"])
        for position, (proposed, accepted) in enumerate(zip(drafts.proposed, drafts.accepted), start=1):
            acceptance.add_metric([str(position)], accepted / proposed if proposed else 0.0)
        yield acceptance
        steps = CounterMetricFamily("graphc_steps", "Steps run, by bucket", labels=["bucket"])
        for bucket, count in sorted(state.steps.items()):
            steps.add_metric([bucket], count)
        yield steps
