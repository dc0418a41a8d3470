"""Counters and gauges of the server, rendered in the Prometheus text format (0.0.4).

Written by hand (a dozen lines of text) rather than with prometheus_client: no extra dependency.
"""

from __future__ import annotations

from specdec.decoding.request import GenerationStats

from specdec.serving.pool import DecoderPool


class Metrics:
    """Counters for /metrics (Prometheus text format 0.0.4); updated on the event loop thread only."""

    def __init__(self):
        self.requests: dict = {}  # (route, status) -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # prompt tokens whose KV was reused (a worker's cache, or the prompt cache)
        self.completion_tokens = 0
        self.decode_seconds = 0.0
        self.proposed = 0
        self.accepted = 0
        self.disconnects = 0
        self.last_tokens_per_second = 0.0

    def count_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def add(self, stats: GenerationStats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.cached_prompt_tokens += getattr(stats, "cached_tokens", 0)
        self.completion_tokens += stats.new_tokens
        self.decode_seconds += stats.decode_seconds
        self.proposed += stats.proposed
        self.accepted += stats.accepted
        self.last_tokens_per_second = stats.tokens_per_s

    def render(self, pool: DecoderPool) -> str:
        lines = []

        def metric(name, kind, help_text, samples):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        metric("specdec_requests_total", "counter", "HTTP requests by route and status code",
               [(f'{{route="{route}",status="{status}"}}', count)
                for (route, status), count in sorted(self.requests.items())] or [("", 0)])
        metric("specdec_prompt_tokens_total", "counter", "prompt tokens of finished generations",
               [("", self.prompt_tokens)])
        metric("specdec_prompt_tokens_cached_total", "counter",
               "prompt tokens whose keys/values were reused, not computed",
               [("", self.cached_prompt_tokens)])
        metric("specdec_prompt_tokens_computed_total", "counter", "prompt tokens prefilled (computed)",
               [("", self.prompt_tokens - self.cached_prompt_tokens)])
        metric("specdec_completion_tokens_total", "counter", "generated tokens", [("", self.completion_tokens)])
        metric("specdec_decode_seconds_total", "counter", "time in decode loops (prefill excluded)",
               [("", round(self.decode_seconds, 6))])
        metric("specdec_decode_tokens_per_second", "gauge", "generated tokens per decode second, all requests",
               [("", round(self.completion_tokens / self.decode_seconds, 3) if self.decode_seconds else 0.0)])
        metric("specdec_last_decode_tokens_per_second", "gauge", "decode speed of the latest finished request",
               [("", round(self.last_tokens_per_second, 3))])
        metric("specdec_draft_tokens_proposed_total", "counter", "draft tokens proposed", [("", self.proposed)])
        metric("specdec_draft_tokens_accepted_total", "counter", "draft tokens accepted", [("", self.accepted)])
        metric("specdec_acceptance_rate", "gauge", "accepted / proposed draft tokens, all requests",
               [("", round(self.accepted / self.proposed, 6) if self.proposed else 0.0)])
        metric("specdec_queue_depth", "gauge", "requests waiting for a worker", [("", pool.waiting)])
        metric("specdec_workers_busy", "gauge", "workers generating", [("", pool.busy)])
        metric("specdec_workers", "gauge", "worker count (one KV cache each)", [("", pool.options.workers)])
        metric("specdec_cancelled_total", "counter", "generations cancelled (client gone or shutdown)",
               [("", pool.cancelled_jobs)])
        metric("specdec_routed_to_cache_total", "counter",
               "requests given to the worker whose KV cache already held part of their prompt",
               [("", getattr(pool, "routed_to_cache", 0))])
        cache = getattr(pool.decoder, "prompt_cache", None)
        if cache is not None:  # specdec serve --cache-ram
            stats = cache.stats()
            for key, kind, help_text in _PROMPT_CACHE:
                if key in stats:
                    suffix = "_total" if kind == "counter" else ""
                    metric(f"specdec_prompt_cache_{key}{suffix}", kind, help_text, [("", stats[key])])
        sessions = getattr(pool.decoder, "draft_sessions", None)
        if sessions is not None:  # closed on contexts too long for the draft to pay (runners/sessions.py)
            metric("specdec_draft_session_open", "gauge", "1 while the draft's session (its weights) is in memory",
                   [("", int(sessions.is_open))])
            metric("specdec_draft_session_closes_total", "counter",
                   "times the draft's session was closed on a context too long for it to pay", [("", sessions.closes)])
        suffix_cache = getattr(pool.decoder, "suffix_cache", None)
        if suffix_cache is not None:  # specdec serve --suffix-cache
            stats = suffix_cache.stats()
            for key, kind, help_text in _SUFFIX_CACHE:
                suffix = "_total" if kind == "counter" else ""
                metric(f"specdec_{key}{suffix}", kind, help_text, [("", stats[key])])
        return "\n".join(lines) + "\n"


_SUFFIX_CACHE = (  # SuffixCache.stats() key, metric kind, help
    ("suffix_cache_tokens", "gauge", "tokens of earlier outputs held for suffix proposals"),
    ("suffix_cache_bytes", "gauge", "bytes of the suffix store (--suffix-cache)"),
    ("suffix_cache_requests", "counter", "outputs added to the suffix store"),
    ("suffix_cache_evicted_tokens", "counter", "tokens of the oldest outputs dropped for room"),
)

_PROMPT_CACHE = (  # PromptCache.stats() key, metric kind, help
    ("hits", "counter", "prompt cache lookups that restored a prefix"),
    ("misses", "counter", "prompt cache lookups that found nothing better than the worker's own cache"),
    ("evictions", "counter", "prompt cache entries dropped for room"),
    ("stores", "counter", "KV snapshots stored in the prompt cache"),
    ("bytes", "gauge", "bytes held by the prompt cache"),
    ("capacity_bytes", "gauge", "the prompt cache's capacity (--cache-ram)"),
    ("entries", "gauge", "KV snapshots held by the prompt cache"),
)
