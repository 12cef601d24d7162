"""One request's decode: GRIFFIN speculative decoding and vanilla decoding, both the batching engine
(griffin.engine) with a single request, so a lone request and a batch of them run the same code.

Both stop at the target's stop tokens or ``max_new_tokens`` and return the new tokens with stats.
Round shape (docs/method.md §4): draft a tree, verify it in one target pass, accept a path, compact
the target KV, append, stop check. What a decode returns and records: griffin.results.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

from griffin.config import SamplingConfig, TreeConfig
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.model import GriffinDraft
from griffin.offline import generate_batch
from griffin.results import GenerationResult, LogprobRecorder, TokenCallback, check_request
from griffin.target import TargetAdapter

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
    check_request(target, input_ids, max_new_tokens)
    request = DecodeRequest(
        input_ids[0].tolist(), sampling, max_new_tokens, seed, stop_token_ids, True, on_tokens, logprobs
    )
    return generate_batch(target, draft, [request], SpeculationPolicy({1: tree}))[0]
