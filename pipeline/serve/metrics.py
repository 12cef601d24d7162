"""The replica's Prometheus metrics (through Ray): spec-decode counters named after vLLM's, latency,
time-to-first-token and tokens/s histograms, queue gauges. ``ServeMetrics.record(trace)`` takes one ended
decode's ``DecodeTrace``."""

from __future__ import annotations

from pipeline.serve.replica import DecodeTrace


LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


RATE_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


BATCH_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]


ITL_BUCKETS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5]


class ServeMetrics:
    """Prometheus metrics through Ray (``ray.serve.metrics`` adds the deployment, replica and
    application tags; Ray exports them on each node's metrics export port with a ``ray_`` prefix and,
    for counters, a ``_total`` suffix). Spec-decode counters are named after vLLM's
    (``vllm:spec_decode_num_drafts`` ...): drafts = verification rounds, draft tokens = the tree's
    draft nodes verified per round, accepted tokens, and accepted tokens per position (a ``position``
    tag: how often the k-th draft token of a round was accepted). Mean acceptance length =
    1 + accepted / drafts."""

    def __init__(self, model: str):
        from ray.serve import metrics

        tags = ("model",)
        self.drafts = metrics.Counter(
            "griffin_spec_decode_num_drafts", "Speculative rounds (target verification passes with a draft tree).", tags
        )
        self.draft_tokens = metrics.Counter(
            "griffin_spec_decode_num_draft_tokens",
            "Draft tokens verified (tree nodes below the root, per round).",
            tags,
        )
        self.accepted = metrics.Counter("griffin_spec_decode_num_accepted_tokens", "Draft tokens accepted.", tags)
        self.per_position = metrics.Counter(
            "griffin_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each depth of the accepted path.",
            (*tags, "position"),
        )
        self.latency = metrics.Histogram(
            "griffin_e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS, tags
        )
        self.ttft = metrics.Histogram(
            "griffin_time_to_first_token_seconds",
            "Arrival to the first token (queueing and prefill included).",
            TTFT_BUCKETS,
            tags,
        )
        self.rate = metrics.Histogram(
            "griffin_output_tokens_per_second",
            "Completion tokens per second of decode (prefill included, queueing not).",
            RATE_BUCKETS,
            tags,
        )
        self.waiting = metrics.Gauge(
            "griffin_num_requests_waiting", "Admitted completions waiting for the decode (the replica's queue).", tags
        )
        self.running = metrics.Gauge("griffin_num_requests_running", "Completions decoding.", tags)
        self.batch = metrics.Histogram(
            "griffin_batch_rows", "Rows (requests) decoded together per engine round.", BATCH_BUCKETS, tags
        )
        self.generated = metrics.Counter("griffin_generation_tokens", "Completion tokens generated.", tags)
        self.inter_token = metrics.Histogram(
            "griffin_inter_token_latency_seconds",
            "Seconds per token between a request's consecutive rounds (a round's tokens arrive together).",
            ITL_BUCKETS,
            tags,
        )
        for metric in (
            self.drafts,
            self.draft_tokens,
            self.accepted,
            self.per_position,
            self.latency,
            self.ttft,
            self.rate,
            self.waiting,
            self.running,
            self.batch,
            self.generated,
            self.inter_token,
        ):
            metric.set_default_tags({"model": model})

    def record(self, trace: DecodeTrace, drafted: list[int] | None = None) -> None:
        """One ended decode (abandoned ones too: their rounds ran); ``drafted``: the draft tokens each
        round verified (0 for a plain round: the policy's choice at that batch size), when known."""
        accepted = [len(r) - 1 for r in trace.rounds[1:]]  # the first callback is the prefill's token
        drafted = (drafted or [])[: len(accepted)]
        speculative = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
        if trace.speculative and speculative:
            self.drafts.inc(len(speculative))
            self.draft_tokens.inc(sum(d for _, d in speculative))
            if sum(a for a, _ in speculative):
                self.accepted.inc(sum(a for a, _ in speculative))
            for position in range(max(a for a, _ in speculative)):
                hits = sum(a > position for a, _ in speculative)
                self.per_position.inc(hits, tags={"position": str(position)})
        if trace.tokens:
            self.generated.inc(trace.tokens)
        for (before, after), tokens in zip(zip(trace.round_times, trace.round_times[1:]), trace.rounds[1:]):
            self.inter_token.observe((after - before) / len(tokens))
        if trace.first_token is not None:
            self.ttft.observe(trace.first_token - trace.arrived)
        if trace.ended is not None:
            self.latency.observe(trace.ended - trace.arrived)
            if trace.started is not None and trace.ended > trace.started:
                self.rate.observe(trace.tokens / (trace.ended - trace.started))

    def queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
