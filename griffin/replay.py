"""Speculative decoding replayed with the draft alone, from the target's own continuation.

A verify pass accepts exactly the longest tree path that spells the continuation the target itself
decodes (``griffin.verify.walk``): its greedy one at T=0, and at T>0 its seeded one, since a seeded
request's tokens are the same drafting or not (draws keyed by position). So one vanilla decode of a
prompt and one target forward over it give everything a round needs: the
target's next tokens and its features at every committed position. Replaying the rounds then runs
only the draft: the same trees and the same accepted lengths as ``speculative_generate`` (up to float
noise in near-tied draft scores), at a fifth to a tenth of a round's cost on a CPU. ``griffin tune-tree``
scores trees' τ this way on more prompts than it could decode.

Shape legend: T prompt tokens, L continuation tokens, D_f feature width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import vanilla_generate
from griffin.results import acceptance_length
from griffin.model import GriffinDraft
from griffin.rows import RowCache
from griffin.target import TargetAdapter, decode_attention
from griffin.tree import DraftRace, DraftTree, draft_tree
from griffin.verify import RowSampling, position_keys

GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class DecodeReference:
    """A prompt's continuation (greedy, or seeded at T>0) and the target's features over prompt + continuation."""

    input_ids: Tensor  # (1, T)
    continuation: list[int]  # (L_ext,) the target's tokens, decoded on past a stop token by ``lookahead``
    length: int  # tokens vanilla decoding returns: up to the first stop token, at most max_new_tokens
    features: Tensor  # (1, T + L_ext - 1, D_f) the target's features at every position but the last
    vanilla_step_seconds: float  # mean single-token step of the decode that produced it
    sampling: SamplingConfig = GREEDY  # the continuation's, and its seed: a T>0 replay's draft runs its race
    seed: int = 0


def decode_reference(
    target: TargetAdapter,
    input_ids: Tensor,
    max_new_tokens: int,
    lookahead: int,
    feature_layers: tuple[int, ...] | None = None,
    stop_token_ids: list[int] | None = None,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
) -> DecodeReference:
    """Decode ``max_new_tokens + lookahead`` tokens (greedy, or with ``sampling`` and ``seed``)
    ignoring stop tokens (a last round may
    accept draft tokens past the length limit or a stop token; a lookahead of the tree's depth lets a
    replay count them as the decoder does), then run the target once over the whole sequence for its
    features. ``stop_token_ids`` (default: the target's) end the decode the replay reproduces. Not
    under ``inference_mode``: a compiled target's decode steps cannot take it (griffin.static)."""
    result = vanilla_generate(target, input_ids, sampling, max_new_tokens + lookahead, seed, stop_token_ids=[])
    continuation = result.tokens
    stops = set(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    length = next(
        (i + 1 for i, token in enumerate(continuation[:max_new_tokens]) if token in stops),
        min(max_new_tokens, len(continuation)),
    )
    sequence = torch.cat([input_ids.to(target.device), torch.tensor([continuation[:-1]], device=target.device)], dim=1)
    with torch.inference_mode():  # eager; the decode above ran in the engine's own mode (no_grad when compiled)
        features, _ = target.forward(
            sequence, target.new_cache(sequence.shape[1]), all_logits=False, feature_layers=feature_layers
        )  # (1, T + L_ext - 1, D_f)
    step = result.stats.verify_time / max(result.stats.rounds, 1)
    return DecodeReference(input_ids, continuation, length, features, step, sampling, seed)


@dataclass
class Replay:
    accepted_per_round: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)  # one per round

    @property
    def tau(self) -> float:
        return acceptance_length(self.accepted_per_round)


def accepted_along(tree: DraftTree, upcoming: list[int]) -> int:
    """Draft tokens a verify accepts when the target's own tokens after the root are ``upcoming``."""
    tokens, node, depth = tree.tokens.tolist(), 0, 0
    while depth < len(upcoming):
        child = next((c for c in tree.children[node] if tokens[c] == upcoming[depth]), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


@torch.inference_mode()
def replay_decode(draft: GriffinDraft, reference: DecodeReference, tree: TreeConfig) -> Replay:
    """The rounds ``speculative_generate`` would run on ``reference``'s prompt (at its sampling and
    seed), draft only."""
    prompt, continuation, features = reference.input_ids, reference.continuation, reference.features
    T, device, replay = prompt.shape[1], features.device, Replay()
    capacity = T + len(continuation) + (tree.depth - 1) * tree.top_k + 1
    cache = RowCache.for_draft(draft.cfg, 1, capacity, draft.param_dtype, device)
    # as after prefill: pairs (f_p, x_{p+1}) of the prompt, the last one ending in the root
    new_features = features[:, :T]  # (1, T, D_f)
    new_tokens = torch.cat([prompt[0, 1:].to(device), torch.tensor(continuation[:1], device=device)])  # (T,)
    done = 1  # continuation tokens committed; continuation[done - 1] is the root
    rows = RowSampling.of([reference.sampling], draft.cfg.vocab_size, device)  # the target's vocabulary
    with decode_attention(device):  # a new KV length every round, as in decoding
        while done < reference.length:
            start = time.perf_counter()
            nodes = draft_tree(
                draft, cache, new_features, new_tokens[None], tree, _race(draft, reference, rows, done, tree)
            )
            replay.draft_seconds.append(time.perf_counter() - start)
            accepted = accepted_along(nodes, continuation[done : done + tree.depth])
            replay.accepted_per_round.append(accepted)
            # committed: the accepted tokens and the target's next one; features at the root and accepted nodes
            new_features = features[:, T + done - 1 : T + done + accepted]  # (1, A+1, D_f)
            new_tokens = torch.tensor(continuation[done : done + accepted + 1], device=device)  # (A+1,)
            done += accepted + 1
    return replay


def _race(
    draft: GriffinDraft, reference: DecodeReference, rows: RowSampling, done: int, tree: TreeConfig
) -> DraftRace | None:
    """The draws of the round after ``done`` committed tokens, as the engine's draft runs them
    (griffin.tree.DraftRace) with ``reference``'s sampling ``rows``; None at T=0."""
    if reference.sampling.greedy:
        return None
    keys = torch.tensor([position_keys(reference.seed, done, tree.depth)], device=reference.features.device)  # (1, L)
    return DraftRace.of(draft, rows, keys)
