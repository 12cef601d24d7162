"""Ray Serve: the target + a GRIFFIN draft behind an OpenAI-style HTTP API.

``app_builder({"config": "jobs/configs/tiny.yaml"})`` -> Application (also ``serve run
pipeline.serve.app:app_builder config=...``); ``pipeline.serve.lifecycle`` starts and stops it
(``start_serve``, ``stop_serve``, ``run_serve`` = ``griffin serve``).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream: true`` = server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``), GET /v1/models, GET /health, GET /stats. Every
completion carries ``usage`` and a ``speculative`` block (rounds = target verification passes, accepted
draft tokens, acceptance length tau = sum(accepted + 1) / rounds; ``token_ids`` on request).
Extension: ``"speculative": false`` decodes without the draft, for A/B comparisons through the
endpoint. Bad input -> HTTP 4xx with an OpenAI error body naming the field, never a 500; the replica
keeps serving. docs/serving.md is the user's guide (bad-input table, config knobs, metrics).

Decoding is batch 1: a replica decodes one request at a time under a lock, in a worker thread, so the
event loop stays free for /health and queued requests; scale with replicas or autoscaling. A replica
admits ``serve.max_ongoing_requests`` completions (one decoding, the rest queued on the lock) and
sheds the next with 503/429 + Retry-After before reading its body; bodies over
``serve.max_body_bytes`` get 413; parsing and tokenization run in worker threads. Streams are live:
the decode's per-round ``on_tokens`` callback detokenizes in the worker and hands text deltas to the
event loop, which sends each as a chunk at once. A stop sequence, a client that goes away (streaming
or not) or Serve's request timeout ends the decode at its next round; a request abandoned while
queued never decodes. Metrics: ``ServeMetrics`` (Prometheus through Ray).
"""

import asyncio
import collections
import contextlib
import functools
import logging
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from griffin.decode import GenerationResult, LogprobRecorder, TokenCallback
from pipeline.config import RunConfig, config_from_dict, load_config
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
    read_body,
    speculative_block,
    stop_sequences,
)
from pipeline.serve.engine import (
    generate,
    ClientGone,
    DecodeTrace,
    Job,
    Once,
    StopDecoding,
    check_progress,
    stream_rounds,
    until_done,
)
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.sse import StreamLogprobs, TextStream, sse_stream

logger = logging.getLogger("ray.serve")
APP_NAME = "griffin"
api = FastAPI(title="GRIFFIN speculative decoding")


def served_model_name(cfg: RunConfig) -> str:
    return cfg.serve.model_name or cfg.target_slug


