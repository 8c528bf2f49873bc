"""Prefix caching: a request's prefill starts at its first token that no cached KV block holds.

A full block is keyed by a hash chain: the SHA-256 of its parent block's key and its own token
ids, rooted in what else decides its contents (the model fingerprint, the cache dtype, the block
size). Logical block j lives on context-parallel shard j % cp, so its key is looked up in that
shard's allocator, the same on every rank. The scheduler publishes a block once every position in
it is written (prompt or generated tokens); the allocator keeps it cached after its last holder
ends and evicts it least recently used only when an allocation needs it. The last prompt token is
always computed, so the first sampled token has logits.

Why reuse is exact, family by family: every family keeps all it carries between steps in the
paged pool, one vector per position, written by the step that runs that position's token and a
function of the tokens up to it; nothing else carries over. So a full block is the same whichever
request wrote it, given the same tokens before and in it, and a prefill may start at any block
boundary, as a prompt's later chunk or a decode step already does:
- V3: the MLA latent and roped key of each position.
- V3.2: those plus the lightning indexer's key of each position.
- V4: per layer the sliding window's key (K = V), each compressor's per-token kv and gate, and
  the compressed entry, written at the slot of the token that closes its window. A prefix that
  ends inside a compressor window leaves that window's token states in its blocks, and the first
  uncached token pools the open window from the pool as a decode step does: blocks are reused at
  any boundary and nothing is recomputed.
- V4.1: V4's, plus each position's token id (as digits, pool layer 2L) that Engram's n-grams read
  across the boundary; under CP the halo comes from the other shards' pools as at any step.

With speculative decoding one vector breaks the rule: the MTP layer's KV at a position is
computed from the token after it (`graphc.models.speculation`), so at a block's last position it
depends on the first token of the next block, which is the writer's continuation. A shared block
cannot be written again (its other holders read that vector too), so with drafts a block's key
also covers the token after it: a request reuses the block only where its next token is the
writer's, and otherwise computes the block itself.

Isolation: a shared cache is an oracle. A client that can see a hit (`cached_tokens`, or only a
faster first token) can test guesses of what another client sent. A request's `cache_salt`
(`graphc serve`: its API key's and its own, see `graphc.server.isolation`) roots its chain at a
root of its own, so requests with different salts never share a block; requests with the same
salt, or none, share as before.
"""

from __future__ import annotations

import hashlib
import os
from array import array

from graphc.errors import GraphcError
from graphc.runtime.paged import BlockAllocator

PREFIX_CACHING_ENV = "GRAPHC_PREFIX_CACHING"


def prefix_caching_enabled(compiled_default: bool) -> bool:
    """The manifest's `runtime.prefix_caching` unless GRAPHC_PREFIX_CACHING (0 or 1) overrides it."""
    value = os.environ.get(PREFIX_CACHING_ENV)
    if value is None:
        return compiled_default
    if value not in ("0", "1"):
        raise GraphcError(f"{PREFIX_CACHING_ENV}={value!r}; expected 0 (off) or 1 (on)")
    return value == "1"


def root_key(*salt: str) -> bytes:
    return hashlib.sha256("\0".join(("graphc-prefix-cache", *salt)).encode()).digest()


def salted_root(root: bytes, salt: str | None) -> bytes:
    """The chain's root for requests salted with `salt` (`root` itself for unsalted ones)."""
    return root if salt is None else hashlib.sha256(b"cache-salt\0" + root + salt.encode()).digest()


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """Lookup and publication of one replica's full blocks over its shards' allocators, with the
    counts of prompt tokens looked up and found. With `next_token` (speculative decoding: see
    the module docstring) a block's key covers the token after it too."""

    def __init__(self, allocators: list[BlockAllocator], block_size: int, root: bytes, next_token: bool = False):
        self.allocators, self.block_size, self.root = allocators, block_size, root
        self.key_span = block_size + next_token
        """The tokens from a block's first that decide its contents."""
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _allocator(self, block: int) -> BlockAllocator:
        return self.allocators[block % len(self.allocators)]

    def _key_tokens(self, tokens: list[int], j: int) -> list[int]:
        """Block j's tokens in its key, with `next_token` the one after it too (always there: a
        block is looked up only before the prompt's last token, and published once its last
        position is written, which takes that token)."""
        return tokens[j * self.block_size:j * self.block_size + self.key_span]

    def match(self, prompt: list[int], salt: str | None = None) -> tuple[list[int], list[bytes]]:
        """The cached blocks that hold `prompt`'s longest cached prefix (never its last token) for
        a request salted with `salt`, and their keys; no side effects."""
        blocks, keys, parent = [], [], salted_root(self.root, salt)
        for j in range((len(prompt) - 1) // self.block_size):
            key = block_key(parent, self._key_tokens(prompt, j))
            block = self._allocator(j).lookup(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def fresh_needed(self, blocks_needed: list[int], hits: list[int]) -> list[int]:
        """Per shard, the free blocks an admission with `hits` takes: its blocks but the hits,
        plus the idle hits (cached blocks count as free until someone holds them)."""
        taken = list(blocks_needed)
        for j, block in enumerate(hits):
            if not self._allocator(j).is_idle(block):
                taken[j % len(self.allocators)] -= 1
        return taken

    def hold(self, prompt_tokens: int, hits: list[int]) -> None:
        """An admitted request reads `hits`; count its lookup."""
        for j, block in enumerate(hits):
            self._allocator(j).hold(block)
        self.queried_tokens += prompt_tokens
        self.hit_tokens += len(hits) * self.block_size

    def publish(self, blocks: list[int], keys: list[bytes], tokens: list[int], written: int,
                salt: str | None = None) -> None:
        """Publish every block of a sequence (salted with `salt`) whose positions are all written
        (`written` of them) and not yet keyed; `keys` (the sequence's chain so far) grows with them."""
        for j in range(len(keys), written // self.block_size):
            key = block_key(keys[-1] if keys else salted_root(self.root, salt), self._key_tokens(tokens, j))
            self._allocator(j).publish(blocks[j], key)
            keys.append(key)
