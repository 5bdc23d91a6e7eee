"""The server's Prometheus metrics: the engine's counters and gauges as the engine thread last saw them, and the
request latencies the server measures (TTFT, inter-token latency, end to end) as histograms. Names carry the
`paxkv:` prefix, as vLLM's carry `vllm:`."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paxkv.serving.engine_loop import EngineLoop

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from 1 ms (a small model's decode step) to minutes (a long prompt on a CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """Collects the engine's metrics at scrape time from the loop's last snapshot (never from a step in flight)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        """Yield one metric family per engine counter or gauge."""
        state = self.loop.state
        metrics = state.metrics

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"paxkv:{name}", documentation, value=value)

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"paxkv:{name}", documentation, value=value)

        yield gauge("num_requests_running", "Requests in the engine's running batch.", state.num_running)
        yield gauge("num_requests_waiting", "Requests admitted and waiting for the engine.", self.loop.num_pending)
        yield gauge(
            "kv_pages_used", "KV pages that running requests hold (a shared page counts once).", metrics.kv_pages_used
        )
        yield gauge("kv_pages_free", "KV pages on the free list.", metrics.kv_pages_free)
        yield gauge(
            "kv_pages_cached_idle", "KV pages only the prefix cache holds (reclaimable).", metrics.kv_pages_cached_idle
        )
        yield gauge("kv_pages_total", "Usable KV pages in the pool.", metrics.num_total_pages)
        yield gauge(
            "kv_waste_ratio", "Allocated but unfilled KV token slots over allocated slots, over all steps.",
            metrics.kv_waste_fraction,
        )  # fmt: skip
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", metrics.prefix_query_tokens
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", metrics.prefix_hit_tokens)
        preemptions = CounterMetricFamily("paxkv:num_preemptions", "Requests preempted, by kind.", labels=["kind"])
        preemptions.add_metric(["recompute"], metrics.num_preemptions_recompute)
        preemptions.add_metric(["swap"], metrics.num_preemptions_swap)
        yield preemptions
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", metrics.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", metrics.num_generated_tokens)
        yield counter("request_success", "Requests finished.", metrics.num_finished_requests)
        yield counter("request_aborted", "Requests aborted (client gone, or shutdown).", metrics.num_aborted_requests)
        yield counter("num_steps", "Engine steps run.", metrics.num_steps)


class ServerMetrics:
    """The server's registry: the engine collector and the latency histograms the request handlers observe."""

    def __init__(self, loop: EngineLoop):
        """Args:
        loop: the engine loop whose snapshot the engine metrics read.
        """
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(loop))

        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(f"paxkv:{name}", documentation, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "From arrival to the first token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Between consecutive tokens of a request.")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "From arrival to the last token.")

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
