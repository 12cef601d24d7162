"""Verification on hand-made trees, its exact law on a Markov target with the controls that prove
the law tests can fail (tests/griffin/law.py), and the position-keyed draws. Pure functions, no model."""

import pytest
import torch

from griffin.config import SamplingConfig
from griffin.tree import _assemble
from griffin.verify import RowSampling, Walked, choose, position_uniforms, walk, warp_probs, warp_rows
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


def walk_one(tree, logits, sampling, uniforms):
    rows = RowSampling.of([sampling], V, "cpu")
    return walk(tree.tokens[None], tree.parents[None], logits[None], rows, torch.tensor([uniforms]).double())[0]


def test_greedy_walk():
    tree = hand_tree()
    logits = torch.full((7, V), -5.0)
    logits[0, 0] = logits[1, 1] = logits[5, 2] = 5.0  # root->0 (node 1) -> 1 (node 5) -> bonus 2
    assert walk_one(tree, logits, SamplingConfig(), [0.5] * 3) == Walked([0, 1, 5], [0, 1, 2])
    logits[0] = -5.0
    logits[0, 3] = 5.0  # target wants 3 at the root: no child matches
    assert walk_one(tree, logits, SamplingConfig(), [0.5] * 3) == Walked([0], [3])


def test_sampled_walk_follows_the_inverse_cdf_of_each_depths_draw():
    """T=1 on uniform laws over 5 tokens: the draw u picks token floor(5u), so the walk is known.
    Root: u=0.1 -> token 0 (node 1); node 1: u=0.3 -> token 1 (node 5, a leaf); bonus: u=0.9 -> 4."""
    tree, flat, t1 = hand_tree(), torch.zeros(7, V), SamplingConfig(temperature=1.0)
    assert walk_one(tree, flat, t1, [0.1, 0.3, 0.9]) == Walked([0, 1, 5], [0, 1, 4])
    # root u=0.5 -> token 2 (node 3, a leaf); the bonus at node 3 reads the depth-1 draw 0.7 -> 3
    assert walk_one(tree, flat, t1, [0.5, 0.7, 0.0]) == Walked([0, 3], [2, 3])
    # root u=0.7 -> token 3: no child holds it, so it is the recovered token
    assert walk_one(tree, flat, t1, [0.7, 0.0, 0.0]) == Walked([0], [3])


def test_rows_walk_with_their_own_sampling_and_draws():
    """A batch of rows (one greedy, three with other warpers; trees of other widths, padded) walks
    as each row alone."""
    trees = [hand_tree(), hand_tree(), MarkovTarget.make(vocab=V).tree(2, "chain"), hand_tree()]
    samplings = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=2),
                 SamplingConfig(temperature=1.3, top_p=0.6)]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    N = max(t.size for t in trees)
    for _ in range(20):
        logits = [torch.randn(t.size, V, generator=gen) * 2 for t in trees]
        uniforms = torch.rand(4, 3, generator=gen, dtype=torch.float64)
        tokens, parents, padded = torch.zeros(4, N, dtype=torch.long), torch.full((4, N), -2), torch.zeros(4, N, V)
        for b, t in enumerate(trees):
            tokens[b, : t.size], parents[b, : t.size], padded[b, : t.size] = t.tokens, t.parents, logits[b]
        batched = walk(tokens, parents, padded, RowSampling.of(samplings, V, "cpu"), uniforms)
        for b, t in enumerate(trees):
            depth = int(t.depths.max())
            assert batched[b] == walk_one(t, logits[b], samplings[b], uniforms[b, : depth + 1].tolist())


def test_each_rows_warper_is_its_own():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    samplings = [SamplingConfig(temperature=0.5), SamplingConfig(temperature=1.0, top_k=7),
                 SamplingConfig(temperature=1.3, top_p=0.6), SamplingConfig(temperature=0.9, top_k=3, top_p=0.8)]  # fmt: skip
    rows = warp_rows(logits, RowSampling.of(samplings, 50, "cpu"))
    for b, sampling in enumerate(samplings):
        assert torch.allclose(rows[b], warp_probs(logits[b], sampling))
        assert torch.allclose(rows[b].double(), reference_probs(logits[b], sampling), atol=1e-6)


def test_choose_never_draws_a_token_outside_the_warped_support():
    logits = torch.tensor([[0.0, -float("inf"), 1.0, 0.5, -1.0]])
    rows = RowSampling.of([SamplingConfig(temperature=1.0, top_k=3)], V, "cpu")  # keeps tokens 0, 2, 3
    draws = torch.linspace(0, 1 - 1e-16, 999, dtype=torch.float64)
    assert {int(choose(logits, rows, u[None])) for u in draws} == {0, 2, 3}


def test_position_draws_are_uniform_independent_and_counter_based():
    """u(seed, i): the same at any start (a position's draw needs no earlier one), distinct across
    seeds and positions; 20 equal bins, and pairs of neighbouring positions and of neighbouring
    seeds, are uniform by chi-square."""
    assert position_uniforms(7, 5, 3) == position_uniforms(7, 0, 8)[5:]
    draws = torch.tensor([position_uniforms(seed, 0, 64) for seed in range(500)], dtype=torch.float64)  # (500, 64)
    assert draws.min() >= 0 and draws.max() < 1 and len(set(draws.flatten().tolist())) == draws.numel()
    bins = torch.bincount((draws * 20).long().flatten(), minlength=20)
    assert chi_square_p(bins, torch.full((20,), 1 / 20)) > PASS_P
    coarse = (draws * 5).long()
    for first, second in [(coarse[:, :-1], coarse[:, 1:]), (coarse[:-1], coarse[1:])]:  # positions, seeds
        pairs = torch.bincount((first * 5 + second).flatten(), minlength=25)
        assert chi_square_p(pairs, torch.full((25,), 1 / 25)) > PASS_P


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
