"""T>0 through the engine: the first three committed tokens have the target's law, alone and
batched (tests/griffin/law.py), with controls planted in the engine that the same test must reject.
The verifier's own law, with every planted verifier bug, is tested on a Markov target in
test_verify.py; here the target is a real (tiny) transformer, its trees come from a real draft, and
the rows share batched verify passes with neighbours of other lengths."""

import pytest
import torch

import griffin.engine
from griffin.config import SamplingConfig, TreeConfig
from griffin.model import GriffinDraft
from tests.conftest import make_target
from tests.griffin.law import CONTROL_P, PASS_P, chi_square_p, engine_windows, exact_joint, planted_verifier

PROMPT, K, N = [1, 4, 3], 3, 1600
SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.7-top_p-top_k": SamplingConfig(temperature=0.7, top_p=0.9, top_k=4),
}
# "leaf": every accepted child is a leaf, so the third token is a bonus whenever a child is accepted;
# "tree": the third token is accepted (or recovered) at depth 2
TREES = {"leaf": TreeConfig(total_tokens=4, depth=1, top_k=3), "tree": TreeConfig(total_tokens=5, depth=2, top_k=2)}


def peaked_pair(variant: str = "griffin"):
    """A tiny target with peaked, context-dependent laws over 6 tokens (a flat law hides bugs) and a
    confident, partly wrong draft. EAGLE-3 reads the target's layer 2 of 5."""
    target = make_target("llama", vocab_size=6, seed=7, **({"num_hidden_layers": 5} if variant == "eagle3" else {}))
    with torch.no_grad():
        target.model.lm_head.weight.mul_(10.0)
    draft = GriffinDraft.for_target(target, variant=variant)
    torch.nn.init.normal_(draft.layer.mlp.down_proj.weight, std=0.5)
    return target, draft


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


def raw_next_token(logits, sampling, generator):
    """A planted prefill bug: the first token drawn from the raw softmax, without the warper."""
    return int(torch.multinomial(logits.float().softmax(-1), 1, generator=generator))


@pytest.mark.parametrize(
    "patch,tree,sampling,batched",
    [
        (("verify", planted_verifier("uniform leaf bonus")), "leaf", "T1", False),
        (("verify", planted_verifier("bonus without warper")), "leaf", "T0.7-top_p-top_k", True),
        (("next_token", raw_next_token), "leaf", "T0.7-top_p-top_k", True),
    ],
    ids=["uniform-leaf-bonus-alone", "bonus-without-warper-batched", "prefill-without-warper-batched"],
)
def test_the_engine_law_test_rejects_planted_bugs(monkeypatch, patch, tree, sampling, batched):
    """The controls: the engine with one bug planted (in its verifier or its prefill draw) fails the
    same test at the same sample size, at p < 1e-6."""
    monkeypatch.setattr(griffin.engine, *patch)
    p_value = law_p(*peaked_pair(), tree, sampling, batched)
    assert p_value < CONTROL_P, f"a planted bug passed: p = {p_value:.1e}"
