"""Requests' decodes inside a replica: one batching engine per replica (``ReplicaEngine``: griffin.engine
in a thread of its own) decodes every admitted request together; each request's rounds come back to
the event loop as text deltas (``stream_rounds``), and it leaves at its next round when a stop
sequence is met or the call is cancelled (its client left, the request timed out). ``DecodeTrace``
records what each did and when; ``check_progress`` is the replica's health check on them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from griffin.capacity import check_rows_fit
from griffin.config import SamplingConfig
from griffin.results import GenerationResult, LogprobRecorder
from griffin.engine import BatchEngine
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.model import GriffinDraft
from griffin.target import TargetAdapter
from pipeline.serve.errors import engine_failed
from pipeline.serve.protocol import LogprobFormatter, SamplingRequest
from pipeline.serve.sse import TextStream

logger = logging.getLogger(__name__)


class StopDecoding(Exception):
    """Raised from a row's per-round callback to end its decode early (a stop sequence was met)."""


FAULT_ENV = "GRIFFIN_ENGINE_FAULT"  # tests: a flag file holding a round number: that round fails, once


class ReplicaEngine:
    """A replica's batching engine (griffin.engine.BatchEngine) and the thread that runs its rounds:
    requests join from the event loop (``stream_rounds``), decode together, and leave on their own.

    An error outside any one row's decode (admission, cache growth, a device fault) stops the loop:
    every row it held or gets fails with ``errors.engine_failed`` (503, retry), ``failure`` says why,
    and the replica's health check fails on it, so Serve replaces the replica. Nothing hangs."""

    def __init__(
        self,
        target: TargetAdapter,
        draft: GriffinDraft | None,
        policy: SpeculationPolicy,
        max_rows: int,
        on_round: Callable[[int], None] | None = None,
        retry_after_s: float = 5.0,
    ):
        # refused before anything is allocated when the rows' KV cache cannot fit (griffin.capacity)
        check_rows_fit(target, draft, max_rows, target.max_context, policy.tree_slack + 1)
        self.engine = BatchEngine(target, draft, policy, max_rows)
        self.on_round = on_round  # called with each round's row count (the batch-size metric)
        self.retry_after_s = retry_after_s
        self.stopping, self.warm = threading.Event(), threading.Event()
        self.warm_up_error: BaseException | None = None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="griffin-engine", daemon=True)
        self.thread.start()
        self.warm.wait()  # the replica is ready once its compiled steps are captured (a no-op when eager)
        if self.warm_up_error is not None:
            raise self.warm_up_error

    def _loop(self) -> None:
        try:  # on this thread: CUDA graphs belong to the thread that captures them
            # every batch size: a compiled step's graph is per batch size, and none may be captured mid-serving
            self.engine.warm_up(list(range(1, self.engine.max_rows + 1)))
        except BaseException as error:
            self.warm_up_error = error
            self.stopping.set()
        finally:
            self.warm.set()
        while not self.stopping.is_set():
            if self.engine.wait_for_work(timeout=0.5):
                rounds = self.engine.rounds
                try:
                    _injected_fault(rounds)
                    self.engine.step()
                except BaseException as error:
                    self._fail(error)
                    return
                if self.on_round is not None and self.engine.rounds > rounds:
                    self.on_round(self.engine.last_batch)

    def _fail(self, error: BaseException) -> None:
        logger.error("the decoding engine failed; failing its requests", exc_info=error)
        self.failure = error
        self.engine.fail_all(engine_failed(error, self.retry_after_s))

    def close(self) -> None:
        self.stopping.set()

    @property
    def active(self) -> int:
        """Requests holding a slot: decoding, or part-way through a chunked prefill."""
        return len(self.engine.rows) + (self.engine.filling is not None)

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting)


