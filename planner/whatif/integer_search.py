"""Integer searches behind the what-if questions, with the expensive evaluation injected (pure, testable).

Smallest GPU count for a deadline. Throughput is not monotonic in N: the data-parallel size must divide the
global batch and the pipeline split must divide N/tp, so N = 1032 can be slower than N = 1024. The search:

  1. bracket: N = one node, doubling (the last step capped at max_gpus), until rate(N) >= required;
  2. bisect the whole-node counts in (N/2, N] as if the predicate were monotonic, giving m (no bracket: m is
     max_gpus + one node);
  3. guard against non-monotonicity below m: with x* the best tokens/s per GPU seen at any evaluated count,
     no count below ceil(required / x*) can meet the deadline unless it beats every per-GPU rate seen; every
     untried whole-node count in [that bound, m) is a candidate. They are tried smallest first when there are at most
     `scan_limit`, else the `scan_limit` most batch-friendly ones (largest gcd with the global batch · node size,
     i.e. the most data-parallel sizes that divide the batch), and the answer says how many it skipped.

Largest model that fits: fits(k) is monotonic in the size knob k (memory grows with the model), so exponential
growth from the base size then bisection finds the largest k with fits(k), bounded by k_max.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

Rate = Callable[[int], float | None]  # tokens/s of the best plan on N GPUs, None when nothing fits


@dataclass(frozen=True)
class DeadlineSearch:
    """The smallest whole-node count found that reaches `required` tokens/s (None: none up to max_gpus)."""

    num_gpus: int | None
    required_tokens_per_s: float
    evaluated: dict[int, float | None]  # every count tried and its rate
    skipped: int = 0  # candidates below the answer that the scan limit left untried
    notes: list[str] = field(default_factory=list)

    @property
    def best_seen(self) -> tuple[int, float] | None:
        """The fastest evaluated count (for 'the most it could do' messages)."""
        ok = [(n, r) for n, r in self.evaluated.items() if r is not None]
        return max(ok, key=lambda nr: (nr[1], -nr[0])) if ok else None


class _Memo:
    def __init__(self, rate: Rate) -> None:
        self.rate = rate
        self.seen: dict[int, float | None] = {}

    def __call__(self, n: int) -> float | None:
        if n not in self.seen:
            self.seen[n] = self.rate(n)
        return self.seen[n]


def smallest_count_for_rate(
    rate: Rate,
    required: float,
    node: int,
    max_gpus: int,
    global_batch: int,
    scan_limit: int = 12,
    on_eval: Callable[[int], None] | None = None,
) -> DeadlineSearch:
    """Smallest multiple of `node` (or `node` itself) with rate >= required; see the module docstring."""
    assert required > 0 and node >= 1 and max_gpus >= 1 and scan_limit >= 0

    def meets(n: int) -> bool:
        if on_eval is not None and n not in memo.seen:
            on_eval(n)
        r = memo(n)
        return r is not None and r >= required

    memo = _Memo(rate)
    top = max(node, max_gpus // node * node)
    n: int | None = node
    while n is not None and not meets(n):
        n = None if n >= top else min(2 * n, top)
    if n is not None:  # bisect the node counts between the last failure and n
        lo_nodes, hi_nodes = n // node // 2, n // node
        while hi_nodes - lo_nodes > 1:
            mid = (lo_nodes + hi_nodes) // 2
            if meets(mid * node):
                hi_nodes = mid
            else:
                lo_nodes = mid
    else:
        hi_nodes = top // node + 1
    best = hi_nodes * node if n is not None else None
    rated = [r / k for k, r in memo.seen.items() if r is not None]
    if not rated:
        return DeadlineSearch(
            None, required, dict(memo.seen), notes=[f"no layout fits on any count tried up to {top} GPUs"]
        )
    floor_nodes = max(1, math.ceil(required / max(rated) / node))
    window = [k * node for k in range(floor_nodes, hi_nodes) if k * node not in memo.seen]
    skipped = 0
    if len(window) > scan_limit:
        friendly = sorted(window, key=lambda c: (-math.gcd(c, global_batch * node), c))[:scan_limit]
        skipped = len(window) - scan_limit
        window = sorted(friendly)
    for c in window:
        if meets(c):
            best = c
            break
    how = "bracketed by doubling, bisected," if n is not None else f"doubling up to {top} GPUs found none;"
    notes = [
        f"{how} then checked {len(window)} counts that per-GPU throughput seen so far allows"
        + (f" ({skipped} less batch-friendly ones skipped)" if skipped else "")
    ]
    return DeadlineSearch(best, required, dict(memo.seen), skipped=skipped, notes=notes)


@dataclass(frozen=True)
class GrowthSearch:
    """The largest size knob k that fits (None: not even k_min), and the smallest that did not."""

    largest: int | None
    first_failure: int | None
    tried: dict[int, bool]


def largest_fitting(
    fits: Callable[[int], bool], k_start: int, k_min: int, k_max: int, on_eval: Callable[[int], None] | None = None
) -> GrowthSearch:
    """Largest k in [k_min, k_max] with fits(k), assuming fits is monotonic (True then False)."""
    assert 1 <= k_min <= k_start <= k_max
    tried: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            if on_eval is not None:
                on_eval(k)
            tried[k] = fits(k)
        return tried[k]

    if ok(k_start):
        lo, hi = k_start, None
        k = k_start
        while hi is None:
            if k >= k_max:
                return GrowthSearch(k, None, tried)  # fits at the bound: the answer is capped
            k = min(2 * k, k_max)
            if ok(k):
                lo = k
            else:
                hi = k
    else:
        hi = k_start
        if not ok(k_min):
            return GrowthSearch(None, k_min, tried)
        lo = k_min
    best = _bisect(ok, lo, hi)
    return GrowthSearch(best, best + 1, tried)


def _bisect(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest k in [lo, hi) with ok(k), given ok(lo) and not ok(hi) (hi exclusive if it fails)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
