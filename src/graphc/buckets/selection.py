"""Bucket selection: which precompiled shape a piece of work runs in.

Pure functions shared by the compiler (which shapes to build), the runtime (which graph to call)
and the tests. Nothing here imports torch.

Rules:
- A prefill chunk of n tokens runs in the smallest prefill bucket >= n.
- A prompt longer than the largest usable chunk is split front to back into chunks of that size;
  only the last chunk is padded.
- A decode step of b sequences runs in the smallest decode bucket >= b; more sequences than the
  largest bucket are split into several steps.
- With a prompt-as-decode size P > 1, every decode bucket B also has a [B, P] graph: its rows
  are running decodes (one real token) and prompts, or prompt tails, of at most P tokens. (P = 1
  needs no graph of its own: a one-token prompt already fits a plain decode row.)
- With speculative decoding of k drafts, a decoding row is 1 + k tokens wide: decode buckets are
  [B, 1 + k], and a [B, P] graph exists only where P is wider (narrower prompts fit the verify rows).
- With prompt scores (model.yaml's `runtime.prompt_logprobs`), every prefill bucket has a *score*
  twin of its shape, whose program also returns every position's log-probabilities: a prompt
  whose request asks for them (`echo` with `logprobs`) runs all its chunks there, never as a
  prompt-as-decode row.

The planner (`graphc.buckets.planner`) chooses the sizes from traffic.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

GraphKind = Literal["prefill", "score", "decode"]


@dataclass(frozen=True, order=True)
class Bucket:
    """One static graph shape: `rows` sequences of `width` tokens each."""

    kind: GraphKind
    size: int
    """Prefill and score: chunk tokens. Decode: batch size (rows)."""
    tokens_per_row: int = 1
    """Decode only: new tokens per row, 1 or the prompt-as-decode size P."""

    @property
    def rows(self) -> int:
        return self.size if self.kind == "decode" else 1

    @property
    def width(self) -> int:
        return self.tokens_per_row if self.kind == "decode" else self.size

    def head_rows(self, draft_tokens: int = 0) -> int:
        """The positions a step's LM head computes: every token of a score step; a row's last
        one otherwise, with `draft_tokens` k > 0 its 1 + k verified positions."""
        return self.rows * self.width if self.kind == "score" else self.rows * (1 + draft_tokens)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.size}" + (f"x{self.tokens_per_row}" if self.tokens_per_row > 1 else "")


def all_buckets(prefill: list[int], decode: list[int], prompt_as_decode: int = 0, draft_tokens: int = 0,
                prompt_logprobs: bool = False) -> list[Bucket]:
    return ([Bucket("prefill", s) for s in sorted(prefill)]
            + [Bucket("score", s) for s in sorted(prefill) if prompt_logprobs]
            + [Bucket("decode", s, width) for width in decode_widths(prompt_as_decode, draft_tokens) for s in sorted(decode)])


def decode_widths(prompt_as_decode: int, draft_tokens: int = 0) -> list[int]:
    """The widths of the decode buckets: a running decode's row (1 token, or with `draft_tokens`
    k, 1 + k: the token and its drafts), then the prompt-as-decode size P where it is wider."""
    verify = 1 + draft_tokens
    return [verify] + ([prompt_as_decode] if prompt_as_decode > verify else [])


def smallest_fitting(sizes: list[int], n: int) -> int:
    """The smallest of the sorted `sizes` that holds n.

    Raises:
        ValueError: n is not positive or larger than every size.
    """
    if n <= 0:
        raise ValueError(f"cannot fit {n} items; need at least 1")
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} is larger than the largest bucket ({sizes[-1]})")
    return sizes[i]


def chunk_lengths(length: int, max_chunk: int) -> list[int]:
    """Split `length` prompt tokens into chunks of `max_chunk` (the last may be shorter)."""
    if length <= 0 or max_chunk <= 0:
        raise ValueError(f"length ({length}) and max_chunk ({max_chunk}) must be positive")
    full, rest = divmod(length, max_chunk)
    return [max_chunk] * full + ([rest] if rest else [])


def max_prefill_chunk(prefill: list[int], max_num_prefilling_tokens: int) -> int:
    """The longest chunk one prefill step takes: the largest bucket within the token budget, or
    the budget itself (padded into the smallest bucket) when every bucket exceeds it."""
    return max((s for s in prefill if s <= max_num_prefilling_tokens), default=max_num_prefilling_tokens)