async def stream_rounds(
    engine: ReplicaEngine, request: DecodeRequest, text: TextStream, max_new: int, trace: "DecodeTrace | None" = None
) -> AsyncIterator[str | GenerationResult]:
    """Submits ``request`` to the replica's engine and yields each round's text delta as soon as it is
    committed, then the GenerationResult. The row ends early once ``text`` has met a stop sequence,
    or at the next round once this iterator is closed or cancelled (the client went away, the request
    timed out); a request that leaves while waiting for a slot never decodes. Every request, streaming
    or not, decodes through here: one mechanism for stopping early."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def on_tokens(tokens: list[int]) -> None:  # in the engine thread: detokenizing there keeps the loop free
        if trace is not None:
            if trace.started is None:  # the first call comes right after the row's prefill
                trace.start()
            trace.round(tokens)
        delta = text.push(tokens)
        if delta:
            post(delta)
        ending = len(text.tokens) >= max_new or tokens[-1] in text.stop_ids  # its last call anyway
        if text.stopped and not ending:  # a finished decode keeps its exact stats
            raise StopDecoding

    request.on_tokens, request.on_done = on_tokens, post
    row = engine.engine.submit(request)  # once the engine has failed, the row comes back ended with a 503
    try:
        while isinstance(item := await queue.get(), str):
            yield item
    finally:
        if not row.done.is_set():  # the consumer stopped listening: the row leaves at the next round
            engine.engine.cancel(row)
    if row.error is not None and not isinstance(row.error, StopDecoding):
        raise row.error
    yield row.result


def _injected_fault(rounds: int) -> None:
    """``FAULT_ENV``'s testing hook: once the engine has run the rounds its flag file names (empty: 0),
    the next step fails, and the file goes with it."""
    flag = os.environ.get(FAULT_ENV)
    if flag and os.path.exists(flag) and rounds >= int(open(flag).read().strip() or 0):
        os.remove(flag)
        raise RuntimeError(f"injected engine failure ({FAULT_ENV})")


async def last_item(items: AsyncIterator[Any]) -> Any:
    """Drains ``items`` (a non-streaming request's decode) and returns its last item, the result; when
    this is cancelled (the ingress cancelled the call) ``items`` is closed, which ends the decode."""
    async with contextlib.aclosing(items):
        async for item in items:
            last = item
    return last


class DecodeTrace:
    """What one admitted request's decode did and when (``time.monotonic`` seconds): written by the
    engine thread at each round, read by /stats, the metrics and ``check_health`` (a wedged decode is one
    whose last round is long ago)."""

    def __init__(self, arrived: float, max_new: int, speculative: bool, stream: bool):
        self.arrived, self.max_new, self.speculative, self.stream = arrived, max_new, speculative, stream
        self.started: float | None = None  # its first token: it had an engine slot and was prefilled
        self.first_token: float | None = None
        self.last_progress: float | None = None
        self.ended: float | None = None
        self.rounds: list[list[int]] = []
        self.round_times: list[float] = []  # when each round's tokens were committed
        self.outcome = "waiting"  # -> decoding -> finished | stop_sequence | abandoned | error

    def start(self) -> None:
        self.started = self.last_progress = time.monotonic()
        self.outcome = "decoding"

    def round(self, tokens: list[int]) -> None:
        now = time.monotonic()
        self.first_token = self.first_token or now
        self.last_progress = now
        self.rounds.append(tokens)
        self.round_times.append(now)

    def end(self, outcome: str) -> None:
        self.ended, self.outcome = time.monotonic(), outcome

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rounds)

    def summary(self) -> dict[str, Any]:
        """A JSON-able record for /stats."""

        def since(moment: float | None, start: float | None) -> float | None:
            return None if moment is None or start is None else round(moment - start, 4)

        return {
            "outcome": self.outcome,
            "stream": self.stream,
            "speculative": self.speculative,
            "max_tokens": self.max_new,
            "tokens": self.tokens,
            "rounds": max(len(self.rounds) - 1, 0),
            "queued_s": since(self.started, self.arrived),
            "ttft_s": since(self.first_token, self.arrived),
            "latency_s": since(self.ended, self.arrived),
        }


def check_progress(trace: DecodeTrace | None, limit_s: float, now: float | None = None) -> None:
    """Serve's health check: raises when the running decode has made no round for ``limit_s`` (a
    wedged replica: Serve kills and replaces it). An idle replica is healthy."""
    if trace is None or trace.last_progress is None or trace.ended is not None:
        return
    stalled = (time.monotonic() if now is None else now) - trace.last_progress
    if stalled > limit_s:
        raise RuntimeError(
            f"the running decode made no progress for {stalled:.0f}s (serve.stall_timeout_s="
            f"{limit_s:g}): the replica is wedged"
        )


@dataclass
class Job:
    """One parsed request and the objects its decode and answer share."""

    req: SamplingRequest
    chat: bool
    prompt_ids: list[int]
    max_new: int
    stops: list[str]
    head: dict[str, Any]
    text: TextStream
    recorder: LogprobRecorder | None
    formatter: LogprobFormatter | None
    trace: DecodeTrace


def decode_request(
    req: SamplingRequest,
    prompt_ids: list[int],
    max_new: int,
    speculative: bool,
    logprobs: LogprobRecorder | None,
) -> DecodeRequest:
    """A parsed request as the engine's ``DecodeRequest``: its sampling and its seed."""
    # a temperature this small overflows logits / T; it means greedy (vLLM's cut-off too)
    temperature = req.temperature if req.temperature >= 1e-5 else 0.0
    sampling = SamplingConfig(temperature=temperature, top_p=req.top_p, top_k=req.top_k)
    return DecodeRequest(prompt_ids, sampling, max_new, req.seed, speculative=speculative, logprobs=logprobs)