# ---- the deployment ----
@serve.deployment
@serve.ingress(api)
class SpeculativeDecoder:
    """One replica: the target and (when ``serve.draft_uri`` is set) a draft, one decode at a time.

    Admission: at most ``serve.max_ongoing_requests`` completions at once (one decoding, the rest
    queued on the decode lock, first come first served); one more is shed at once with 503/429 +
    Retry-After, before its body is read. Serve gives the replica ``control_slots`` more slots, so
    /health, /v1/models, /stats and those rejections never queue behind completions."""

    def __init__(self, run_config: dict[str, Any]):
        from pipeline.resources.drafts import load_draft_uri
        from pipeline.resources.targets import load_target

        cfg = config_from_dict(run_config)
        self.target = load_target(cfg.target, decoding=True)
        self.draft_uri = cfg.serve.draft_uri
        self.draft = load_draft_uri(self.draft_uri, self.target, cfg) if self.draft_uri else None
        self.model_id, self.tree = served_model_name(cfg), cfg.decode.tree
        self.default_max_tokens = cfg.serve.default_max_tokens
        self.limits = cfg.serve
        self.decode_lock = asyncio.Lock()  # the model and its caches serve one decode at a time
        self.admitted, self.shed = 0, 0
        self.active: DecodeTrace | None = None  # the decode holding the lock
        self.recent: collections.deque[DecodeTrace] = collections.deque(maxlen=64)
        self.created = int(time.time())
        self.metrics = self._metrics()
        logger.info("serving %s with %s", self.model_id, f"draft {self.draft_uri}" if self.draft else "no draft")

    def _metrics(self) -> ServeMetrics | None:
        try:
            return ServeMetrics(self.model_id, self.tree.total_tokens - 1 if self.draft is not None else 0)
        except Exception:  # metrics are an aid: never a reason not to serve
            logger.exception("Ray metrics unavailable; serving without them")
            return None

    # ---- cheap endpoints: never behind a decode ----
    @api.get("/health")
    async def health(self):
        """Liveness for load balancers: answers from the event loop at once, 503 when the running
        decode is wedged (the same test as Serve's ``check_health``)."""
        try:
            check_progress(self.active, self.limits.stall_timeout_s)
        except RuntimeError as error:
            return JSONResponse({"status": "wedged", "model": self.model_id, "detail": str(error)}, status_code=503)
        return {
            "status": "ok",
            "model": self.model_id,
            "running": int(self.active is not None),
            "waiting": self._waiting(),
        }

    async def check_health(self) -> None:
        """Serve's replica health check (every health_check_period_s): a wedged decode fails it."""
        check_progress(self.active, self.limits.stall_timeout_s)

    @api.get("/stats")
    async def stats(self) -> dict[str, Any]:
        """The replica's counters and its recent requests (the Prometheus metrics, readable without Prometheus)."""
        return {
            "model": self.model_id,
            "admitted": self.admitted,
            "running": int(self.active is not None),
            "waiting": self._waiting(),
            "shed": self.shed,
            "max_ongoing_requests": self.limits.max_ongoing_requests,
            "metrics_exported": self.metrics is not None,
            "recent": [trace.summary() for trace in list(self.recent)],
        }  # a snapshot: workers append to it

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "griffin",
            "target": self.target.name,
            "draft": self.draft_uri,
            "speculative": self.draft is not None,
            "decoding": "griffin speculative" if self.draft is not None else "vanilla (no draft configured)",
            "tree": self.tree.model_dump(),
            "max_context": self.target.max_context,
            "torch_threads": torch.get_num_threads(),
        }  # Ray gives a replica one thread per serve.num_cpus
        return {"object": "list", "data": [card]}

    # ---- completions ----
    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, ChatRequest)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, CompletionRequest)

    async def _complete(self, request: Request, schema: type[SamplingRequest]):
        """Admit (or shed), read and parse off the event loop, decode, answer. The admission slot is
        released when the answer is complete: here, or when a stream ends."""
        arrived = time.monotonic()
        if self.admitted >= self.limits.max_ongoing_requests:
            return self._shed_response()
        self._admit(+1)
        job: Job | None = None
        release = Once(lambda: self._leave(job))
        try:
            raw = await read_body(request, self.limits.max_body_bytes)
            # parsing a 1 MiB body, validating and tokenizing take milliseconds to seconds: not on the loop
            job = await asyncio.to_thread(self._job, raw, schema, arrived)
            if job.req.stream:
                response = StreamingResponse(self._stream(job, release), media_type="text/event-stream")
                weakref.finalize(response, release)  # a stream that never started still frees its slot
                release = None
                return response
            return self._answer(job, await until_done(self._decode(job), request))
        except ApiError as error:
            return error.response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except Exception as error:  # a bug, not the client's fault: say so and keep serving
            logger.exception("generation failed")
            return ApiError(f"internal error: {error}", status=500, kind="server_error").response()
        finally:
            if release is not None:
                release()

    def _admit(self, change: int) -> None:
        self.admitted += change
        self._gauges()

    def _leave(self, job: "Job | None") -> None:
        """An admitted request is done: free its slot; one that left before its decode began (client
        gone or timed out while queued) is recorded as abandoned, with no round run."""
        self._admit(-1)
        if job is not None and job.trace.started is None:
            job.trace.end("abandoned")
            self.recent.append(job.trace)

    def _waiting(self) -> int:
        return self.admitted - int(self.active is not None)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self._waiting(), int(self.active is not None))

    def _shed_response(self):
        """The replica's queue is full: refuse at once, with when to retry."""
        self.shed += 1
        if self.metrics is not None:
            self.metrics.shed.inc()
        retry = max(1, math.ceil(self.limits.retry_after_s))
        return ApiError(
            f"the server is at capacity ({self.admitted} requests in progress on this replica); retry after {retry}s",
            status=self.limits.shed_status,
            kind="server_error",
            code="server_overloaded",
            headers={"Retry-After": str(retry)},
        ).response()

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

    def _decode(self, job: "Job") -> AsyncIterator[str | GenerationResult]:
        """The job's decode as ``stream_rounds`` items, traced: progress for check_health, outcome,
        stats and metrics once it ends (abandoned decodes included)."""

        def run(on_tokens: TokenCallback) -> GenerationResult:
            self.active = job.trace
            job.trace.start()
            self._gauges()

            def traced(tokens: list[int]) -> None:
                job.trace.round(tokens)
                on_tokens(tokens)

            outcome = "error"
            try:
                draft = self.draft if self._uses_draft(job.req) else None
                result = generate(
                    self.target, draft, self.tree, job.req, job.prompt_ids, job.max_new, traced, job.recorder
                )
                outcome = "finished"
                return result
            except StopDecoding:
                outcome = "stop_sequence" if job.text.stopped else "abandoned"
                raise
            finally:
                job.trace.end(outcome)
                self.active = None
                self.recent.append(job.trace)
                self._record(job.trace)

        return stream_rounds(run, job.text, job.max_new, self.decode_lock)

    def _record(self, trace: DecodeTrace) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.record(trace)
            self._gauges()
        except Exception:
            logger.exception("recording metrics failed")

    async def _stream(self, job: "Job", release: "Once") -> AsyncIterator[str]:
        """A stream's events; its admission slot is released when the stream ends, however it ends."""
        try:
            logprobs = StreamLogprobs(job.formatter, job.recorder.entries) if job.recorder is not None else None
            events = sse_stream(
                self._decode(job),
                job.text,
                job.head,
                job.chat,
                functools.partial(self._tail, job),
                logprobs,
                job.req.include_usage,
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        finally:
            release()

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
            "speculative": speculative_block(result, self._uses_draft(job.req), self.tree, ids),
        }


