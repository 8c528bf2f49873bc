"""Who shares `graphc serve`'s prefix cache, and what a client can learn of it.

The trust model. Cached KV blocks are shared by every request that salts its prompt alike
(`graphc.runtime.prefix_cache`): a request that reuses a block reads what another computed, and
sees that it did, in `usage.prompt_tokens_details.cached_tokens` or only in a faster first token.
Anyone who can send requests can so test guesses of another's prompt, block by block. The salt
a request's blocks are keyed under decides who can:
- `shared` (the default): requests share every block, except that a request's `cache_salt`
  (vLLM's field) keeps its blocks to requests with the same salt;
- `api-key`: each API key (`--api-key`, `--api-keys-file`) is a cache of its own; a
  `cache_salt` divides a key's cache further;
- `salt`: every request must give a `cache_salt`, and shares only with the same salt.
What stays shared whatever the mode: the pool's room (a tenant's blocks evict another's, least
recently used first), the step batch (a busy server is slower for all), and /metrics' counters,
which every key may read.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphc.errors import GraphcError
from graphc.server.limits import PREFIX_CACHE_ISOLATION
from graphc.server.translate import BadRequest


@dataclass(frozen=True)
class CacheIsolation:
    """`graphc serve`'s --prefix-cache-isolation and --hide-cached-tokens."""

    mode: str = "shared"
    hide_cached_tokens: bool = False
    """Leave `prompt_tokens_details` out of `usage`, so a hit shows only in time."""

    def check(self, api_keys: tuple[str, ...]) -> None:
        """Raises GraphcError for a mode that is not one, or `api-key` on a server without keys."""
        if self.mode not in PREFIX_CACHE_ISOLATION:
            raise GraphcError(f"--prefix-cache-isolation {self.mode!r}; expected one of "
                              f"{', '.join(PREFIX_CACHE_ISOLATION)}")
        if self.mode == "api-key" and not api_keys:
            raise GraphcError("--prefix-cache-isolation api-key needs the server's keys: give --api-key or "
                              "--api-keys-file")

    def salt(self, cache_salt: str | None, tenant: str | None) -> str | None:
        """The salt a request's blocks are keyed under, given its `cache_salt` and its API key's
        tenant; BadRequest where the mode asks for a salt the request does not give."""
        if self.mode == "salt" and cache_salt is None:
            raise BadRequest("cache_salt: this server keeps each client's prefix cache apart and needs a cache_salt "
                             "on every request (a secret string, the same for requests that may share a cache)",
                             param="cache_salt")
        # Each part in a domain of its own, so no choice of cache_salt can spell a tenant's salt.
        parts = [f"tenant:{tenant}"] if self.mode == "api-key" else []
        if cache_salt is not None:
            parts.append(f"salt:{cache_salt}")
        return "\n".join(parts) or None
