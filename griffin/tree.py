"""EAGLE-2 dynamic draft trees with a GRIFFIN draft (docs/method.md §4), for several requests at once.

Per round: a catch-up pass feeds each row's newly committed (target feature, next token) pairs into
the draft's persistent KV cache (a griffin.rows.RowCache, a length per row); then ``depth`` levels
expand each row's ``top_k`` best nodes by cumulative log-probability, all rows in one draft step per
level; finally each row's ``total_tokens - 1`` best candidates form its tree. Tree KV entries are
written after the committed cache and dropped (zeroed) at the end of the round. A T>0 row ranks
its nodes by the draft's run of the target's race (``DraftRace``).

Shape legend: D hidden, V draft vocab, K top-k, N tree nodes (root included), M candidate pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from typing import Any

from griffin.config import TreeConfig
from griffin.model import GriffinDraft
from griffin.rows import row_mask
from griffin.verify import RowSampling, exponentials_at, warp_rows


@dataclass
class DraftTree:
    """Node 0 is the root: the last committed-but-unverified token. Nodes are in parent-before-child
    order and, under one parent, in the draft's rank order."""

    tokens: Tensor  # (N,) target token ids
    parents: Tensor  # (N,) parent node index; -1 for the root
    depths: Tensor  # (N,) 0 for the root
    mask: Tensor  # (N, N) bool: row i = i and its ancestors
    retrieve: Tensor  # (P, max_depth + 1) node indices root -> leaf, padded with -1
    children: list[list[int]] = field(default_factory=list)  # node -> children, rank order

    @property
    def size(self) -> int:
        return self.tokens.numel()


@dataclass
class DraftRace:
    """The T>0 rows' draws, run by the draft too, so that its tree holds the token the target will draw.

    A T>0 row's token at a position is the winner of an exponential race on the target's law p with
    that position's draws E (griffin.verify: argmax p(x) / E(x)). The draft runs the same race on its
    own law q with the same draws: where q is close to p the two winners agree (Gumbel-max coupling:
    they agree with probability at least (1 - TV) / (1 + TV)), so the draft's winner is the child most
    likely to be accepted however flat p is, where a top-k tree covers only p's mass on q's k best
    tokens. A T>0 row's children are ranked by log softmax(log q - log E): the winner first, then the
    race's runners-up. Only the tree changes: the walk, and so every committed token, is the same
    function of the draws with any tree (lossless, and a seeded request's text unchanged)."""

    rows: RowSampling  # the B rows' settings: a greedy row ranks by the draft's log-probs
    keys: Tensor  # (B, L) long: each row's key for the position of level l + 1 (the walk's)
    token_ids: Tensor  # (V,) the target ids of the draft's vocabulary

    @classmethod
    def of(cls, draft: GriffinDraft, rows: RowSampling, keys: Tensor) -> "DraftRace | None":
        """Rows' settings and their keys (B, L) for the next L output positions (griffin.verify.position_keys,
        the walk's keys); None when every row is greedy."""
        if rows.all_greedy:
            return None
        ids = draft.to_target_ids(torch.arange(draft.head_weight.shape[0], device=keys.device))  # (V,)
        return cls(rows, keys, ids)

    def scores(self, logits: Tensor, level: int) -> Tensor:
        """The draft's logits (B, V) or (B, K, V) at ``level``'s nodes -> log-scores of the same shape:
        a T>0 row's log softmax(log q - log E), q the draft's law warped as the row warps the
        target's (griffin.verify.warp_rows); a greedy row's log q."""
        B, V = logits.shape[0], logits.shape[-1]
        per_row = logits.numel() // (B * V)  # nodes a row has at this level: 1 or K
        lead = (1,) * (logits.dim() - 2)  # () or (1,): the K nodes of a level share the position's draws
        warped = warp_rows(logits.reshape(-1, V), self.rows.repeat(per_row)).view(logits.shape)  # (..., V)
        # (B, V): one level's draws at a time, so a 128k vocabulary never holds L of them at once
        log_draws = exponentials_at(self.keys[:, level - 1], self.token_ids).log().float()
        raced = torch.log_softmax(warped.log() - log_draws.view(B, *lead, V), dim=-1)
        return torch.where(self.rows.greedy.view(B, *lead, 1), torch.log_softmax(logits, dim=-1), raced)