# ---- building and running the application ----
class ServeArgs(BaseModel):
    """``app_builder`` arguments: a config file (+ ``section.field=value`` overrides) or a config dict."""

    model_config = ConfigDict(extra="forbid")
    config: str | None = None
    overrides: list[str] | str = Field(default_factory=list, description="a list, or one space-separated string")
    run_config: dict[str, Any] | None = None

    def load(self) -> RunConfig:
        if (self.config is None) == (self.run_config is None):
            raise ValueError("app_builder needs exactly one of 'config' (a YAML path) or 'run_config' (a dict)")
        if self.run_config is not None:
            return config_from_dict(self.run_config)
        overrides = self.overrides.split() if isinstance(self.overrides, str) else self.overrides
        return load_config(self.config, overrides)


def _portable(cfg: RunConfig) -> dict[str, Any]:
    """The config with local paths made absolute (replicas may start in another working directory) and
    the draft's registry alias pinned to its version (``pinned_draft``)."""
    data = cfg.resolved()
    data["output_dir"] = str(Path(cfg.output_dir).resolve())
    data["serve"]["draft_uri"] = pinned_draft(cfg)
    for section, key in (("serve", "draft_uri"), ("target", "name")):
        value = data[section][key]
        if value and Path(value).exists():
            data[section][key] = str(Path(value).resolve())
    return data


def pinned_draft(cfg: RunConfig) -> str | None:
    """``models:/NAME@ALIAS`` -> ``models:/NAME/<version>``, resolved once when the application is built:
    a replica that replaces a dead one loads the version its peers loaded, not whatever the alias names
    by then (moving ``champion`` reaches the endpoint with the next deploy)."""
    uri = cfg.serve.draft_uri
    if not (uri and uri.startswith("models:/") and "@" in uri):
        return uri
    from mlflow import MlflowClient

    from pipeline.runtime import setup_mlflow

    setup_mlflow(cfg)
    name, alias = uri.removeprefix("models:/").split("@", 1)
    return f"models:/{name}/{MlflowClient().get_model_version_by_alias(name, alias).version}"


def app_builder(args: dict[str, Any] | ServeArgs) -> Application:
    """The Serve application for a run config: one ``SpeculativeDecoder`` deployment (loads nothing here)."""
    cfg = (args if isinstance(args, ServeArgs) else ServeArgs(**args)).load()
    section = cfg.serve
    scaling = (
        {"autoscaling_config": section.autoscaling} if section.autoscaling else {"num_replicas": section.num_replicas}
    )
    return SpeculativeDecoder.options(
        # completions are admitted by the replica itself (its queue): the extra slots keep /health & co.
        # from ever queueing behind them; Serve's own queue in front is bounded too
        max_ongoing_requests=section.max_ongoing_requests + section.control_slots,
        max_queued_requests=section.max_queued_requests,
        backpressure_config={"status_code": section.shed_status, "retry_after_s": section.retry_after_s},
        ray_actor_options={"num_cpus": section.num_cpus, "num_gpus": section.num_gpus},
        **scaling,
    ).bind(_portable(cfg))
