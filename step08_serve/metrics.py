"""Prometheus text exposition for /metrics, written by hand: a few gauges, counters and two histograms."""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Cumulative-bucket histogram as Prometheus expects it (`_bucket{le=...}`, `_sum`, `_count`)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, name: str, help_text: str) -> list[str]:
        with self._lock:
            lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            cumulative = 0
            for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
                cumulative += n
                lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
            lines += [f"{name}_sum {self.total}", f"{name}_count {cumulative}"]
        return lines


def render_metric(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
