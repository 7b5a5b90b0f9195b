"""Prometheus metrics (prometheus-client), labelled by extension method where it matters.

Request-level metrics are recorded by the server as responses stream; the engine's own
state (running and waiting requests, KV-cache use) comes from a vLLM stat logger, which the
engine calls after every scheduling step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.loggers import StatLoggerBase

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)


class Metrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rope_extend_requests", "Finished requests by outcome", ["method", "outcome"],
                                registry=r)
        self.time_to_first_token = Histogram("rope_extend_time_to_first_token_seconds", "Time to first token",
                                             ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("rope_extend_inter_token_latency_seconds",
                                             "Time between output tokens (streamed)", ["method"],
                                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.end_to_end_latency = Histogram("rope_extend_e2e_request_latency_seconds", "Request latency, end to end",
                                            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rope_extend_prompt_tokens", "Prompt tokens processed", ["method"], registry=r)
        self.generation_tokens = Counter("rope_extend_generation_tokens", "Tokens generated", ["method"], registry=r)
        self.running = Gauge("rope_extend_num_requests_running", "Requests in the engine's running batch", registry=r)
        self.waiting = Gauge("rope_extend_num_requests_waiting", "Requests waiting in the engine", registry=r)
        self.in_flight = Gauge("rope_extend_num_requests_in_flight", "Requests admitted by the server, not yet done",
                               registry=r)
        self.kv_cache_usage = Gauge("rope_extend_kv_cache_usage_perc", "Fraction of KV-cache blocks in use", registry=r)

    def engine_gone(self) -> None:
        """The engine died: nothing runs, waits or holds cache any more (its last report would stay)."""
        for gauge in (self.running, self.waiting, self.kv_cache_usage):
            gauge.set(0)

    def stat_logger_factory(self):
        """A vLLM ``StatLoggerFactory`` feeding this registry's engine gauges."""
        metrics = self

        class EngineGauges(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    metrics.running.set(scheduler_stats.num_running_reqs)
                    metrics.waiting.set(scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs)
                    metrics.kv_cache_usage.set(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self):
                pass

        return EngineGauges