def _top_k_log_probs(
    draft: GriffinDraft, prediction: Tensor, k: int, race: DraftRace | None = None, level: int = 1
) -> tuple[Tensor, Tensor]:
    """prediction: (B, D) or (B, K, D) at ``level`` -> log-scores and target ids of the k best
    tokens: (..., K) each; the draft's log-probs, or ``race``'s scores for its T>0 rows."""
    with record_function("griffin.draft.head_topk"):
        logits = draft.logits(prediction).float()  # (..., V)
        log_probs = torch.log_softmax(logits, dim=-1) if race is None else race.scores(logits, level)
        top = log_probs.topk(k, dim=-1)
        return top.values, draft.to_target_ids(top.indices)


@torch.inference_mode()
def draft_tree(
    draft: GriffinDraft,
    cache: Any,  # a one-row griffin.rows.RowCache (``RowCache.for_draft(cfg, 1, ...)``)
    features: Tensor,  # (1, T, D_f) target features of the newly committed positions
    tokens: Tensor,  # (1, T) the tokens that follow them; tokens[0, -1] is the root
    cfg: TreeConfig,
    race: DraftRace | None = None,
) -> DraftTree:
    """One request's tree: ``draft_rows`` over a batch of one."""
    with record_function("griffin.draft.catch_up"):
        P, R = catch_up_rows(draft, cache, features, tokens, [tokens.shape[1]])  # (1, D) each
    return draft_rows(draft, cache, P, R, tokens[:, -1], cfg, race=race)[0]


def root_tree(root: Tensor) -> DraftTree:
    """The tree of just its root (1,): plain decoding's one token per row."""
    empty = torch.empty(0, dtype=torch.long, device=root.device)
    return _assemble(root, torch.empty(0, device=root.device), empty, empty, empty, 0)


def chain_tree(root: Tensor, tokens: Tensor, depth: int) -> DraftTree:
    """The tree of ``tokens`` (L,) under ``root`` (1,), at most ``depth`` deep: a chain of the first
    ``depth``, the rest children of the chain's last node. A verify pass over L + 1 nodes, and a walk
    no deeper than the trees being timed."""
    L, device = tokens.numel(), root.device
    depths = torch.arange(1, L + 1, device=device).clamp(max=depth)  # (L,)
    parents = torch.arange(-1, L - 1, device=device).clamp(max=depth - 2)  # pool index: the chain's end
    return _assemble(root, -torch.arange(L, device=device).float(), tokens.to(device), parents, depths, L)


