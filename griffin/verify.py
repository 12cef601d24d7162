"""Lossless verification of draft trees against the target, every row of a batch at once (docs/method.md §5).

Sampling is keyed by position. A request's token at output index i is drawn from the target's
warped law p at that position by an exponential race: the token x with the largest p(x) / E(x),
where the E(x) are independent Exp(1) draws keyed by (seed, i, x) (``position_keys``,
``exponentials``); that x has law p exactly. At T=0 it is the argmax. The walk draws x from p at
each depth and follows the child whose token is x, else emits x, so every committed token is the
race's winner at its position given the tokens before it: a seeded request's tokens are a fixed
function of its seed and the target's distributions, the same alone or batched, speculative or
plain, with any tree (for a top-k tree, EAGLE-2's recursive rejection has this law and acceptance
rate). A T>0 row's draft runs the same race on its own law (griffin.tree.DraftRace), so its tree
holds the target's draw wherever the two laws are close. Logits equal only up to float rounding (a
batched pass vs a single step) change the token only when the race's two leaders are that close (an
inverse CDF would change it whenever the draw sat that close to any of V cumulative boundaries:
measured on SmolLM2 at T=1, once in 256 tokens).

Terms (as in vLLM's rejection sampler): the accepted tokens are the draft tokens on the walked
path; the round's extra target token (``next``) is the recovered token when no child of the last
accepted node matches, or the bonus token after a leaf. A round commits ``accept_len + 1`` tokens.

Shape legend: B rows, N tree nodes, V vocab, D the deepest tree's depth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from griffin.config import SamplingConfig

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass
class Walked:
    """One row's round: ``nodes`` = [0, a1, .., aA] (the root, then the accepted nodes) and
    ``tokens`` = the A + 1 tokens it commits (the accepted ones, then the recovered or bonus one)."""

    nodes: list[int]
    tokens: list[int]

    @property
    def accept_len(self) -> int:
        return len(self.nodes) - 1


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """A logical right shift of int64 values (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as torch.long holds it."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def _splitmix(z: Tensor) -> Tensor:
    """SplitMix64 (Steele et al., 2014) at states ``z`` (long): the state advanced by the golden gamma,
    then the output mix, in torch's wrapping int64 arithmetic (the same on every device)."""
    z = z + _signed(GOLDEN64)
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def position_keys(seed: int, start: int, count: int) -> list[int]:
    """The keys of output positions [start, start + count) of a request with ``seed``: the SplitMix64
    stream of the seed's key read at each position (counter-based: a position's key needs none of
    the ones before)."""
    key = _splitmix(torch.tensor(_signed(seed)))
    return _splitmix(key + torch.arange(start, start + count) * _signed(GOLDEN64)).tolist()


def exponentials(keys: Tensor, vocab: int) -> Tensor:
    """keys (B,) long -> Exp(1) draws (B, V) float64, one per (key, token): -log u, u from 52 bits of
    the key's SplitMix64 stream read at the token."""
    return exponentials_at(keys, torch.arange(vocab, device=keys.device))


def exponentials_at(keys: Tensor, token_ids: Tensor) -> Tensor:
    """``exponentials`` at the tokens ``token_ids`` (V',) only: keys (B,) -> (B, V') float64, each
    draw bit-identical to ``exponentials``' for that (key, token)."""
    z = _splitmix(keys[:, None] + token_ids.to(keys.device) * _signed(GOLDEN64))  # (B, V')
    # 52 bits + 0.5, exact in float64: u in (0, 1), never 1 (E = -0.0 would make 0 / E a NaN that wins)
    return -torch.log((_shift_right(z, 12).double() + 0.5) * 2.0**-52)  # E in (0, 36.7)


@dataclass
class RowSampling:
    """The sampling settings of B rows as tensors on the device. A greedy row's warper entries are
    unused; a warper that is off holds a value that keeps every token."""

    greedy: Tensor  # (B,) bool
    temperature: Tensor  # (B, 1) float32; 1 for greedy rows
    top_k: Tensor  # (B, 1) long; 0: off
    top_p: Tensor  # (B, 1) float32; inf: off (the mass before a token never reaches it)
    all_greedy: bool
    max_top_k: int  # 0: no row truncates to its top k
    any_top_p: bool

    @classmethod
    def of(cls, samplings: list[SamplingConfig], vocab: int, device: torch.device | str) -> "RowSampling":
        top_ks = [s.top_k if s.top_k and s.top_k < vocab and not s.greedy else 0 for s in samplings]
        top_ps = [s.top_p if s.top_p < 1.0 and not s.greedy else float("inf") for s in samplings]
        column = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)[:, None]  # noqa: E731
        return cls(
            greedy=torch.tensor([s.greedy for s in samplings], device=device),
            temperature=column([1.0 if s.greedy else s.temperature for s in samplings], torch.float32),
            top_k=column(top_ks, torch.long),
            top_p=column(top_ps, torch.float32),
            all_greedy=all(s.greedy for s in samplings),
            max_top_k=max(top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
        )

    def repeat(self, n: int) -> "RowSampling":
        """The settings of B * n rows: each row's n times in a row (a draft level's nodes, n per row)."""
        if n == 1:
            return self
        each = lambda values: values.repeat_interleave(n, dim=0)  # noqa: E731
        return replace(self, greedy=each(self.greedy), temperature=each(self.temperature), top_k=each(self.top_k),
                       top_p=each(self.top_p))  # fmt: skip


def warp_rows(logits: Tensor, rows: RowSampling) -> Tensor:
    """logits (B, V) -> probabilities (B, V): each row's temperature, then top-k, then top-p
    (transformers' order), with that row's settings."""
    logits = logits.float() / rows.temperature
    if rows.max_top_k:
        # (B, K) (a Python int: no device sync); a top_k past V (a draft's smaller vocabulary) keeps all
        top = logits.topk(min(rows.max_top_k, logits.shape[-1]), dim=-1).values
        kth = top.gather(-1, (rows.top_k - 1).clamp(min=0, max=top.shape[-1] - 1))  # (B, 1)
        kth = torch.where(rows.top_k > 0, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if rows.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= rows.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def warp_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """logits (..., V) -> probabilities (..., V) under one T>0 ``sampling``: ``warp_rows`` for every row."""
    flat = logits.reshape(-1, logits.shape[-1])  # (R, V)
    rows = RowSampling.of([sampling] * flat.shape[0], flat.shape[-1], flat.device)
    return warp_rows(flat, rows).reshape(logits.shape)


def choose(logits: Tensor, rows: RowSampling, keys: Tensor) -> Tensor:
    """The target's token for each row at one position, logits (B, V) -> (B,): a greedy row's
    argmax, else the winner of the exponential race on the row's warped law, with the row's key (B,)
    for this position: argmax p(x) / E(x). A token of probability 0 never wins."""
    argmax = logits.argmax(-1)
    if rows.all_greedy:
        return argmax
    race = warp_rows(logits, rows).double() / exponentials(keys, logits.shape[-1])  # (B, V)
    return torch.where(rows.greedy, argmax, race.argmax(-1))


def walk(tokens: Tensor, parents: Tensor, logits: Tensor, rows: RowSampling, keys: Tensor) -> list[Walked]:
    """Every row's walk down its tree: the nodes it accepted and the tokens it commits.

    tokens, parents: (B, N) the trees (node 0 the root; a padding node's parent is -2);
    logits: (B, N, V) the target's at each node; keys: (B, D + 1) long, row b's key for the token
    after its depth-d node. At each depth the row's token is chosen from the current node's
    logits and the walk follows the child holding it (siblings are distinct: at most one). All rows
    advance together on the device; the walks reach the host in one transfer."""
    B, depth = tokens.shape[0], keys.shape[1] - 1
    batch = torch.arange(B, device=tokens.device)
    node = torch.zeros(B, dtype=torch.long, device=tokens.device)  # (B,) the row's current node
    alive = torch.ones(B, dtype=torch.bool, device=tokens.device)  # the row reached this depth
    nodes, chosen = [node], []
    for d in range(depth + 1):
        choice = choose(logits[batch, node], rows, keys[:, d])  # (B,)
        chosen.append(torch.where(alive, choice, -1))
        if d == depth:
            break
        match = (parents == node[:, None]) & (tokens == choice[:, None])  # (B, N)
        alive = alive & match.any(-1)
        node = torch.where(alive, match.long().argmax(-1), node)
        nodes.append(torch.where(alive, node, -1))
    host = torch.cat([torch.stack(nodes, 1), torch.stack(chosen, 1)], 1).tolist()  # (B, 2D + 2)
    return [Walked([n for n in row[: depth + 1] if n >= 0], [t for t in row[depth + 1 :] if t >= 0]) for row in host]
