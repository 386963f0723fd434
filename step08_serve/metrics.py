"""What `/metrics` reports, with `prometheus_client`, in the Prometheus text format.

Two sources. The step loop counts what passes through it (requests finished and aborted, tokens, steps)
and times each request (time to first token, time per output token after it). The engine says what its
scheduler holds through `Engine.stats()`, read at each scrape, so every step's own numbers (step 07's
preemptions, say) appear without the server knowing which step it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.engine import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# No `*_created` timestamp next to every counter and histogram: they double what a reader of /metrics sees.
disable_created_metrics()

# What the numbers of `Engine.stats()` are. One not listed here is still exported: as a counter if its name
# ends in `_total` (the Prometheus convention), else as a gauge, so a later step's numbers need nothing here.
ENGINE_STATS: dict[str, tuple[type[Metric], str]] = {
    "requests_running": (GaugeMetricFamily, "Requests admitted to the engine."),
    "requests_waiting": (GaugeMetricFamily, "Requests queued for admission."),
    "kv_blocks_used": (GaugeMetricFamily, "KV cache blocks in use."),
    "kv_blocks_total": (GaugeMetricFamily, "KV cache blocks in the pool."),
    "preemptions_total": (CounterMetricFamily, "Running requests preempted."),
    "requests_swapped": (GaugeMetricFamily, "Requests whose KV cache waits in host memory."),
    "swapped_out_blocks_total": (CounterMetricFamily, "KV blocks copied to host memory."),
}


class EngineStats(Collector):
    """Every number of `engine.stats()`, read when /metrics is scraped, as `llm_<name>`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        for name, value in self.engine.stats().items():
            unlisted = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            family, help_text = ENGINE_STATS.get(name, (unlisted, f"Engine.stats()[{name!r}]."))
            yield family(f"llm_{name}", help_text, value=value)


class ServingMetrics:
    """The metrics of one served engine, on a registry of their own rather than prometheus_client's global
    one, so that several servers in one process (as in the tests) do not collide."""

    def __init__(self, engine: Engine, open_streams: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStats(engine))
        ProcessCollector(registry=self.registry)  # the process's resident memory and CPU time: a leak shows here
        Gauge("llm_open_streams", "HTTP-side request queues open.", registry=self.registry).set_function(open_streams)
        # Counted by the step loop.
        self.requests_added = Counter("llm_requests_added", "Requests that reached the engine.", registry=self.registry)
        self.requests_finished = Counter("llm_requests_finished", "Requests that finished.", registry=self.registry)
        self.requests_aborted = Counter("llm_requests_aborted", "Requests aborted (client gone).",
                                        registry=self.registry)
        self.slow_readers_dropped = Counter("llm_slow_readers_dropped", "Streams dropped: too many outputs unread.",
                                            registry=self.registry)
        self.generation_tokens = Counter("llm_generation_tokens", "Tokens generated.", registry=self.registry)
        self.engine_steps = Counter("llm_engine_steps", "Engine steps run.", registry=self.registry)
        self.ttft_seconds = Histogram("llm_time_to_first_token_seconds", "Time to first token.",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot_seconds = Histogram("llm_time_per_output_token_seconds", "Time per output token after the first.",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """Everything, in the Prometheus text format."""
        return generate_latest(self.registry)