def _assemble(root: Tensor, scores: Tensor, tokens: Tensor, parents: Tensor, depths: Tensor, n_keep: int) -> DraftTree:
    """Rerank the candidate pool (M,) to the n_keep best and build mask / depths / retrieve indices."""
    device = root.device
    # Stable sort: on equal scores the lower pool index (an ancestor) wins, so the kept set is
    # closed under ancestors even when a child's log-prob rounds to 0.
    order = torch.sort(scores, descending=True, stable=True).indices[:n_keep]
    keep = torch.sort(order).values  # pool order = parent before child, rank order among siblings
    node_of_pool = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=device)
    node_of_pool[keep] = torch.arange(1, n_keep + 1, device=device)
    # E.g. keep=[0, 3, 12]: pool 0 -> node 1, pool 3 -> node 2, pool 12 -> node 3; parent -1 -> root 0
    node_parents = torch.where(parents[keep] < 0, 0, node_of_pool[parents[keep].clamp(min=0)])
    assert bool((node_parents >= 0).all()), "reranked tree lost an ancestor"
    N = n_keep + 1
    all_parents = torch.cat([torch.tensor([-1], device=device), node_parents])  # (N,)
    all_depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths[keep]])  # (N,)
    all_tokens = torch.cat([root, tokens[keep].to(root.dtype)])  # (N,)

    mask = torch.eye(N, dtype=torch.bool, device=device)
    ancestor = all_parents.clone()
    for _ in range(int(all_depths.max())):  # climb one generation per iteration
        has = ancestor >= 0
        mask[torch.arange(N, device=device)[has], ancestor[has]] = True
        ancestor = torch.where(has, all_parents[ancestor.clamp(min=0)], ancestor)

    children: list[list[int]] = [[] for _ in range(N)]
    for node, parent in enumerate(all_parents.tolist()[1:], start=1):
        children[parent].append(node)
    leaves = torch.tensor([i for i in range(N) if not children[i]], device=device)
    # retrieve[p, d] = the depth-d node on leaf p's path; e.g. leaf 5 with ancestors 0,2 at depths
    # 0,1 and itself at depth 2 -> [0, 2, 5, -1, ...]
    retrieve = torch.full((leaves.numel(), int(all_depths.max()) + 1), -1, dtype=torch.long, device=device)
    rows, cols = mask[leaves].nonzero(as_tuple=True)
    retrieve[rows, all_depths[cols]] = cols
    return DraftTree(all_tokens, all_parents, all_depths, mask, retrieve, children)


# ---- several requests at once (griffin.engine): rows [0, B) of a griffin.rows.RowCache ----------------
def catch_up_rows(
    draft: GriffinDraft, cache, features: Tensor, tokens: Tensor, counts: list[int], compiled: bool = False
) -> tuple[Tensor, Tensor]:
    """``catch_up`` for rows [0, B): row b feeds its first counts_b pairs of features (B, T, D_f) and
    tokens (B, T) (padded to T); the padding's entries are dropped again. Returns P, R of each row's
    last real pair: (B, D) each. ``compiled``: the draft's compiled step (griffin.static)."""
    B, T = tokens.shape
    starts, width = cache.slots.begin(0, B, T, static=compiled)
    positions = starts[:, None] + torch.arange(T, device=tokens.device)  # (B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril().expand(B, T, T)
    mask = row_mask(starts, causal, width)[:, None]  # (B, 1, T, W)
    step = draft.step_compiled if compiled else draft.step
    P, R = step(draft.fuse_target(features), tokens, positions, cache, mask)  # (B, T, D)
    cache.advance(0, counts, T)
    last = torch.tensor(counts, device=P.device) - 1  # (B,)
    rows = torch.arange(B, device=P.device)
    return P[rows, last], R[rows, last]


