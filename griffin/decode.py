"""The decode loops: GRIFFIN speculative decoding and vanilla decoding on the same target code.

Both preallocate their KV caches once per call (prompt + max_new_tokens + one tree), so no step
reallocates; both stop at the target's stop tokens or ``max_new_tokens`` and return the new
tokens with stats. Loop shape (docs/method.md §4): draft a tree, verify it in one target pass,
accept a path, compact the target KV, append, stop check.

Shape legend: T tokens, N tree nodes, D hidden, V vocab.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function  # named ranges for benchmarks/decode/round_profile.py; ~1 us when off

from griffin.config import SamplingConfig, TreeConfig
from griffin.model import GriffinDraft, KVCache
from griffin.verify import next_token, verify
from griffin.target import TargetAdapter, decode_attention
from griffin.tree import draft_tree


def acceptance_length(accepted_per_round: list[int]) -> float:
    """tau = sum over rounds of (accepted + 1) / rounds (docs/design.md §8: bonus token included);
    0 without rounds."""
    rounds = len(accepted_per_round)
    return (sum(accepted_per_round) + rounds) / rounds if rounds else 0.0


@dataclass
class GenerationStats:
    rounds: int = 0  # target passes after prefill (verification passes for speculative decoding)
    accepted_per_round: list[int] = field(default_factory=list)  # draft tokens accepted per round
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


def on_decode_attention(decode: Callable) -> Callable:
    """Runs ``decode(target, ...)`` under ``decode_attention`` for the target's device."""

    @functools.wraps(decode)
    def run(target: TargetAdapter, *args, **kwargs):
        with decode_attention(target.device):
            return decode(target, *args, **kwargs)

    return run


def device_time(device: torch.device) -> float:
    """A wall-clock reading after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@on_decode_attention
@torch.inference_mode()
def vanilla_generate(
    target: TargetAdapter,
    input_ids: Tensor,
    sampling: SamplingConfig,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | None = None,
    on_tokens: TokenCallback | None = None,
    logprobs: LogprobRecorder | None = None,
) -> GenerationResult:
    """Autoregressive decoding, one token per target pass, on the same target implementation.
    ``on_tokens`` is called with each newly committed token list (streaming); ``logprobs`` records
    the target's log-probabilities of the emitted tokens (see ``LogprobRecorder``)."""
    _check_request(target, input_ids, max_new_tokens)
    stop = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    stats, out, device = GenerationStats(), [], target.device
    cache = target.new_cache(input_ids.shape[1] + max_new_tokens)
    start = device_time(device)
    _, logits = target.forward(input_ids.to(device), cache, all_logits=False)  # (1, 1, V)
    token = next_token(logits[0, -1], sampling, generator)
    stats.prefill_time = device_time(device) - start
    reason = _append(
        out, [token], stop, max_new_tokens, on_tokens, logprobs, lambda: logprobs.score(logits[0, -1:], [token])
    )
    while reason is None:
        start = device_time(device)
        _, logits = target.forward(torch.tensor([[token]], device=device), cache, all_logits=False)  # (1, 1, V)
        token = next_token(logits[0, -1], sampling, generator)
        stats.verify_time += device_time(device) - start
        stats.rounds += 1
        stats.accepted_per_round.append(0)
        reason = _append(
            out, [token], stop, max_new_tokens, on_tokens, logprobs, lambda: logprobs.score(logits[0, -1:], [token])
        )
    return GenerationResult(out, stats, reason, logprobs.entries if logprobs is not None else None)


def _count_round(stats: GenerationStats, draft_s: float, verify_s: float, accept_len: int) -> None:
    """One round's statistics, inline counters (no metrics framework)."""
    stats.draft_time += draft_s
    stats.verify_time += verify_s
    stats.round_seconds.append((draft_s, verify_s))
    stats.rounds += 1
    stats.accepted_per_round.append(accept_len)


@on_decode_attention
@torch.inference_mode()
def speculative_generate(
    target: TargetAdapter,
    draft: GriffinDraft,
    input_ids: Tensor,
    tree: TreeConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | None = None,
    on_tokens: TokenCallback | None = None,
    logprobs: LogprobRecorder | None = None,
) -> GenerationResult:
    """Lossless GRIFFIN speculative decoding (docs/method.md §4-5). ``generator`` seeds T>0 sampling;
    ``on_tokens`` is called with each round's committed tokens (streaming); ``logprobs`` records the
    target's log-probabilities of the emitted tokens from the verification logits of the accepted
    path (no extra target pass; see ``LogprobRecorder``)."""
    _check_request(target, input_ids, max_new_tokens)
    stop = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    stats, out, device = GenerationStats(), [], target.device
    prompt_len = input_ids.shape[1]
    target_cache = target.new_cache(prompt_len + max_new_tokens + tree.total_tokens)
    draft_cache = KVCache.allocate(
        draft.cfg,
        prompt_len + max_new_tokens + (tree.depth - 1) * tree.top_k + 1,
        device=device,
        dtype=draft.param_dtype,
    )

    start = device_time(device)
    layers = draft.cfg.feature_layers  # what the draft reads: the last layer, or k layers (D_f = k*D)
    features, logits = target.forward(
        input_ids.to(device), target_cache, all_logits=False, feature_layers=layers
    )  # (1, T, D_f), (1, 1, V)
    root = next_token(logits[0, -1], sampling, generator)
    stats.prefill_time = device_time(device) - start
    reason = _append(
        out, [root], stop, max_new_tokens, on_tokens, logprobs, lambda: logprobs.score(logits[0, -1:], [root])
    )
    # Draft input pairs (f_p, x_{p+1}): features of the processed positions and the tokens after them.
    new_tokens = torch.cat([input_ids[0, 1:].to(device), torch.tensor([root], device=device)])  # (T,)

    while reason is None:
        start = device_time(device)
        with record_function("griffin.draft_tree"):
            tree_nodes = draft_tree(draft, draft_cache, features, new_tokens[None], tree)
        mid = device_time(device)
        prefix_len = target_cache.length
        with record_function("griffin.verify_forward"):
            features_n, logits_n = target.verify(
                tree_nodes.tokens, tree_nodes.depths, tree_nodes.mask, target_cache, layers
            )
        with record_function("griffin.accept"):
            result = verify(tree_nodes, logits_n[0], sampling, generator)
        accepted = torch.tensor(result.accepted_nodes, device=device)  # (A+1,) root first
        with record_function("griffin.commit"):
            target.commit(target_cache, prefix_len, accepted)
        end = device_time(device)
        _count_round(stats, mid - start, end - mid, result.accept_len)

        committed = tree_nodes.tokens[accepted[1:]].tolist() + [result.next_token]  # (A+1,)
        # token i of ``committed`` came from the target's logits after accepted node i
        scores = lambda: logprobs.score(logits_n[0, accepted], committed)  # (A+1, V) rows
        reason = _append(out, committed, stop, max_new_tokens, on_tokens, logprobs, scores)
        features = features_n[:, accepted]  # (1, A+1, D_f): target features of root + accepted nodes
        new_tokens = torch.tensor(committed, device=device)
    return GenerationResult(out, stats, reason, logprobs.entries if logprobs is not None else None)
