"""The decoding deployment: the target + a GRIFFIN draft, decoding its requests together. It has no HTTP of its
own: ``pipeline.serve.ingress`` (the HTTP edge) calls it through a streaming ``DeploymentHandle``, so
the ingress outlives a decoder replica that dies and can tell that replica's clients.

``complete(raw, chat)`` is one completion: the body is parsed, validated and tokenized here (the one
place that does: it needs the tokenizer, its chat template and the context window) and the first item
it yields is a ``Reply``: an error or a whole answer, or ``stream=True``, after which it yields the
stream's server-sent events. Every completion carries ``usage`` and a ``speculative`` block (rounds =
target verification passes, accepted draft tokens, acceptance length tau = sum(accepted + 1) / rounds;
``token_ids`` on request). Extension: ``"speculative": false`` decodes without the draft, for A/B
comparisons through the endpoint. Bad input -> a 4xx ``Reply`` naming the field, never a 500; the
replica keeps serving. docs/serving.md is the user's guide (bad-input table, config knobs, metrics).

A replica decodes up to ``serve.max_batch`` requests together in one batching engine, in a thread of
its own (``pipeline.serve.replica``), so the event loop stays free for ``health`` and queued requests;
scale further with replicas or autoscaling. Admission is the ingress's (``relay.Admission``): it sends a
replica ``serve.max_ongoing_requests`` completions (up to ``max_batch`` decoding, the rest waiting for a
slot, first come first served) and sheds the rest; parsing and tokenization run in worker threads.
Streams are live: the decode's per-round ``on_tokens`` callback detokenizes in the engine thread and hands text
deltas to the event loop, which yields each as a chunk at once. A stop sequence, or the ingress
cancelling the call (its client went away, Serve's request timeout) ends the decode at its next round;
a request cancelled while queued never decodes. Metrics: ``ServeMetrics`` (Prometheus through Ray).
"""

import asyncio
import collections
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from ray import serve

from griffin.results import GenerationResult, LogprobRecorder
from griffin.policy import SpeculationPolicy
from pipeline.config import RunConfig, config_from_dict
from pipeline.serve.replica import (
    DecodeTrace,
    Job,
    ReplicaEngine,
    check_progress,
    decode_request,
    last_item,
    stream_rounds,
)
from pipeline.serve.errors import Reply, internal_error
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    LogprobFormatter,
    SamplingRequest,
    completion_text,
    content_tokens,
    parse_request,
    prompt_and_budget,
    speculative_block,
    stop_sequences,
)
from pipeline.serve.sse import StreamLogprobs, TextStream, sse_stream

logger = logging.getLogger("ray.serve")


def served_model_name(cfg: RunConfig) -> str:
    return cfg.serve.model_name or cfg.target_slug


def public_name(source: str | None) -> str | None:
    """How /v1/models names a model: a URI (``models:/NAME/VERSION``, ``runs:/ID/draft``) or a hub id as
    it is; a local directory by its last two parts (``.../drafts/smollm2-135m-instruct/griffin`` ->
    ``smollm2-135m-instruct/griffin``), never a path of the serving machine."""
    if source is None or ":/" in source:
        return source
    path = Path(source).expanduser()
    if not (path.is_absolute() or source.startswith(".") or path.exists()):
        return source  # a hub id (org/name)
    return "/".join([part for part in path.parts if part != path.anchor][-2:])


