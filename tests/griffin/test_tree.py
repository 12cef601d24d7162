"""EAGLE-2 tree construction: budget, ordering, masks, retrieve indices, cache hygiene."""

from types import SimpleNamespace

import pytest
import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.model import GriffinDraft
from griffin.rows import RowCache
from griffin.tree import draft_tree
from tests.conftest import make_target


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama")
    draft = GriffinDraft.for_target(target).eval()
    torch.nn.init.normal_(draft.layer.mlp.down_proj.weight, std=0.3)  # peakier draft: deeper trees
    return target, draft


def build(setup, cfg, T=9):
    target, draft = setup
    cache = RowCache.for_draft(draft.cfg, 1, 128, torch.float32, torch.device("cpu"))
    tree = draft_tree(draft, cache, torch.randn(1, T, 64), torch.randint(3, 128, (1, T)), cfg)
    return tree, cache


@pytest.mark.parametrize(
    "cfg",
    [
        TreeConfig(),
        TreeConfig(total_tokens=6, depth=5, top_k=1),
        TreeConfig(total_tokens=1, depth=1, top_k=1),
        TreeConfig(total_tokens=25, depth=4, top_k=5),
    ],
)
def test_tree_invariants(setup, cfg):
    tree, cache = build(setup, cfg)
    N = cfg.total_tokens
    assert tree.size == N and cache.slots.lengths == [9]  # tree KV was dropped; the catch-up stayed
    assert not cache.tensors[0].keys[:, :, 9:].any()  # and zeroed
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, N):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1 <= cfg.depth
    for i in range(N):  # mask row = self + ancestors
        anc, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            anc.add(j)
        assert set(tree.mask[i].nonzero().flatten().tolist()) == anc
    for row in tree.retrieve.tolist():  # each row is a root-to-leaf path
        path = [n for n in row if n >= 0]
        assert path[0] == 0 and not tree.children[path[-1]]
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
    for kids in tree.children:  # siblings carry distinct tokens
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)


def test_chain_follows_the_draft_argmax(setup):
    """A top_k=1 tree is a chain whose token at each level is the draft's own argmax after the chain
    so far, computed here independently: the draft's step without a cache over the whole sequence
    (the catch-up pairs, then each chain node's (R, token) at the next position), causal attention."""
    _, draft = setup
    T, depth = 9, 3
    gen = torch.Generator().manual_seed(4)
    features, tokens = torch.randn(1, T, 64, generator=gen), torch.randint(3, 128, (1, T), generator=gen)
    cache = RowCache.for_draft(draft.cfg, 1, 128, torch.float32, torch.device("cpu"))
    tree = draft_tree(draft, cache, features, tokens, TreeConfig(total_tokens=depth + 1, depth=depth, top_k=1))
    assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.tokens[0] == tokens[0, -1]
    seq_features, seq_tokens, expected = draft.fuse_target(features), tokens, []
    with torch.no_grad():
        for _ in range(depth):
            L = seq_tokens.shape[1]
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            P, R = draft.step(seq_features, seq_tokens, torch.arange(L), None, causal)  # (1, L, D) each
            top2 = draft.logits(P[0, -1]).topk(2)
            assert top2.values[0] > top2.values[1]  # a strict argmax: the 2nd best differs
            expected.append(int(top2.indices[0]))
            seq_features = torch.cat([seq_features, R[:, -1:]], dim=1)
            seq_tokens = torch.cat([seq_tokens, top2.indices[:1][None]], dim=1)
    assert tree.tokens[1:].tolist() == expected


def test_catch_up_accumulates_across_rounds(setup):
    target, draft = setup
    cache = RowCache.for_draft(draft.cfg, 1, 128, torch.float32, torch.device("cpu"))
    cfg = TreeConfig(total_tokens=10, depth=3, top_k=3)
    draft_tree(draft, cache, torch.randn(1, 5, 64), torch.randint(3, 128, (1, 5)), cfg)
    draft_tree(draft, cache, torch.randn(1, 2, 64), torch.randint(3, 128, (1, 2)), cfg)
    assert cache.slots.lengths == [7]


def test_a_sampling_rows_draft_ranks_first_the_winner_of_the_targets_race_on_its_own_law():
    """A T>0 row's draft runs the race the walk runs (griffin.verify.choose), with the walk's draws for
    each level's position, on its own law warped as the row warps the target's: its best-ranked
    token at every level, and at every node of a level, is ``choose``'s pick on the draft's logits
    spread over the target vocabulary (a reduced draft vocabulary, temperature, top-k and top-p). A
    greedy row ranks by the draft's log-probs."""
    from griffin.tree import DraftRace
    from griffin.verify import RowSampling, choose, position_keys

    gen = torch.Generator().manual_seed(3)
    V_target, V, K, L = 50, 20, 3, 2
    d2t = torch.randperm(V_target, generator=gen)[:V]
    draft = SimpleNamespace(head_weight=torch.zeros(V, 4), to_target_ids=lambda ids: d2t[ids])
    samplings = [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_p=0.8),
        SamplingConfig(temperature=1.3, top_k=4),
        SamplingConfig(temperature=0.9, top_k=30),  # more than the draft's vocabulary: keeps all of it
        SamplingConfig(temperature=0.0),
    ]
    rows = RowSampling.of(samplings, V_target, "cpu")
    B = len(samplings)
    keys = torch.tensor([position_keys(seed, 5, L) for seed in range(B)])  # (B, L)
    race = DraftRace.of(draft, rows, keys)
    for level in range(1, L + 1):
        for trial in range(20):
            logits = torch.randn(B, V, generator=gen) * 3  # (B, V) the draft's
            spread = torch.full((B, V_target), float("-inf")).index_copy(1, d2t, logits)  # (B, V_target)
            expected = choose(spread, rows, keys[:, level - 1])  # (B,)
            assert torch.equal(d2t[race.scores(logits, level).argmax(-1)], expected), (level, trial)
            nodes = race.scores(logits[:, None].expand(B, K, V), level)  # (B, K, V): one position's draws
            assert torch.equal(d2t[nodes.argmax(-1)], expected[:, None].expand(B, K))
            assert torch.equal(race.scores(logits, level)[-1], torch.log_softmax(logits[-1], -1))
    assert DraftRace.of(draft, RowSampling.of([samplings[-1]], V_target, "cpu"), keys[:1]) is None
