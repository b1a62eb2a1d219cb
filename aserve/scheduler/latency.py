"""Per-batch-size run time estimates, learned from warm-up and live batches."""

from __future__ import annotations

import math


class LatencyModel:
    """Estimated seconds to run a batch of each size (1..max_batch_size).

    Each measured size keeps an exponentially weighted mean, so the estimate
    follows slow drifts (thermal, other load); one observation can move it by
    at most a factor of two, so a single outlier cannot make admission control
    refuse every request that follows.
    Unmeasured sizes are interpolated linearly between measured neighbours;
    above the largest measured size the per-item cost of that size is
    extrapolated (an upper bound for the usual affine cost curve), below the
    smallest the smallest's time is used. With nothing measured every size
    estimates 0.0 and callers treat the model as "unknown".
    """

    __slots__ = ("_alpha", "_max", "_measured", "_table")

    def __init__(self, max_batch_size: int, alpha: float = 0.2) -> None:
        self._max = max_batch_size
        self._alpha = alpha
        self._measured: dict[int, float] = {}
        self._table: list[float] | None = None

    @property
    def known(self) -> bool:
        return bool(self._measured)

    def observe(self, size: int, seconds: float) -> None:
        size = min(max(size, 1), self._max)
        old = self._measured.get(size)
        if old is None:
            self._measured[size] = seconds
        else:
            # One outlier (a huge input on a variable-shape model, a stall) may
            # at most double or halve an estimate; a lasting change still wins
            # within a few batches.
            new = old + self._alpha * (seconds - old)
            self._measured[size] = min(max(new, old / 2), old * 2)
        self._table = None

    def estimate(self, size: int) -> float:
        if not self._measured:
            return 0.0
        if self._table is None:
            self._table = self._build()
        return self._table[min(max(size, 1), self._max)]

    def _build(self) -> list[float]:
        sizes = sorted(self._measured)
        table = [0.0] * (self._max + 1)
        for s in range(1, self._max + 1):
            if s in self._measured:
                table[s] = self._measured[s]
            elif s < sizes[0]:
                table[s] = self._measured[sizes[0]]
            elif s > sizes[-1]:
                top = sizes[-1]
                table[s] = self._measured[top] * s / top
            else:
                i = next(i for i, m in enumerate(sizes) if m > s)
                lo, hi = sizes[i - 1], sizes[i]
                frac = (s - lo) / (hi - lo)
                table[s] = self._measured[lo] + frac * (self._measured[hi] - self._measured[lo])
        return table

    def snapshot(self) -> dict[int, float]:
        """Measured sizes and their estimates, for statistics and logs."""
        return dict(sorted(self._measured.items()))


class ArrivalRate:
    """Requests per second arriving at one model, as an EWMA of the gaps.

    An idle spell makes the next gap long, so the rate drops at once and the
    batcher stops waiting for company that is not coming.
    """

    __slots__ = ("_gap", "_last")

    def __init__(self) -> None:
        self._last: float | None = None
        self._gap = math.inf

    def observe(self, now: float) -> None:
        if self._last is not None:
            gap = now - self._last
            if math.isinf(self._gap) or gap > 4 * self._gap:
                # A first gap, or one long pause that the old burst must not average away.
                self._gap = gap
            else:
                self._gap += 0.1 * (gap - self._gap)
        self._last = now

    def per_second(self, now: float) -> float:
        if self._last is None or math.isinf(self._gap):
            return 0.0
        # Silence since the last arrival also counts as a gap in progress.
        gap = max(self._gap, now - self._last)
        return 1.0 / gap if gap > 0 else math.inf