def draft_rows(
    draft: GriffinDraft,
    cache,
    P: Tensor,
    R: Tensor,
    roots: Tensor,
    cfg: TreeConfig,
    compiled: bool = False,
    race: DraftRace | None = None,
) -> list[DraftTree]:
    """``draft_tree``'s levels for rows [0, B) at once, from each row's last caught-up P, R (B, D)
    and its root token roots (B,); one tree per row. The tree's entries are dropped from the cache
    at the end (zeroed: griffin.rows' invariant). Runs in the caller's autograd mode (the engine's:
    griffin.static.decode_mode); ``compiled``: the draft's compiled step; ``race``: the T>0 rows'
    draws (at least ``cfg.depth`` positions), None when every row is greedy."""
    B, K, device = roots.shape[0], cfg.top_k, roots.device
    if cfg.total_tokens == 1:
        return [root_tree(roots[b : b + 1]) for b in range(B)]
    stable = cache.slots.lengths[:B]  # committed lengths (a copy)
    stable_t = torch.tensor(stable, device=device)  # (B,)
    scores, node_tokens = _top_k_log_probs(draft, P, K, race)  # (B, K)
    pool_scores, pool_tokens = [scores], [node_tokens]
    pool_parents = [torch.full((B, K), -1, dtype=torch.long, device=device)]
    pool_depths = [torch.ones(B, K, dtype=torch.long, device=device)]
    node_pool_idx = torch.arange(K, device=device).expand(B, K)  # (B, K)
    node_features = R[:, None].expand(B, K, R.shape[-1])  # (B, K, D)
    node_anc = torch.zeros(B, K, 0, dtype=torch.bool, device=device)  # (B, K, E)
    eye = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
    step = draft.step_compiled if compiled else draft.step
    for level in range(2, cfg.depth + 1):
        tree_rows = torch.cat([node_anc, eye], dim=2)  # (B, K, E+K)
        _, width = cache.slots.begin(0, B, K, static=compiled)
        mask = row_mask(stable_t, tree_rows, width)[:, None]  # (B, 1, K, W)
        positions = (stable_t + level - 2)[:, None].expand(B, K)
        with record_function("griffin.draft.level_step"):
            P_l, R_l = step(node_features, node_tokens, positions, cache, mask)  # (B, K, D)
        cache.advance(0, [K] * B, K)
        child_lp, child_tokens = _top_k_log_probs(draft, P_l, K, race, level)  # (B, K, K)
        cand_scores = (scores[:, :, None] + child_lp).flatten(1)  # (B, K*K); candidate c's parent is c // K
        parent_local = torch.arange(K, device=device).repeat_interleave(K)  # (K*K,)
        pool_scores.append(cand_scores)
        pool_tokens.append(child_tokens.flatten(1))
        pool_parents.append(node_pool_idx[:, parent_local])
        pool_depths.append(torch.full((B, K * K), level, dtype=torch.long, device=device))
        best = cand_scores.topk(K, dim=1).indices  # (B, K)
        node_pool_idx = sum(s.shape[1] for s in pool_scores[:-1]) + best
        scores, node_tokens = cand_scores.gather(1, best), child_tokens.flatten(1).gather(1, best)
        parents = best // K  # (B, K)
        node_features = R_l.gather(1, parents[..., None].expand(-1, -1, R_l.shape[-1]))
        node_anc = tree_rows.gather(1, parents[..., None].expand(-1, -1, tree_rows.shape[-1]))
    _drop_tree_entries(cache, stable, cache.slots.lengths[0] - stable[0])
    scores_all, tokens_all, parents_all, depths_all = (
        torch.cat(pool, dim=1) for pool in (pool_scores, pool_tokens, pool_parents, pool_depths)
    )  # (B, M) each
    with record_function("griffin.draft.assemble"):
        return [
            _assemble(
                roots[b : b + 1], scores_all[b], tokens_all[b], parents_all[b], depths_all[b], cfg.total_tokens - 1
            )
            for b in range(B)
        ]


def _drop_tree_entries(cache, stable: list[int], written: int) -> None:
    """Rows [0, B) go back to their committed lengths ``stable``, the tree's ``written`` entries zeroed."""
    cache.slots.lengths[: len(stable)] = stable
    cache.advance(0, [0] * len(stable), written)


@dataclass
class TreeBatch:
    """A round's trees, one per row (griffin.engine), stacked and padded to the widest (N): a padding
    node has token 0, depth 0, no parent (-2: never a child of any node) and sees only itself."""

    tokens: Tensor  # (B, N)
    depths: Tensor  # (B, N)
    parents: Tensor  # (B, N); -1 for a root
    mask: Tensor  # (B, N, N) bool: node i and its ancestors

    @classmethod
    def of(cls, trees: list[DraftTree], device: torch.device) -> "TreeBatch":
        B, N = len(trees), max(t.size for t in trees)
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        depths = torch.zeros(B, N, dtype=torch.long, device=device)
        parents = torch.full((B, N), -2, dtype=torch.long, device=device)
        mask = torch.eye(N, dtype=torch.bool, device=device).repeat(B, 1, 1)
        for b, t in enumerate(trees):
            tokens[b, : t.size], depths[b, : t.size], parents[b, : t.size] = t.tokens, t.depths, t.parents
            mask[b, : t.size, : t.size] = t.mask
        return cls(tokens, depths, parents, mask)
