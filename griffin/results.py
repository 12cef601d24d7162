"""What every decode returns and records, and the two checks each decode shares: a request's shape and
length against the target's window (``check_request``), and appending a round's tokens up to a stop
(``append_tokens``). The batching engine (griffin.engine) and the one-request functions (griffin.decode)
both import it; neither imports the other's internals.

Shape legend: K positions, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from griffin.target import TargetAdapter


def acceptance_length(accepted_per_round: list[int]) -> float:
    """tau = sum over rounds of (accepted + 1) / rounds (docs/design.md §8: bonus token included);
    0 without rounds."""
    rounds = len(accepted_per_round)
    return (sum(accepted_per_round) + rounds) / rounds if rounds else 0.0


@dataclass
class GenerationStats:
    rounds: int = 0  # target passes after prefill (verification passes for speculative decoding)
    accepted_per_round: list[int] = field(default_factory=list)  # draft tokens accepted per round
    drafted_per_round: list[int] = field(default_factory=list)  # draft tokens verified per round (0: plain)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0  # target verify forward + acceptance + KV compaction
    round_seconds: list[tuple[float, float]] = field(default_factory=list)  # (draft, verify) per round

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.accepted_per_round)


@dataclass
class GenerationResult:
    tokens: list[int]  # new token ids, stop token included when one was produced
    stats: GenerationStats
    finish_reason: str  # "stop" or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token when a LogprobRecorder was passed


@dataclass
class TokenLogprob:
    """The target's log-probability of one emitted token and its ``top`` alternatives [(id, logprob)],
    best first (OpenAI's ``logprob`` / ``top_logprobs``)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class LogprobRecorder:
    """Asks a decode for log-probabilities: it appends one ``TokenLogprob`` per committed token to
    ``entries`` *before* ``on_tokens`` sees those tokens, so a stream can send them with its chunks.

    Semantics (OpenAI / vLLM's default): the log-softmax of the target's *raw* logits at the
    position that produced the token, in fp32, whatever the temperature, top-k or top-p: the
    sampling warper is not applied. Computed only when a recorder is passed (the default decode does
    no extra work); speculative decoding reads them from the verification logits of the accepted
    path, which at T=0 are the logits vanilla decoding sees (equal up to float noise)."""

    top_n: int = 0  # alternatives per token (0: the chosen token's log-probability only)
    entries: list[TokenLogprob] = field(default_factory=list)

    def score(self, logits: Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """logits (K, V) of the K positions that produced ``tokens`` (K,) -> K entries."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (K, V)
        chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]  # (K,)
        if self.top_n:
            top_values, top_ids = logprobs.topk(min(self.top_n, logprobs.shape[-1]), dim=-1)  # (K, n)
            tops = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in tokens]
        return [TokenLogprob(value, top) for value, top in zip(chosen.tolist(), tops)]


def check_request(target: TargetAdapter, input_ids: Tensor, max_new_tokens: int) -> None:
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a LongTensor of shape (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.shape[1] + max_new_tokens > target.max_context:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context window of {target.max_context}; shorten the prompt or lower max_new_tokens"
        )


TokenCallback = Callable[[list[int]], None]
Scores = Callable[[LogprobRecorder], list[TokenLogprob]]  # a round's token log-probabilities, computed on demand


def append_tokens(
    out: list[int],
    new: list[int],
    stop: set[int],
    max_new_tokens: int,
    on_tokens: TokenCallback | None = None,
    recorder: LogprobRecorder | None = None,
    scores: Scores | None = None,
) -> str | None:
    """Append ``new`` to ``out`` up to the first stop token or the length limit; say why we stopped.
    ``on_tokens`` receives the tokens actually appended (for streaming); with a ``recorder``, the
    lazily computed ``scores(recorder)`` (aligned with ``new``) of those tokens are recorded first."""
    start, reason = len(out), None
    for token in new:
        out.append(token)
        if token in stop:
            reason = "stop"
            break
        if len(out) >= max_new_tokens:
            reason = "length"
            break
    if recorder is not None:
        assert scores is not None, "a decode that records log-probabilities passes each round's scores"
        recorder.entries += scores(recorder)[: len(out) - start]
    if on_tokens is not None:
        on_tokens(out[start:])
    return reason


def device_time(device: torch.device) -> float:
    """A wall-clock reading after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
