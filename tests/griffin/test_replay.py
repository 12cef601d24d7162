"""The draft-only replay of speculative decoding (greedy, or seeded at T>0) reproduces the real decode round for round."""

import pytest
import torch

from griffin import decode, engine, replay
from griffin.config import TreeConfig
from griffin.model import GriffinDraft
from griffin.replay import decode_reference, replay_decode
from tests.conftest import OracleDraft, make_target

TREES = [
    TreeConfig(total_tokens=6, depth=5, top_k=1),
    TreeConfig(total_tokens=12, depth=3, top_k=4),
    TreeConfig(total_tokens=60, depth=6, top_k=10),
]


def _recording(monkeypatch, module, trees: list, name: str = "draft_tree"):
    """Records each tree ``module.<name>`` drafts: one per call (``draft_tree``), or per row (``draft_rows``)."""
    real = getattr(module, name)

    def record(*args, **kwargs):
        nodes = real(*args, **kwargs)
        trees.extend(t.tokens.tolist() for t in (nodes if isinstance(nodes, list) else [nodes]))
        return nodes

    monkeypatch.setattr(module, name, record)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.total_tokens}/{t.depth}/{t.top_k}")
@pytest.mark.parametrize("kind", ["griffin", "oracle"])
def test_replay_drafts_the_same_trees_and_accepts_the_same_tokens(kind, tree, monkeypatch):
    """fp32: every round's tree, accepted length and the round count equal speculative_generate's,
    with a random GRIFFIN draft (reads the target's features; few acceptances) and an oracle draft
    (long acceptances), through the length limit and a stop token inside an accepted run."""
    target = make_target("llama")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    for case in range(3):
        ids = torch.randint(3, 128, (1, 4 + 5 * case), generator=gen)
        full = decode.vanilla_generate(target, ids, replay.GREEDY, 20, stop_token_ids=[]).tokens
        stop = [] if case < 2 else [full[9]]  # case 2 ends at a stop token
        draft = (
            GriffinDraft.for_target(target, variant="griffin")
            if kind == "griffin"
            else OracleDraft(target, int(ids[0, 0]))
        )
        real_trees, replayed_trees = [], []
        _recording(monkeypatch, engine, real_trees, "draft_rows")
        spec = decode.speculative_generate(target, draft, ids, tree, replay.GREEDY, 20, stop_token_ids=stop)
        if kind == "oracle":
            draft = OracleDraft(target, int(ids[0, 0]))  # its token history starts over
        _recording(monkeypatch, replay, replayed_trees)
        reference = decode_reference(target, ids, 20, lookahead=tree.depth, stop_token_ids=stop)
        replayed = replay_decode(draft, reference, tree)
        assert reference.continuation[: reference.length] == spec.tokens
        assert replayed_trees == real_trees
        assert replayed.accepted_per_round == spec.stats.accepted_per_round
        assert replayed.tau == pytest.approx(spec.stats.acceptance_length)
        assert len(replayed.draft_seconds) == spec.stats.rounds
        if kind == "oracle" and tree.top_k == 1:
            assert replayed.tau > 4.0  # long runs accepted, the last round's past the limit included


def test_replay_reproduces_a_seeded_sampling_decode():
    """At T=1 a seeded speculative decode commits the target's seeded vanilla continuation (draws keyed
    by position), so replaying that continuation gives its rounds exactly: every round's accepted
    length, on a peaked target whose draft is accepted often."""
    from griffin.config import SamplingConfig
    from tests.griffin.law import peaked_pair

    target, draft = peaked_pair()
    tree, sampling, accepted = TreeConfig(total_tokens=8, depth=3, top_k=3), SamplingConfig(temperature=1.0), 0
    gen = torch.Generator().manual_seed(2)
    for seed in range(4):
        ids = torch.randint(0, 6, (1, 3 + 2 * seed), generator=gen)
        spec = decode.speculative_generate(target, draft, ids, tree, sampling, 20, seed, stop_token_ids=[])
        reference = decode_reference(target, ids, 20, tree.depth, stop_token_ids=[], sampling=sampling, seed=seed)
        assert reference.continuation[:20] == spec.tokens
        assert replay_decode(draft, reference, tree).accepted_per_round == spec.stats.accepted_per_round
        accepted += sum(spec.stats.accepted_per_round)
    assert accepted >= 20
