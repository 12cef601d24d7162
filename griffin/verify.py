"""Lossless verification of a draft tree against the target (docs/method.md §5).

Terminology (as in vLLM's rejection sampler):
- accepted: draft tokens on the chosen root-to-node path that the target keeps;
- recovered: when every child of the last accepted node is rejected, the token sampled from the
  residual distribution (the target's, with the rejected children's mass removed);
- bonus: when the walk reaches a leaf, the token sampled from the target at that leaf.
Either way one extra target token ends each round (``next_token``), so a round commits
``accept_len + 1`` tokens.

The draft proposal is deterministic (top-k beam), i.e. q(c) = 1 for the child being tried, so
"accept with probability min(1, p(c)/q(c)) = p(c), else zero p(c) and renormalise" over the
children in rank order samples exactly from p (EAGLE-2). The warper (temperature, top-k, top-p)
is applied on every branch, including the leaf bonus (EAGLE's fixed version; §5.6 bug note).

Shape legend: N tree nodes, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from griffin.config import SamplingConfig
from griffin.tree import DraftTree


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # tree node indices, root first: [0, a1, ..., aA]
    next_token: int  # recovered or bonus token sampled from the target

    @property
    def accept_len(self) -> int:
        return len(self.accepted_nodes) - 1


def warp_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """logits (..., V) -> probabilities (..., V) after temperature, top-k then top-p (HF order)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_one(probs: Tensor, generator: torch.Generator | None) -> int:
    """probs (V,) -> one token id."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The target's own choice from one position's logits (V,): argmax at T=0, else a sample."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample_one(warp_probs(logits, sampling), generator)


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """T=0: follow the child equal to the target's argmax while one exists (§5.5).
    target_logits: (N, V). Child tokens under one parent are distinct, so the walk is unique and
    commits exactly what greedy decoding of the target would."""
    choice = target_logits.argmax(-1).tolist()  # (N,) target argmax after each node
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if tokens[c] == choice[node]), None)
        if nxt is None:
            return VerifyResult(path, choice[node])
        node = nxt
        path.append(node)


def verify_sampling(
    tree: DraftTree, target_logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> VerifyResult:
    """T>0: recursive rejection sampling over the tree (§5.6). target_logits: (N, V)."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        probs = warp_probs(target_logits[node], sampling)  # (V,)
        accepted = None
        for child in tree.children[node]:
            token = tokens[child]
            p_token = float(probs[token])
            if float(torch.rand((), generator=generator, device=probs.device)) < p_token:
                accepted = child
                break
            probs[token] = 0.0  # residual: remove the rejected child's mass and renormalise
            total = probs.sum()
            if total <= 0:  # float round-off only: the rejected token held all the mass
                accepted = child
                break
            probs = probs / total
        if accepted is None:
            return VerifyResult(path, sample_one(probs, generator))
        node = accepted
        path.append(node)


def verify(tree: DraftTree, target_logits: Tensor, sampling: SamplingConfig, generator=None) -> VerifyResult:
    """``generator`` must live on the logits' device."""
    if sampling.greedy:
        return verify_greedy(tree, target_logits)
    return verify_sampling(tree, target_logits, sampling, generator)
