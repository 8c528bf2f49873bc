"""Planning buckets from traffic: the sizes that minimise expected padding for a workload.

Pure functions (no torch) used by `graphc plan`, `buckets.auto` in model.yaml and the benchmarks.
"""

from __future__ import annotations
from dataclasses import dataclass

from graphc.buckets.selection import chunk_lengths, smallest_fitting

Histogram = dict[int, int]
"""Length -> how many times it occurs (prompt lengths, chunk lengths or batch sizes)."""


def chunk_histogram(prompt_lengths: Histogram, max_chunk: int) -> Histogram:
    """The prefill chunks the runtime makes of these prompts (`chunk_lengths` of each)."""
    chunks: Histogram = {}
    for length, count in prompt_lengths.items():
        for chunk in chunk_lengths(length, max_chunk):
            chunks[chunk] = chunks.get(chunk, 0) + count
    return chunks


def padding_waste(histogram: Histogram, buckets: list[int]) -> dict[int, int]:
    """Padded items per bucket when every length runs in the smallest bucket that holds it."""
    sizes = sorted(buckets)
    waste = dict.fromkeys(sizes, 0)
    for length, count in histogram.items():
        bucket = smallest_fitting(sizes, length)
        waste[bucket] += count * (bucket - length)
    return waste


def optimal_buckets(histogram: Histogram, count: int, limit: int) -> list[int]:
    """The `count` (or fewer, if fewer distinct lengths) sizes, the largest `limit`, that minimise
    the padded items over `histogram` (every length in 1..limit).

    Exact: some optimal set puts every bucket but the largest on an occurring length (moving a
    bucket down to the largest length it holds only removes padding), so a dynamic programme
    over the sorted distinct lengths — best[j][i]: the least waste for the lengths up to the i-th
    with j buckets, the last at the i-th length — finds it; each layer of the programme takes
    O(m log m) cost evaluations for m distinct lengths (`_next_layer`).
    """
    if count < 1:
        raise ValueError(f"need at least one bucket, not {count}")
    if any(not 1 <= n <= limit for n in histogram):
        raise ValueError(f"lengths must lie in 1..{limit}; got {min(histogram)}..{max(histogram)}")
    points = sorted(set(histogram) | {limit})  # candidate bucket sizes; the largest is the limit
    counts = [histogram.get(p, 0) for p in points]
    # cost(a, b): waste of the lengths points[a+1..b] in the bucket points[b], via prefix sums.
    items, tokens = [0], [0]
    for p, c in zip(points, counts):
        items.append(items[-1] + c)
        tokens.append(tokens[-1] + p * c)

    def cost(a: int, b: int) -> int:  # lengths with index in (a, b]
        return points[b] * (items[b + 1] - items[a + 1]) - (tokens[b + 1] - tokens[a + 1])

    m = len(points)
    count = min(count, m)
    best = [[cost(-1, i) for i in range(m)]]  # one bucket, at points[i], holding everything up to it
    choice = [[-1] * m]
    for _ in range(1, count):
        row, picks = _next_layer(best[-1], cost, m)
        best.append(row)
        choice.append(picks)
    j = min(range(count), key=lambda j: best[j][m - 1])  # fewer buckets can be as good
    sizes, i = [], m - 1
    while i >= 0:
        sizes.append(points[i])
        i, j = choice[j][i], j - 1
    return sorted(sizes)


def _next_layer(previous: list[float], cost, m: int) -> tuple[list[float], list[int]]:
    """row[i] = min over k < i of previous[k] + cost(k, i), with the minimising k.

    The best k never decreases as i grows (the padding cost is Monge: it is the classic 1-D
    clustering recurrence), so divide and conquer computes the row in O(m log m) evaluations
    instead of O(m^2); tests check it against brute force."""
    row, picks = [float("inf")] * m, [-1] * m

    def solve(lo: int, hi: int, k_lo: int, k_hi: int) -> None:
        if lo > hi:
            return
        mid = (lo + hi) // 2
        for k in range(k_lo, min(mid - 1, k_hi) + 1):
            total = previous[k] + cost(k, mid)
            if total < row[mid]:
                row[mid], picks[mid] = total, k
        split = picks[mid] if picks[mid] >= 0 else k_lo
        solve(lo, mid - 1, k_lo, split)
        solve(mid + 1, hi, split, k_hi)

    solve(1, m - 1, 0, m - 2)
    return row, picks


def power_of_two_ladder(count: int, limit: int) -> list[int]:
    """The usual hard-coded ladder: `limit`, limit/2, limit/4, ... (`count` sizes, at least 1)."""
    return sorted({max(1, limit >> i) for i in range(count)})


