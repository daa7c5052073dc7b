"""Prometheus metrics at /metrics, under vLLM's names with the `graphrunner:` prefix.

Engine state (running / waiting requests, KV-cache usage, prefix-cache queries and hits,
preemptions, steps by CUDA graph mode) is read when /metrics is scraped, so the step loop pays
nothing for it (an engine process reports it with its outputs, at most every 50 ms, and when
idle); per-request latencies and token counts are observed on the event loop from AsyncLLM's
stats listener, when the caller takes an output."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

PREFIX = "graphrunner:"


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self):
        stats = self.async_llm.engine_stats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (queued to the engine included).",
                    stats["num_waiting"] + self.async_llm.num_pending_adds)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats["kv_cache_usage"])
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.",
                    stats["prefix_cache_hit_rate"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats["prefix_cache_hits"])
        yield counter("num_preemptions", "Requests preempted (recomputed later) to free KV blocks.",
                      stats["num_preemptions"])
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Model steps by CUDA graph runtime mode "
                                    "(FULL, PIECEWISE, NONE = eager).", labels=labels + ["mode"])
        counts = stats.get("steps_by_mode", {})
        for mode in ("FULL", "PIECEWISE", "NONE"):
            steps.add_metric(values + [mode], counts.get(mode, 0))
        yield steps


class _Histogram:
    """A latency histogram observed on the event loop: a bisect and two additions, no lock (only the
    event loop observes, and /metrics renders on it too). prometheus_client's Histogram takes a lock
    and several calls per observation, ~5 us, paid once per streamed output."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1   # buckets are "<= bound"
        self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            total += count
            cumulative.append((bound, total))
        family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric(values, cumulative, self.sum)
        return family


class _RequestCollector:
    """Per-request latencies and token counts, accumulated by `ServerMetrics.observe` and turned
    into metric families when /metrics is scraped."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft, self.itl, self.e2e = _Histogram(_TTFT_BUCKETS), _Histogram(_ITL_BUCKETS), _Histogram(_E2E_BUCKETS)
        self.finished: dict[str, int] = {}

    def collect(self):
        labels, values = ["model_name"], [self.model_name]
        for name, doc, value in (("prompt_tokens", "Prompt tokens of requests that started generating.",
                                  self.prompt_tokens),
                                 ("generation_tokens", "Generated tokens.", self.generation_tokens)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        yield self.ttft.family("time_to_first_token_seconds", "Arrival to first token.", labels, values)
        yield self.itl.family("inter_token_latency_seconds", "Time between a request's tokens.", labels, values)
        yield self.e2e.family("e2e_request_latency_seconds", "Arrival to the last token.", labels, values)
        finished = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                       labels=labels + ["finished_reason"])
        for reason, count in self.finished.items():
            finished.add_metric(values + [reason], count)
        yield finished


class ServerMetrics:
    """The server's registry; `observe` is AsyncLLM's stats listener."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = _RequestCollector(model_name)
        self.registry.register(self.requests)
        self.registry.register(_EngineCollector(async_llm, model_name))

    def observe(self, event: str, request_id: str, stamp: float, **fields) -> None:
        requests = self.requests
        if event == "tokens":
            requests.itl.observe(fields["itl"])
            requests.generation_tokens += fields["num_tokens"]
        elif event == "first_token":
            requests.ttft.observe(fields["ttft"])
            requests.prompt_tokens += fields["num_prompt_tokens"]
            requests.generation_tokens += fields["num_tokens"]
        elif event == "finished":
            requests.e2e.observe(fields["e2e"])
            reason = fields["finish_reason"]
            requests.finished[reason] = requests.finished.get(reason, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
