"""Verification functions on hand-made trees and distributions (pure functions, no model)."""

import pytest
import torch
from scipy.stats import chisquare

from griffin.config import SamplingConfig
from griffin.verify import VerifyResult, sample_one, verify_greedy, verify_sampling, warp_probs
from griffin.tree import _assemble

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


def test_greedy_walk():
    tree = hand_tree()
    logits = torch.full((7, V), -5.0)
    logits[0, 0] = logits[1, 1] = logits[5, 2] = 5.0  # root->0 (node 1) -> 1 (node 5) -> bonus 2
    assert verify_greedy(tree, logits) == VerifyResult([0, 1, 5], 2)
    logits[0] = -5.0
    logits[0, 3] = 5.0  # target wants 3 at the root: no child matches
    assert verify_greedy(tree, logits) == VerifyResult([0], 3)


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


def verify_without_renormalisation(tree, target_logits, sampling, generator):
    """A WRONG verifier (zeroes rejected children but never renormalises) for the negative check."""
    tokens, node, path = tree.tokens.tolist(), 0, [0]
    while True:
        probs = warp_probs(target_logits[node], sampling)
        for child in tree.children[node]:
            if float(torch.rand((), generator=generator)) < float(probs[tokens[child]]):
                node = child
                path.append(node)
                break
            probs[tokens[child]] = 0.0
        else:
            return VerifyResult(path, sample_one(probs, generator))


def first_two_tokens(verifier, sampling, n=20000):
    """Histogram of the first committed token, and of the second given the first is token 0."""
    tree = hand_tree()
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(3)) * 0.8
    gen = torch.Generator().manual_seed(0)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        result = verifier(tree, logits, sampling, gen)
        committed = tree.tokens[result.accepted_nodes[1:]].tolist() + [result.next_token]
        first[committed[0]] += 1
        if committed[0] == 0:
            second[committed[1]] += 1
    return first, second, warp_probs(logits[0], sampling), warp_probs(logits[1], sampling)


def p_value(counts, probs):
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token the warper removed"
    assert keep.sum() > 1, "degenerate test distribution: pick other logits"
    probs = probs[keep].double() / probs[keep].double().sum()  # float64: chisquare checks the totals
    return chisquare(counts[keep].double().numpy(), (probs * counts.sum()).numpy()).pvalue


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top_p"])
def test_tree_rejection_sampling_is_exact(sampling):
    """20k draws: first token ~ target at the root; second (after token 0) ~ target at node 1."""
    first, second, p_root, p_node = first_two_tokens(verify_sampling, sampling)
    assert p_value(first, p_root) > 1e-3
    assert p_value(second, p_node) > 1e-3


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top_p"])
def test_negative_check_detects_missing_renormalisation(sampling):
    """The same test rejects a verifier that skips the residual renormalisation."""
    first, _, p_root, _ = first_two_tokens(verify_without_renormalisation, sampling)
    assert p_value(first, p_root) < 1e-6