def read_workload(path) -> Histogram:
    """Prompt lengths from a text file: one length per line, or `length count` per line (a
    histogram); blank lines and `#` comments are ignored.

    Raises:
        ValueError: a line is not one or two positive integers (the line is named).
    """
    histogram: Histogram = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            try:
                values = [int(v) for v in fields]
            except ValueError:
                values = []
            if len(values) not in (1, 2) or min(values) < 1:
                raise ValueError(f"{path}:{number}: expected a prompt length or `length count` (positive "
                                 f"integers), got {line.strip()!r}")
            length, count = values if len(values) == 2 else (values[0], 1)
            histogram[length] = histogram.get(length, 0) + count
    if not histogram:
        raise ValueError(f"{path}: no prompt lengths in the file")
    return histogram


@dataclass(frozen=True)
class BucketPlan:
    """What `plan_buckets` chose, and the padding it expects (tokens per request on average)."""

    prefill: list[int]
    decode: list[int]
    prompt_as_decode: int
    prefill_waste: dict[int, float]
    """Expected padded tokens per request in each prefill bucket (chunks as the runtime makes them)."""
    ladder: list[int]
    """The power-of-two ladder with as many prefill graphs, for comparison."""
    ladder_waste: dict[int, float]
    ladder_match: int
    """The fewest planned prefill graphs whose waste is at most the ladder's."""
    decode_waste: float
    """Expected padded rows per decode step, batch sizes uniform over 1..max_decode_batch."""

    @property
    def graphs(self) -> int:
        """Graphs per rank: prefill, decode, and prompt-as-decode ([B, P] per decode bucket, P > 1)."""
        return len(self.prefill) + len(self.decode) * (2 if self.prompt_as_decode > 1 else 1)


def plan_buckets(prompt_lengths: Histogram, graphs: int, context_limit: int, max_num_prefilling_tokens: int,
                 max_decode_batch: int) -> BucketPlan:
    """Buckets for a workload within a budget of graphs per rank.

    - Prefill: chunks are what the runtime makes of the prompts (the largest chunk is
      min(context_limit - 1, max_num_prefilling_tokens), which is the largest bucket); the
      buckets minimise expected padded tokens exactly (`optimal_buckets`).
    - Decode: a quarter of the budget (at least one graph, at most max_decode_batch), the largest
      max_decode_batch, minimising padded rows for batch sizes uniform over 1..max_decode_batch
      (the batch follows the traffic's concurrency, which a prompt-length file does not tell).
    - Prompt-as-decode P = smallest prefill bucket // max_decode_batch: a full [B, P] step then
      never computes more tokens than the prefill step it saves. P > 1 costs one more graph per
      decode bucket (counted in the budget); P = 1 costs none.

    Raises:
        ValueError: the budget cannot hold one prefill and one decode graph, or a length is
            outside 1..context_limit - 1.
    """
    if graphs < 2:
        raise ValueError(f"a budget of {graphs} graphs cannot hold one prefill and one decode graph; need >= 2")
    too_long = [n for n in prompt_lengths if not 1 <= n < context_limit]
    if too_long:
        raise ValueError(f"prompt length {too_long[0]} is outside 1..{context_limit - 1} (context_limit {context_limit})")
    max_chunk = min(context_limit - 1, max_num_prefilling_tokens)
    chunks = chunk_histogram(prompt_lengths, max_chunk)
    requests = sum(prompt_lengths.values())
    batches = dict.fromkeys(range(1, max_decode_batch + 1), 1)
    decode = optimal_buckets(batches, max(1, min(max_decode_batch, graphs // 4)), max_decode_batch)
    prefill = optimal_buckets(chunks, graphs - len(decode), max_chunk)
    prompt_as_decode = max(1, prefill[0] // max_decode_batch)
    if prompt_as_decode > 1:
        if graphs - 2 * len(decode) < 1:
            prompt_as_decode = 1
        else:
            prefill = optimal_buckets(chunks, graphs - 2 * len(decode), max_chunk)
            prompt_as_decode = max(1, prefill[0] // max_decode_batch)
    ladder = power_of_two_ladder(len(prefill), max_chunk)
    ladder_total = sum(padding_waste(chunks, ladder).values())
    ladder_match = next(n for n in range(1, len(ladder) + 1)
                        if sum(padding_waste(chunks, optimal_buckets(chunks, n, max_chunk)).values()) <= ladder_total)

    def per_request(waste: dict[int, int]) -> dict[int, float]:
        return {b: w / requests for b, w in waste.items()}

    return BucketPlan(
        prefill=prefill, decode=decode, prompt_as_decode=prompt_as_decode,
        prefill_waste=per_request(padding_waste(chunks, prefill)), ladder=ladder,
        ladder_waste=per_request(padding_waste(chunks, ladder)), ladder_match=ladder_match,
        decode_waste=sum(padding_waste(batches, decode).values()) / max_decode_batch,
    )
