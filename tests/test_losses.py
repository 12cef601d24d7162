"""Token-alignable training losses: shift, alignment masks, per-pass backward, overfitting."""

from types import SimpleNamespace

import pytest
import torch

from griffin.config import StagePlan, TrainConfig
from griffin.losses import alignment_hits, alignment_mask, next_alignment, shift_batch, token_alignable_step
from griffin.model import GriffinDraft
from tests.conftest import make_target


def test_shift_batch_example():
    ids = torch.tensor([[5, 6, 7, 0]])
    feats = torch.arange(4.0)[None, :, None].expand(1, 4, 2)
    b = shift_batch(feats, ids, torch.tensor([[0, 1, 1, 0]]), torch.tensor([[1, 1, 1, 0]]), window="reference")
    assert b.tokens.tolist() == [[6, 7, 0, 0]]
    assert b.target_features[0, :, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert b.loss_mask.tolist() == [[0, 1, 0, 0]]  # position 2 has no next real token


def test_draft_window_supervises_the_first_draft_of_a_reply():
    """x = [h, a, b, e, n, u]: reply a b e. The decode drafts (f_0, a) -> b first and (f_1, b) -> e
    last; EAGLE's reference mask misses the first and trains (f_3, n) -> u, which nothing drafts."""
    ids, reply = torch.tensor([[10, 11, 12, 13, 14, 15]]), torch.tensor([[0, 1, 1, 1, 0, 0]])
    feats = torch.zeros(1, 6, 2)
    assert shift_batch(feats, ids, reply, window="draft").loss_mask.tolist() == [[1, 1, 0, 0, 0, 0]]
    assert shift_batch(feats, ids, reply, window="reference").loss_mask.tolist() == [[0, 1, 1, 1, 0, 0]]


def test_alignment_hits_hand_example():
    stub = SimpleNamespace(logits=lambda p: p, to_draft_ids=lambda x: x)
    # position t's top-2 over a 4-token vocabulary, and y = [_, 2, 3, 1]: targets y[t+1] = 2, 3, 1, -
    logits = torch.tensor([[[9., 8, 0, 0], [0, 0, 9, 8], [0, 9, 0, 8], [9, 8, 7, 6]]])
    hits = alignment_hits(stub, logits, torch.tensor([[0, 2, 3, 1]]), k=2)
    assert hits.tolist() == [[0, 1, 1, 0]]  # 2 not in {0,1}; 3 in {2,3}; 1 in {1,3}; last forced 0


def test_cumulative_masks_both_conventions():
    """Hand-computed: hits of pass 1 and 2 -> masks for passes 2 and 3 (docs/method.md §3.3)."""
    hits1, hits2 = torch.tensor([[1., 0, 1, 1, 0]]), torch.tensor([[1., 1, 0, 1, 0]])
    cum1 = next_alignment(hits1, None)
    cum2 = next_alignment(hits2, cum1)  # hits2 * shift_right(cum1) = [1,1,0,1,0] * [0,1,0,1,1]
    assert alignment_mask(cum1, "reference").tolist() == [[1, 0, 1, 1, 0]]
    assert alignment_mask(cum2, "reference").tolist() == [[0, 1, 0, 1, 0]]
    assert alignment_mask(cum1, "decode").tolist() == [[0, 1, 0, 1, 1]]
    assert alignment_mask(cum2, "decode").tolist() == [[0, 0, 1, 0, 1]]


def tiny_batch(target, T=24, B=2):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (B, T), generator=gen)
    with torch.no_grad():
        feats = target.model(ids, output_hidden_states=True).hidden_states[-1]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :4] = 0  # a "prompt" that is not trained on
    return shift_batch(feats, ids, mask)


@pytest.mark.parametrize("variant,stage", [("griffin", 1), ("eagle", 1), ("griffin", 3), ("hass", 3)])
def test_losses_decrease_when_overfitting_one_batch(variant, stage):
    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant=variant)
    cfg, plan = TrainConfig(noise_scale=0.0), StagePlan.for_stage(stage, variant, steps=25)
    batch = tiny_batch(target)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses, kept = [], []
    for _ in range(25):
        opt.zero_grad()
        metrics = token_alignable_step(draft, batch, cfg, plan)
        opt.step()
        # pass 1 always trains on the same positions; later passes' masks grow as the draft learns
        losses.append(metrics["loss_1"])
        kept.append(metrics.get(f"mask_kept_{stage}", 1.0))
    assert losses[-1] < 0.7 * losses[0], losses
    assert kept[-1] >= kept[0]


def test_per_pass_backward_sums_gradients():
    """The step's gradient == the sum of each pass's gradient taken on its own."""
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    batch, cfg, plan = tiny_batch(target, T=10), TrainConfig(noise_scale=0.0), StagePlan.for_stage(2, "griffin", steps=1)
    token_alignable_step(draft, batch, cfg, plan)
    total = draft.fusion.fc.weight.grad.clone()
    assert total.abs().sum() > 0
    draft.zero_grad()
    m = token_alignable_step(draft, batch, cfg, plan, backward=False)
    assert m["loss"] == pytest.approx((m["loss_1"] + m["loss_2"]) / 2)
    assert draft.fusion.fc.weight.grad is None


def test_alignment_mask_only_for_griffin():
    target = make_target("llama")
    batch = tiny_batch(target)
    for variant, shrinks in (("griffin", True), ("hass", False)):
        draft = GriffinDraft.for_target(target, variant=variant)
        m = token_alignable_step(draft, batch, TrainConfig(), StagePlan.for_stage(3, variant, steps=1), backward=False)
        assert m["mask_kept_1"] == 1.0
        assert (m["mask_kept_3"] < 0.5) if shrinks else (m["mask_kept_3"] == 1.0)


def test_top_k_acceptance_bounds_the_greedy_chain():
    """A wider k accepts at least as often at every step than the greedy chain (k = 1), and k = the
    draft's whole vocabulary (here the target's: no reduced vocabulary) accepts every first step it reaches."""
    from griffin.training import acceptance_counts

    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    batch = tiny_batch(target)
    greedy = acceptance_counts(draft, batch, 3)
    wide = acceptance_counts(draft, batch, 3, top_k=5)
    assert (wide[0] >= greedy[0]).all() and wide[1, 0] == greedy[1, 0]
    everything = acceptance_counts(draft, batch, 3, top_k=draft.cfg.vocab_size)
    assert everything[0, 0] == everything[1, 0] > greedy[0, 0]
