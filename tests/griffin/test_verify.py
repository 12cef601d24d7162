"""Verification on hand-made trees, its exact law on a Markov target with the controls that prove
the law tests can fail (tests/griffin/law.py), and the position-keyed draws. Pure functions, no model."""

import math

import pytest
import torch

from griffin.config import SamplingConfig
from griffin.tree import _assemble
from griffin.verify import RowSampling, Walked, choose, exponentials, position_keys, walk, warp_probs, warp_rows
from tests.griffin.law import (
    CONTROL_P,
    FAULTS,
    PASS_P,
    MarkovTarget,
    Windows,
    bonus_p,
    chi_square_p,
    griffin_verifier,
    planted_verifier,
    random_keys,
    reference_probs,
    sample_windows,
)

V = 5


def hand_tree():
    """root(0) -> tokens 0, 1, 2 (nodes 1, 2, 3, rank order); node 1 -> tokens 3, 1 (nodes 4, 5);
    node 2 -> token 4 (node 6)."""
    root = torch.tensor([4])
    scores = torch.tensor([-0.1, -0.2, -0.3, -0.5, -0.6, -0.7])
    tokens = torch.tensor([0, 1, 2, 3, 1, 4])
    parents = torch.tensor([-1, -1, -1, 0, 0, 1])
    depths = torch.tensor([1, 1, 1, 2, 2, 2])
    return _assemble(root, scores, tokens, parents, depths, 6)


def test_hand_tree_structure():
    tree = hand_tree()
    assert tree.tokens.tolist() == [4, 0, 1, 2, 3, 1, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.children == [[1, 2, 3], [4, 5], [6], [], [], [], []]
    assert tree.mask[5].tolist() == [True, True, False, False, False, True, False]
    assert sorted(tree.retrieve.tolist()) == [[0, 1, 4], [0, 1, 5], [0, 2, 6], [0, 3, -1]]


def walk_one(tree, logits, sampling, keys):
    rows = RowSampling.of([sampling], V, "cpu")
    return walk(tree.tokens[None], tree.parents[None], logits[None], rows, torch.tensor([keys]))[0]


def test_greedy_walk():
    tree = hand_tree()
    logits = torch.full((7, V), -5.0)
    logits[0, 0] = logits[1, 1] = logits[5, 2] = 5.0  # root->0 (node 1) -> 1 (node 5) -> bonus 2
    assert walk_one(tree, logits, SamplingConfig(), [0] * 3) == Walked([0, 1, 5], [0, 1, 2])
    logits[0] = -5.0
    logits[0, 3] = 5.0  # target wants 3 at the root: no child matches
    assert walk_one(tree, logits, SamplingConfig(), [0] * 3) == Walked([0], [3])


def sequential_walk(tree, logits, sampling, keys) -> Walked:
    """The walk's definition, one depth at a time: the token chosen at the current node with that
    depth's key; move to the child holding it, or end with it."""
    rows, node, nodes, tokens = RowSampling.of([sampling], V, "cpu"), 0, [0], []
    for key in keys:
        token = int(choose(logits[node][None], rows, torch.tensor([key])))
        tokens.append(token)
        child = next((c for c in tree.children[node] if int(tree.tokens[c]) == token), None)
        if child is None:
            return Walked(nodes, tokens)
        node = child
        nodes.append(node)
    raise AssertionError("the keys ran out before the walk ended")


def test_rows_walk_as_the_sequential_definition_with_their_own_sampling_and_keys():
    """A batch of rows (one greedy, three with other warpers; trees of other widths, padded) walks
    as each row alone, and as the walk's one-depth-at-a-time definition; nodes are accepted."""
    trees = [hand_tree(), hand_tree(), MarkovTarget.make(vocab=V).tree(2, "chain"), hand_tree()]
    samplings = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=2),
                 SamplingConfig(temperature=1.3, top_p=0.6)]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    N, accepted = max(t.size for t in trees), 0
    for _ in range(30):
        logits = [torch.randn(t.size, V, generator=gen) * 2 for t in trees]
        keys = random_keys((4, 3), gen)
        tokens, parents, padded = torch.zeros(4, N, dtype=torch.long), torch.full((4, N), -2), torch.zeros(4, N, V)
        for b, t in enumerate(trees):
            tokens[b, : t.size], parents[b, : t.size], padded[b, : t.size] = t.tokens, t.parents, logits[b]
        batched = walk(tokens, parents, padded, RowSampling.of(samplings, V, "cpu"), keys)
        for b, t in enumerate(trees):
            own_keys = keys[b, : int(t.depths.max()) + 1].tolist()
            assert batched[b] == walk_one(t, logits[b], samplings[b], own_keys)
            assert batched[b] == sequential_walk(t, logits[b], samplings[b], own_keys)
            accepted += batched[b].accept_len
    assert accepted > 30


