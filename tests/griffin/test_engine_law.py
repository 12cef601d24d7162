"""T>0 through the engine: the first three committed tokens have the target's law, alone and
batched (tests/griffin/law.py), with controls planted in the engine that the same test must reject.
The verifier's own law, with every planted verifier bug, is tested on a Markov target in
test_verify.py; here the target is a real (tiny) transformer, its trees come from a real draft, and
the rows share batched verify passes with neighbours of other lengths."""

import pytest
import torch

import griffin.engine
import griffin.request
import griffin.verify
from griffin.config import SamplingConfig, TreeConfig
from tests.griffin.law import CONTROL_P, PASS_P, chi_square_p, engine_windows, exact_joint, peaked_pair

PROMPT, K, N = [1, 4, 3], 3, 1600
SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.7-top_p-top_k": SamplingConfig(temperature=0.7, top_p=0.9, top_k=4),
}
# "leaf": every accepted child is a leaf, so the third token is a bonus whenever a child is accepted;
# "tree": the third token is accepted (or recovered) at depth 2
TREES = {"leaf": TreeConfig(total_tokens=4, depth=1, top_k=3), "tree": TreeConfig(total_tokens=5, depth=2, top_k=2)}


def law_p(target, draft, tree: str, sampling: str, batched: bool) -> float:
    """p-value of the joint law of the first K tokens; a token the target never samples is p = 0."""
    counts = engine_windows(target, draft, PROMPT, TREES[tree], SAMPLINGS[sampling], N, K, batched)
    try:
        return chi_square_p(counts, exact_joint(target, PROMPT, SAMPLINGS[sampling], K))
    except AssertionError:  # chi_square_p's check
        return 0.0


@pytest.mark.parametrize(
    "variant,tree,sampling,batched",
    [
        ("griffin", "leaf", "T1", False),
        ("griffin", "tree", "T0.7-top_p-top_k", False),
        ("griffin", "tree", "T1", True),
        ("griffin", "leaf", "T0.7-top_p-top_k", True),
        ("eagle3", "tree", "T1", True),
    ],
    ids=["alone-leaf-T1", "alone-tree-T0.7", "batched-tree-T1", "batched-leaf-T0.7", "eagle3-batched-tree-T1"],
)
def test_engine_samples_the_targets_law(variant, tree, sampling, batched):
    p_value = law_p(*peaked_pair(variant), tree, sampling, batched)
    assert p_value > PASS_P, f"chi-square p-value {p_value:.1e}"


def raw_choose(logits, rows, keys):
    """A planted bug: the race on the raw softmax, without the warper."""
    return (logits.double().softmax(-1) / griffin.verify.exponentials(keys, logits.shape[-1])).argmax(-1)


def uniform_leaf_bonus(tokens, parents, logits, rows, keys):
    """A planted bug: a row whose walk ends at a leaf replaces its bonus by a uniform token."""
    walks = griffin.verify.walk(tokens, parents, logits, rows, keys)
    for b, walked in enumerate(walks):
        if not bool((parents[b] == walked.nodes[-1]).any()):
            walked.tokens[-1] = int(torch.randint(logits.shape[-1], ()))
    return walks


def one_draw_per_round(row, count):
    """A planted bug: a round reuses its first position's key at every depth."""
    return griffin.verify.position_keys(row.seed, len(row.out), 1) * count


@pytest.mark.parametrize(
    "patch,tree,sampling,batched",
    [
        ((griffin.engine, "walk", uniform_leaf_bonus), "leaf", "T1", False),
        ((griffin.verify, "choose", raw_choose), "leaf", "T0.7-top_p-top_k", True),
        ((griffin.engine, "choose", raw_choose), "leaf", "T0.7-top_p-top_k", True),
        ((griffin.request.Row, "keys", one_draw_per_round), "tree", "T1", True),
    ],
    ids=["uniform-leaf-bonus-alone", "walk-without-warper-batched", "prefill-without-warper-batched",
         "one-draw-per-round-batched"],
)  # fmt: skip
def test_the_engine_law_test_rejects_planted_bugs(monkeypatch, patch, tree, sampling, batched):
    """The controls: the engine with one bug planted (in its walk, its prefill draw or its draws
    per position) fails the same test at the same sample size, at p < 1e-6."""
    monkeypatch.setattr(*patch)
    p_value = law_p(*peaked_pair(), tree, sampling, batched)
    assert p_value < CONTROL_P, f"a planted bug passed: p = {p_value:.1e}"
