"""Prometheus metrics of a served store (one registry per server, scraped at ``/metrics``).

Names carry their units (``_seconds``, ``_bytes``, ``_total``). Gauges of live state
(open sessions, ``kv_live_bytes`` summed over sessions) are computed at scrape time from
the store, so they can never drift from it. Admission outcomes are ``admitted``,
``evicted`` (a slot freed by evicting an idle session), ``queued`` (waited) and
``rejected``; closed sessions carry their reason (``closed``, ``evicted_implicit``,
``evicted_lru``, ``expired_implicit``).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)

from kakeya_lab.serve.memory import heap_in_use_bytes

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """Counters and histograms updated by :class:`~kakeya_lab.serve.sessions.ServedSessions`."""

    def __init__(
        self,
        open_sessions: Callable[[], float],
        kv_live_bytes: Callable[[], float],
        admission_waiting: Callable[[], float] = lambda: 0.0,
    ):
        disable_created_metrics()  # no *_created series: they only add noise to scrapes
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, cpu seconds
        Gauge("kakeya_sessions_open", "Open sessions", registry=r).set_function(open_sessions)
        Gauge(
            "kakeya_kv_live_bytes", "Bytes of K and V held by all sessions' caches", registry=r
        ).set_function(kv_live_bytes)
        Gauge(
            "kakeya_heap_in_use_bytes",
            "Bytes the C allocator has handed out and not had back (live heap; unlike the "
            "resident size it leaves out freed memory the allocator keeps)",
            registry=r,
        ).set_function(heap_in_use_bytes)
        Gauge(
            "kakeya_admission_waiting", "Session creations waiting in the queue", registry=r
        ).set_function(admission_waiting)
        self.sessions_created = Counter(
            "kakeya_sessions_created_total", "Sessions created", ["origin"], registry=r
        )
        self.sessions_closed = Counter(
            "kakeya_sessions_closed_total", "Sessions closed", ["reason"], registry=r
        )
        self.admission = Counter(
            "kakeya_admission_total", "Session admission outcomes", ["outcome"], registry=r
        )
        self.appended_tokens = Counter(
            "kakeya_appended_tokens_total", "Tokens prefilled by appends", registry=r
        )
        self.generated_tokens = Counter(
            "kakeya_generated_tokens_total",
            "Tokens delivered by generation streams (and kept: a retracted one never counts)",
            registry=r,
        )
        self.prefix_reuse = Counter(
            "kakeya_prefix_reuse_total",
            "HTTP requests by session reuse outcome",
            ["result"],
            registry=r,
        )
        self.reused_tokens = Counter(
            "kakeya_reused_prompt_tokens_total",
            "Prompt tokens served from an existing session (not prefilled)",
            registry=r,
        )
        self.streams_ended = Counter(
            "kakeya_streams_total", "Generation streams by how they ended", ["end"], registry=r
        )
        self.errors = Counter(
            "kakeya_request_errors_total", "Failed requests by status", ["status"], registry=r
        )
        self.append_latency = Histogram(
            "kakeya_append_latency_seconds",
            "Append (prefill) latency",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.first_token_latency = Histogram(
            "kakeya_first_token_latency_seconds",
            "Generate call to first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.token_latency = Histogram(
            "kakeya_inter_token_latency_seconds",
            "Time between delivered tokens",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.request_latency = Histogram(
            "kakeya_request_latency_seconds",
            "Whole request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
