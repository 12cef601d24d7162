"""One request's decode: GRIFFIN speculative decoding and vanilla decoding, both the batching engine
(griffin.engine) with a single request, so a lone request and a batch of them run the same code.

Both stop at the target's stop tokens or ``max_new_tokens`` and return the new tokens with stats.
Round shape (docs/method.md §4): draft a tree, verify it in one target pass, accept a path, compact
the target KV, append, stop check. This module also holds what every decode returns and records.

Shape legend: T tokens, N tree nodes, D hidden, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from griffin.config import SamplingConfig, TreeConfig
from griffin.model import GriffinDraft
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


def _check_request(target: TargetAdapter, input_ids: Tensor, max_new_tokens: int) -> None:
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


def _append(
    out: list[int],
    new: list[int],
    stop: set[int],
    max_new_tokens: int,
    on_tokens: TokenCallback | None = None,
    recorder: LogprobRecorder | None = None,
    scores: Callable[[], list[TokenLogprob]] | None = None,
) -> str | None:
    """Append ``new`` to ``out`` up to the first stop token or the length limit; say why we stopped.
    ``on_tokens`` receives the tokens actually appended (for streaming); with a ``recorder``, the
    lazily computed ``scores()`` (aligned with ``new``) of those tokens are recorded first."""
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
        recorder.entries += scores()[: len(out) - start]
    if on_tokens is not None:
        on_tokens(out[start:])
    return reason


NEAR_TIE_LOGITS = 0.25  # two bf16 rounding steps of a logit of magnitude 16-32


@torch.inference_mode()
def first_divergence(target: TargetAdapter, prompt_ids: list[int], spec: list[int], vanilla: list[int]) -> dict:
    """Where a T=0 speculative output first leaves vanilla's, and how close the target's two candidates
    were there. In bf16 a batched tree verify and a single-token step round differently, so a near-tie
    between the top two logits can flip: ``gap`` = |logit(vanilla) - logit(spec)| from a fresh prefill
    of the shared prefix; ``near_tie`` when it is within bf16 rounding. A large gap is an algorithmic bug
    (the fp32 tests prove exact equality); one output stopping where the other goes on has no gap."""
    index = next((k for k, (a, b) in enumerate(zip(spec, vanilla)) if a != b), min(len(spec), len(vanilla)))
    if index >= min(len(spec), len(vanilla)):
        return {"index": index, "gap": None, "near_tie": False}
    ids = torch.tensor([prompt_ids + vanilla[:index]], device=target.device)  # (1, T)
    _, logits = target.forward(ids, target.new_cache(ids.shape[1]), all_logits=False)  # (1, 1, V)
    gap = abs(float(logits[0, -1, vanilla[index]] - logits[0, -1, spec[index]]))
    return {
        "index": index,
        "gap": round(gap, 4),
        "near_tie": gap <= NEAR_TIE_LOGITS,
        "spec_token": spec[index],
        "vanilla_token": vanilla[index],
    }


def device_time(device: torch.device) -> float:
    """A wall-clock reading after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def vanilla_generate(
    target: TargetAdapter,
    input_ids: Tensor,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    on_tokens: TokenCallback | None = None,
    logprobs: LogprobRecorder | None = None,
) -> GenerationResult:
    """Autoregressive decoding, one token per target pass: the batching engine (griffin.engine) with
    one request and no draft. ``on_tokens`` is called with each newly committed token list
    (streaming); ``logprobs`` records the target's log-probabilities of the emitted tokens (see
    ``LogprobRecorder``)."""
    return _decode_one(
        target, None, input_ids, None, sampling, max_new_tokens, seed, stop_token_ids, on_tokens, logprobs
    )


def speculative_generate(
    target: TargetAdapter,
    draft: GriffinDraft,
    input_ids: Tensor,
    tree: TreeConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    on_tokens: TokenCallback | None = None,
    logprobs: LogprobRecorder | None = None,
) -> GenerationResult:
    """Lossless GRIFFIN speculative decoding (docs/method.md §4-5): the batching engine with one
    request and ``tree`` (a round: draft a tree, verify it in one target pass, accept a path, compact
    the target KV, append, stop check). ``seed`` keys T>0 sampling (griffin.verify); ``on_tokens`` is called
    with each round's committed tokens (streaming); ``logprobs`` records the target's
    log-probabilities of the emitted tokens from the verification logits of the accepted path (no
    extra target pass; see ``LogprobRecorder``)."""
    return _decode_one(
        target, draft, input_ids, tree, sampling, max_new_tokens, seed, stop_token_ids, on_tokens, logprobs
    )


def _decode_one(target, draft, input_ids, tree, sampling, max_new_tokens, seed, stop_token_ids, on_tokens, logprobs):
    """One request through the engine, alone: the same code path as a batch of one in a replica."""
    from griffin.engine import DecodeRequest, SpeculationPolicy
    from griffin.offline import generate_batch

    _check_request(target, input_ids, max_new_tokens)
    request = DecodeRequest(
        input_ids[0].tolist(), sampling, max_new_tokens, seed, stop_token_ids, True, on_tokens, logprobs
    )
    return generate_batch(target, draft, [request], SpeculationPolicy({1: tree}))[0]
