"""One request's decode inside a replica: the decode runs in a worker thread (``stream_rounds``), its rounds
come back to the event loop as text deltas, and it stops at its next round when a stop sequence is met or
the call is cancelled (its client left, the request timed out). ``DecodeTrace`` records what it did and when;
``check_progress`` is the replica's health check on it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import (
    GenerationResult,
    GenerationStats,
    LogprobRecorder,
    TokenCallback,
    speculative_generate,
    vanilla_generate,
)
from griffin.model import GriffinDraft
from griffin.target import TargetAdapter
from pipeline.serve.protocol import LogprobFormatter, SamplingRequest
from pipeline.serve.sse import TextStream


class StopDecoding(Exception):
    """Raised from the per-round callback to end a decode early; the worker catches it."""


def _result_from_rounds(rounds: list[list[int]]) -> GenerationResult:
    """A decode stopped early returns nothing: rebuild its result from the callbacks (the first is the
    prefill's token, each later one a round: its accepted draft tokens + 1; a vanilla round is 1 token)."""
    stats = GenerationStats(rounds=len(rounds) - 1, accepted_per_round=[len(r) - 1 for r in rounds[1:]])
    return GenerationResult([t for r in rounds for t in r], stats, "stop")


async def stream_rounds(
    run: Callable[[TokenCallback], GenerationResult], text: TextStream, max_new: int, lock: asyncio.Lock | None = None
) -> AsyncIterator[str | GenerationResult]:
    """Runs ``run(on_tokens)`` (the decode) in a worker thread once ``lock`` (the replica's decode lock,
    first come first served) is free; yields each round's text delta as soon as it is committed, then
    the GenerationResult. The decode ends early once ``text`` has met a stop sequence or this iterator
    is closed or cancelled (the client went away, the request timed out): at its next round, or before
    it starts when that happens while waiting for the lock, so the lock is not held for nothing. Every
    request, streaming or not, decodes through here: one mechanism for stopping early."""
    loop, queue, closed, rounds = asyncio.get_running_loop(), asyncio.Queue(), threading.Event(), []

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def on_tokens(tokens: list[int]) -> None:  # in the worker: detokenizing here keeps the loop free
        rounds.append(tokens)
        delta = text.push(tokens)
        if delta:
            post(delta)
        ending = len(text.tokens) >= max_new or tokens[-1] in text.stop_ids  # its last call anyway
        if (text.stopped or closed.is_set()) and not ending:  # a finished decode keeps its exact stats
            raise StopDecoding

    def work() -> None:
        try:
            outcome = run(on_tokens)
        except StopDecoding:
            outcome = _result_from_rounds(rounds)
        except BaseException as error:  # re-raised in the event loop, where the stream reports it
            outcome = error
        finally:
            if lock is not None:  # the next decode may start only once this one is really over
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(lock.release)
        post(outcome)

    if lock is not None:
        await lock.acquire()  # cancelled or closed while waiting: nothing ran, nothing to release
    loop.run_in_executor(None, work)
    try:
        while isinstance(item := await queue.get(), str):
            yield item
    finally:
        closed.set()  # early only when the consumer stopped listening: end the decode at its next round
    if isinstance(item, BaseException):
        raise item
    yield item


async def last_item(items: AsyncIterator[Any]) -> Any:
    """Drains ``items`` (a non-streaming request's decode) and returns its last item, the result; when
    this is cancelled (the ingress cancelled the call) ``items`` is closed, which ends the decode."""
    async with contextlib.aclosing(items):
        async for item in items:
            last = item
    return last


class DecodeTrace:
    """What one admitted request's decode did and when (``time.monotonic`` seconds): written by the
    worker at each round, read by /stats, the metrics and ``check_health`` (a wedged decode is one
    whose last round is long ago)."""

    def __init__(self, arrived: float, max_new: int, speculative: bool, stream: bool):
        self.arrived, self.max_new, self.speculative, self.stream = arrived, max_new, speculative, stream
        self.started: float | None = None  # the decode lock was taken, the prefill begins
        self.first_token: float | None = None
        self.last_progress: float | None = None
        self.ended: float | None = None
        self.rounds: list[list[int]] = []
        self.outcome = "waiting"  # -> decoding -> finished | stop_sequence | abandoned | error

    def start(self) -> None:
        self.started = self.last_progress = time.monotonic()
        self.outcome = "decoding"

    def round(self, tokens: list[int]) -> None:
        now = time.monotonic()
        self.first_token = self.first_token or now
        self.last_progress = now
        self.rounds.append(tokens)

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


def generate(
    target: TargetAdapter,
    draft: GriffinDraft | None,
    tree: TreeConfig,
    req: SamplingRequest,
    prompt_ids: list[int],
    max_new: int,
    on_tokens: TokenCallback | None = None,
    logprobs: LogprobRecorder | None = None,
) -> GenerationResult:
    """A request's decode with ``draft`` (None: vanilla), blocking: run it in a worker thread under the
    replica's decode lock; ``on_tokens`` gets each round's
    tokens, ``logprobs`` (when asked) their log-probabilities."""
    # a temperature this small overflows logits / T; it means greedy (vLLM's cut-off too)
    temperature = req.temperature if req.temperature >= 1e-5 else 0.0
    sampling = SamplingConfig(temperature=temperature, top_p=req.top_p, top_k=req.top_k)
    device = target.device
    generator = None if req.seed is None else torch.Generator(device=device).manual_seed(req.seed)
    input_ids = torch.tensor([prompt_ids], device=device)  # (1, T)
    if draft is not None:
        return speculative_generate(
            target,
            draft,
            input_ids,
            tree,
            sampling,
            max_new,
            generator,
            on_tokens=on_tokens,
            logprobs=logprobs,
        )
    return vanilla_generate(target, input_ids, sampling, max_new, generator, on_tokens=on_tokens, logprobs=logprobs)