def test_each_rows_warper_is_its_own():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    samplings = [SamplingConfig(temperature=0.5), SamplingConfig(temperature=1.0, top_k=7),
                 SamplingConfig(temperature=1.3, top_p=0.6), SamplingConfig(temperature=0.9, top_k=3, top_p=0.8)]  # fmt: skip
    rows = warp_rows(logits, RowSampling.of(samplings, 50, "cpu"))
    for b, sampling in enumerate(samplings):
        assert torch.allclose(rows[b], warp_probs(logits[b], sampling))
        assert torch.allclose(rows[b].double(), reference_probs(logits[b], sampling), atol=1e-6)


def test_the_race_draws_the_warped_law_independently_per_position_and_seed():
    """choose() over 6 tokens at 12,000 position keys (200 seeds x 60 positions): the tokens follow
    the warped law (top-k 3 at T=0.7: the other 3 are never drawn), and pairs at neighbouring
    positions and at neighbouring seeds are independent (chi-square against the product law). Keys
    are counter-based: a position's key needs none of the ones before."""
    assert position_keys(7, 5, 3) == position_keys(7, 0, 8)[5:]
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -2.0, 0.0])
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    keys = torch.tensor([position_keys(seed, 0, 60) for seed in range(200)])  # (200, 60)
    rows = RowSampling.of([sampling] * keys.numel(), 6, "cpu")
    drawn = choose(logits.expand(keys.numel(), 6), rows, keys.flatten()).view(keys.shape)
    law = reference_probs(logits, sampling)
    assert chi_square_p(torch.bincount(drawn.flatten(), minlength=6), law) > PASS_P
    for first, second in [(drawn[:, :-1], drawn[:, 1:]), (drawn[:-1], drawn[1:])]:  # positions, seeds
        pairs = torch.bincount((first * 6 + second).flatten(), minlength=36)
        assert chi_square_p(pairs, (law[:, None] * law[None]).flatten()) > PASS_P


def test_the_races_exponentials_are_exp1_and_a_function_of_the_key():
    """E(x): positive, mean 1, Exp(1)'s quantiles, and the same again for the same keys."""
    keys = torch.tensor(position_keys(3, 0, 50))
    draws = exponentials(keys, 4000)  # (50, 4000)
    assert torch.equal(draws, exponentials(keys, 4000)) and draws.min() > 0
    assert abs(float(draws.mean()) - 1) < 0.01
    for q in (0.1, 0.5, 0.9):
        assert abs(float(draws.flatten().quantile(q)) + math.log(1 - q)) < 0.01


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.allclose(
        warp_probs(logits, SamplingConfig(temperature=1.0, top_k=2)), torch.tensor([5 / 7, 2 / 7, 0, 0, 0])
    )
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8 so 0.15 is kept too; 0.85 >= 0.8 drops the rest
    assert torch.allclose(
        warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8)), torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85
    )
    assert warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.3)).tolist() == [1.0, 0, 0, 0, 0]


SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.7-top_p": SamplingConfig(temperature=0.7, top_p=0.9),
    "T0.7-top_k": SamplingConfig(temperature=0.7, top_k=3),
}
WINDOW = {"leaf": 3, "chain": 4, "tree": 4}  # tokens observed: a depth-2 leaf's bonus is the 4th
N = 6000  # windows per law test: ~1 s each; every control below is rejected far below 1e-6
MARKOV = MarkovTarget.make()


def law_p(shape: str, sampling: SamplingConfig, verifier=griffin_verifier) -> tuple[float, float, Windows]:
    """p-values of the first tokens' joint law and of the leaf bonus alone; a token the target
    never samples, or a verifier that crashes, is p = 0."""
    try:
        windows = sample_windows(MARKOV, shape, sampling, N, WINDOW[shape], verifier)
        return (
            chi_square_p(windows.counts, MARKOV.law(sampling, WINDOW[shape])),
            bonus_p(MARKOV, sampling, windows.bonus),
            windows,
        )
    except (AssertionError, RuntimeError):
        return 0.0, 0.0, None


def test_warp_equals_transformers_warpers():
    """The warper against an independent one (transformers' generate warpers), on random logits."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for sampling in [*SAMPLINGS.values(), SamplingConfig(temperature=1.3, top_k=7, top_p=0.6)]:
        assert torch.allclose(warp_probs(logits, sampling).double(), reference_probs(logits, sampling), atol=1e-6)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("shape", WINDOW)
def test_committed_tokens_have_the_targets_law(shape, sampling):
    """The first 3-4 committed tokens (a sampled first token, then rounds of tree verification)
    follow the target's law jointly, and every bonus drawn after an accepted leaf follows the
    target's law at that leaf; leaves are reached in most windows, so the bonus is tested."""
    joint, bonus, windows = law_p(shape, sampling)
    assert windows is not None, "the verifier drew a token the target never samples, or crashed"
    assert joint > PASS_P, f"joint law p = {joint:.1e}"
    assert bonus > PASS_P, f"leaf bonus p = {bonus:.1e}"
    assert windows.bonus.sum() > N / 4, f"only {int(windows.bonus.sum())} bonuses in {N} windows"


# each planted bug, and the configurations where it changes the law (the others leave it unchanged:
# e.g. a bonus drawn without the warper is the right law at T=1 with no truncation)
CONTROLS = {
    "no renormalisation": [("leaf", "T1"), ("tree", "T0.7-top_p")],
    "first child x1.3": [("leaf", "T1"), ("chain", "T0.7-top_k")],
    "uniform leaf bonus": [("leaf", "T1"), ("chain", "T1")],
    "bonus without warper": [("leaf", "T0.7-top_k"), ("chain", "T0.7-top_p")],
    "top-p one side": [("leaf", "T0.7-top_p"), ("tree", "T0.7-top_p")],
    "residual keeps rejected": [("leaf", "T1"), ("tree", "T0.7-top_k")],
    "root law at every depth": [("chain", "T1"), ("tree", "T0.7-top_k")],
    "temperature twice": [("leaf", "T0.7-top_p"), ("chain", "T0.7-top_k")],
}


@pytest.mark.parametrize("fault", CONTROLS)
def test_the_law_tests_reject_every_planted_bug(fault):
    """The controls: the same statistic at the same sample size rejects a verifier with one known
    bug (tests/griffin/law.py FAULTS) at p < 1e-6, so the law tests above have the power they claim."""
    assert set(CONTROLS) == set(FAULTS)
    for shape, name in CONTROLS[fault]:
        joint, bonus, _ = law_p(shape, SAMPLINGS[name], planted_verifier(fault))
        assert min(joint, bonus) < CONTROL_P, f"{fault} passed on {shape} {name}: p = {joint:.1e}, {bonus:.1e}"