@serve.deployment
class SpeculativeDecoder:
    """One replica: the target and (when ``serve.draft_uri`` is set) a draft, decoding up to
    ``serve.max_batch`` requests together in one engine (``ReplicaEngine``), with the tree the
    speculation policy gives for the batch size (``decode.policy``).

    The ingress sends it about ``serve.max_ongoing_requests`` completions at once (up to max_batch
    decoding, the rest waiting for a slot, first come first served; more while a burst fills the
    queue, pipeline.serve.relay.Admission). Serve gives the replica ``control_slots`` more slots than
    the application admits, so ``health``, ``models`` and ``stats`` never queue behind completions."""

    def __init__(self, run_config: dict[str, Any]):
        from pipeline.resources.drafts import load_draft_uri
        from pipeline.resources.targets import load_decoding_target

        cfg = config_from_dict(run_config)
        self.target = load_decoding_target(cfg)
        self.draft_uri = cfg.serve.draft_uri
        self.draft = load_draft_uri(self.draft_uri, self.target, cfg) if self.draft_uri else None
        self.model_id, self.tree = served_model_name(cfg), cfg.decode.tree
        self.sampling_tree = cfg.decode.sampling_tree
        self.policy = cfg.speculation_policy if self.draft is not None else SpeculationPolicy({1: None})
        self.default_max_tokens = cfg.serve.default_max_tokens
        self.limits = cfg.serve
        self.admitted = 0  # completions here: decoding, or waiting for an engine slot
        self.live: set[DecodeTrace] = set()  # completions handed to the engine and not over yet
        self.recent: collections.deque[DecodeTrace] = collections.deque(maxlen=64)
        self.created = int(time.time())
        self.metrics = self._metrics()
        self.engine = ReplicaEngine(
            self.target, self.draft, self.policy, cfg.serve.max_batch, self._on_round, cfg.serve.retry_after_s
        )
        logger.info("serving %s with %s", self.model_id, f"draft {self.draft_uri}" if self.draft else "no draft")

    def _metrics(self) -> ServeMetrics | None:
        try:
            return ServeMetrics(self.model_id)
        except Exception:  # metrics are an aid: never a reason not to serve
            logger.exception("Ray metrics unavailable; serving without them")
            return None

    # ---- cheap calls: never behind a decode ----
    async def health(self) -> Reply:
        """GET /health: answers from the event loop at once, 503 when the running decode is wedged
        (the same test as Serve's ``check_health``)."""
        try:
            self._check_progress()
        except RuntimeError as error:
            status = "failed" if self.engine.failure is not None else "wedged"
            return Reply(503, {"status": status, "model": self.model_id, "detail": str(error)})
        body = {"status": "ok", "model": self.model_id, "running": self.engine.active}
        return Reply(200, {**body, "waiting": self._waiting()})

    async def check_health(self) -> None:
        """Serve's replica health check (every health_check_period_s): a failed engine or a wedged decode
        fails it, and Serve replaces the replica."""
        self._check_progress()

    def _check_progress(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"the decoding engine failed ({type(self.engine.failure).__name__}): replacing it")
        for trace in list(self.live):  # a snapshot: the event loop adds and removes traces
            check_progress(trace, self.limits.stall_timeout_s)

    async def stats(self) -> dict[str, Any]:
        """GET /stats: the replica's counters and its recent requests (the Prometheus metrics, readable
        without Prometheus)."""
        return {
            "model": self.model_id,
            "admitted": self.admitted,
            "running": self.engine.active,
            "waiting": self._waiting(),
            "max_ongoing_requests": self.limits.max_ongoing_requests,
            "max_batch": self.limits.max_batch,
            "rounds": self.engine.engine.rounds,
            "policy": self.policy.describe(),
            "sampling_tree": self._sampling_tree(),
            "sampling_policy": self.policy.describe_sampling(),
            "metrics_exported": self.metrics is not None,
            "recent": [trace.summary() for trace in list(self.recent)],
        }  # a snapshot: workers append to it

    def _sampling_tree(self) -> dict | None:
        """The tree of rounds whose drafting rows all sample (``decode.sampling_tree``), if any."""
        tree = self.sampling_tree if self.draft is not None else None
        return tree.model_dump() if tree is not None else None

    async def models(self) -> dict[str, Any]:
        """GET /v1/models."""
        card = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "griffin",
            "target": public_name(self.target.name),
            "draft": public_name(self.draft_uri),
            "speculative": self.draft is not None,
            "decoding": "griffin speculative" if self.draft is not None else "vanilla (no draft configured)",
            "tree": self.tree.model_dump(),
            "policy": self.policy.describe() if self.draft is not None else None,
            "sampling_tree": self._sampling_tree(),
            "sampling_policy": self.policy.describe_sampling() if self.draft is not None else None,
            "max_batch": self.limits.max_batch,
            "max_context": self.target.max_context,
            "torch_threads": torch.get_num_threads(),
        }  # Ray gives a replica one thread per serve.num_cpus
        return {"object": "list", "data": [card]}

    # ---- completions ----
    async def complete(self, raw: bytes, chat: bool) -> AsyncIterator[Reply | str]:
        """One completion from its raw body (the ingress admitted it and read it, within
        serve.max_body_bytes): parse off the event loop, decode; yields the ``Reply``, then a stream's
        events. The count of completions here drops when the generator ends, however it ends (the
        ingress cancels it when its client goes away)."""
        arrived = time.monotonic()
        self._admit(+1)
        job: Job | None = None
        streaming = False
        try:
            # parsing a 1 MiB body, validating and tokenizing take milliseconds to seconds: not on the loop
            job = await asyncio.to_thread(self._job, raw, ChatRequest if chat else CompletionRequest, arrived)
            if not job.req.stream:
                yield Reply(200, self._answer(job, await last_item(self._decode(job))))
                return
            streaming = True
            yield Reply(200, stream=True)
            async with contextlib.aclosing(self._events(job)) as events:
                async for event in events:
                    yield event
        except ApiError as error:  # raised before a stream starts: sse_stream reports decode errors in-band
            yield Reply.of(error)
        except Exception:  # a bug, not the client's fault: say so (not what it was) and keep serving
            if streaming:
                raise  # the 200 is out: the ingress ends the stream with an error chunk
            yield Reply.of(internal_error(logger, "generation failed"))
        finally:
            self._leave(job)

    def _admit(self, change: int) -> None:
        self.admitted += change
        self._gauges()

    def _leave(self, job: "Job | None") -> None:
        """An admitted request is done: free its slot; one that left before its decode began (client
        gone or timed out while queued) is recorded as abandoned, with no round run."""
        self._admit(-1)
        if job is not None and job.trace.ended is None:
            job.trace.end("abandoned")
            self.recent.append(job.trace)

    def _waiting(self) -> int:
        return max(self.admitted - self.engine.active, 0)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self._waiting(), self.engine.active)

    def _on_round(self, rows: int) -> None:
        """The engine ran a round of ``rows`` rows (its thread)."""
        if self.metrics is not None:
            self.metrics.batch.observe(rows)

    def _job(self, raw: bytes, schema: type[SamplingRequest], arrived: float) -> "Job":
        """Everything a decode and its answer need, from the raw body (blocking: a worker thread)."""
        req = parse_request(raw, schema)
        stops = stop_sequences(req.stop)
        prompt_ids, max_new = prompt_and_budget(
            req, self.target.tokenizer, self.model_id, self.target.max_context, self.default_max_tokens
        )
        chat = isinstance(req, ChatRequest)
        top = req.logprobs_top()
        tokenizer = self.target.tokenizer
        return Job(
            req=req,
            chat=chat,
            prompt_ids=prompt_ids,
            max_new=max_new,
            stops=stops,
            head={
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()),
                "model": self.model_id,
            },
            text=TextStream(
                tokenizer,
                self.target.stop_token_ids,
                stops,
                track_tokens=req.stream and top is not None,
                emit=req.stream,
            ),
            recorder=LogprobRecorder(top) if top is not None else None,
            formatter=LogprobFormatter(tokenizer, chat, top) if top is not None else None,
            trace=DecodeTrace(arrived, max_new, self._uses_draft(req), req.stream),
        )

    async def _decode(self, job: "Job") -> AsyncIterator[str | GenerationResult]:
        """The job's decode as ``stream_rounds`` items, traced: progress for check_health, outcome,
        stats and metrics once it ends (abandoned decodes included)."""
        request = decode_request(job.req, job.prompt_ids, job.max_new, self._uses_draft(job.req), job.recorder)
        self.live.add(job.trace)
        outcome, result = "abandoned", None
        try:
            async with contextlib.aclosing(
                stream_rounds(self.engine, request, job.text, job.max_new, job.trace)
            ) as items:
                async for item in items:
                    if not isinstance(item, str):
                        result, outcome = item, "stop_sequence" if job.text.stopped else "finished"
                    yield item
        except (asyncio.CancelledError, GeneratorExit):  # the consumer left: the row is cancelled
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            self.live.discard(job.trace)
            job.trace.end(outcome)
            self.recent.append(job.trace)
            self._record(job.trace, result)

    def _record(self, trace: DecodeTrace, result: GenerationResult | None) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.record(trace, result.stats.drafted_per_round if result is not None else None)
            self._gauges()
        except Exception:
            logger.exception("recording metrics failed")

    def _events(self, job: "Job") -> AsyncIterator[str]:
        """A stream's server-sent events."""
        logprobs = StreamLogprobs(job.formatter, job.recorder.entries) if job.recorder is not None else None
        return sse_stream(
            self._decode(job),
            job.text,
            job.head,
            job.chat,
            functools.partial(self._tail, job),
            logprobs,
            job.req.include_usage,
        )

    def _answer(self, job: "Job", result: GenerationResult) -> dict[str, Any]:
        """A non-streaming request's response body."""
        stop_ids = self.target.stop_token_ids
        text, n_tokens, hit_stop = completion_text(self.target.tokenizer, result.tokens, stop_ids, job.stops)
        finish, extra = self._tail(job, result, n_tokens, hit_stop)
        logprobs = None
        if job.recorder is not None:
            body = content_tokens(result.tokens, n_tokens, stop_ids)
            logprobs = job.formatter.format(result.tokens[:body], job.recorder.entries[:body])
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            if job.chat
            else {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        )
        return {
            **job.head,
            "object": "chat.completion" if job.chat else "text_completion",
            "choices": [choice],
            **extra,
        }

    def _uses_draft(self, req: SamplingRequest) -> bool:
        return self.draft is not None and req.speculative

    def _tail(self, job: "Job", result: GenerationResult, n_tokens: int, hit_stop: bool) -> tuple[str, dict[str, Any]]:
        """finish_reason, and the usage + speculative fields every response (or last chunk) ends with."""
        finish = "stop" if hit_stop or result.finish_reason == "stop" else "length"
        prompt_tokens = len(job.prompt_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_tokens,
            "total_tokens": prompt_tokens + n_tokens,
        }
        ids = result.tokens[:n_tokens] if job.req.return_token_ids else None
        return finish, {
            "usage": usage,
            "speculative": speculative_block(result, self._uses_draft(job.req), ids),
        }
