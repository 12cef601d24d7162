"""Token-alignable training losses: shift, alignment masks, per-pass backward, overfitting."""

import faulthandler
import math
import time
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
    logits = torch.tensor([[[9.0, 8, 0, 0], [0, 0, 9, 8], [0, 9, 0, 8], [9, 8, 7, 6]]])
    hits = alignment_hits(stub, logits, torch.tensor([[0, 2, 3, 1]]), k=2)
    assert hits.tolist() == [[0, 1, 1, 0]]  # 2 not in {0,1}; 3 in {2,3}; 1 in {1,3}; last forced 0


def test_cumulative_masks_both_conventions():
    """Hand-computed: hits of pass 1 and 2 -> masks for passes 2 and 3 (docs/method.md §3.3)."""
    hits1, hits2 = torch.tensor([[1.0, 0, 1, 1, 0]]), torch.tensor([[1.0, 1, 0, 1, 0]])
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
    """With R detached between passes (GRIFFIN's per-pass rule), the step's gradient of every weight ==
    the sum of each pass's own gradient: pass 1's loss and pass 2's loss (pass 2 reading pass 1's R
    detached, under pass 1's alignment mask), each differentiated on its own with autograd.grad. A
    wide alignment top-k keeps pass 2 some positions of the untrained draft, so its term is not zero.
    Also: the step's "loss" is the mean over passes, and backward=False leaves every gradient unset."""
    from griffin.losses import pass_loss, pass_losses

    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    batch, cfg, plan = (
        tiny_batch(target, T=10),
        TrainConfig(noise_scale=0.0, align_top_k=50),
        StagePlan.for_stage(2, "griffin", steps=1),
    )
    assert not cfg.full_backprop(plan)
    m = token_alignable_step(draft, batch, cfg, plan)
    assert 0 < m["mask_kept_2"] < 1  # the alignment mask is at work and leaves pass 2 positions
    params = [p for p in draft.parameters() if p.requires_grad]
    step_grads = [p.grad.clone() for p in params]
    assert m["loss"] == pytest.approx((m["loss_1"] + m["loss_2"]) / 2)
    draft.zero_grad()
    token_alignable_step(draft, batch, cfg, plan, backward=False)
    assert all(p.grad is None for p in params)  # backward=False runs no backward
    # by hand, each pass on its own graph
    teacher = torch.softmax(draft.target_logits(batch.target_features).float(), -1)
    P1, R1 = draft([batch.features], batch.tokens, batch.attention_mask)
    l1 = pass_loss(pass_losses(draft, P1, R1, batch, teacher, batch.loss_mask, cfg.topk_loss_k), cfg, plan)
    hits = alignment_hits(draft, P1.detach(), batch.tokens, cfg.align_top_k)
    mask2 = batch.loss_mask * alignment_mask(next_alignment(hits, None), cfg.mask_shift)
    stream2 = draft.next_stream(batch.features, R1.detach())
    P2, R2 = draft([batch.features, stream2], batch.tokens, batch.attention_mask)
    l2 = pass_loss(pass_losses(draft, P2, R2, batch, teacher, mask2, cfg.topk_loss_k), cfg, plan)
    assert m["loss_1"] == pytest.approx(l1.item()) and m["loss_2"] == pytest.approx(l2.item())
    g1 = torch.autograd.grad(l1, params, allow_unused=True, materialize_grads=True)
    g2 = torch.autograd.grad(l2, params, allow_unused=True, materialize_grads=True)
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert names[0] == "fusion.fc.weight" and g1[0].abs().sum() > 0 and g2[0].abs().sum() > 0  # both passes count
    for name, step, a, b in zip(names, step_grads, g1, g2):
        torch.testing.assert_close(step, a + b, rtol=1e-5, atol=1e-7, msg=name)


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


VARIANTS = ["griffin", "hass", "eagle", "eagle3", "griffin3"]


def variant_batch(target, draft, T=24, seed=0):
    """A batch with the inputs ``draft`` reads: the final feature, or its feature layers."""
    from griffin.target import layer_features

    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target.backbone(input_ids=ids, output_hidden_states=list(draft.cfg.feature_layers or ()) or True)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[:, :4] = 0
    layers = layer_features(out, draft.cfg.feature_layers) if draft.cfg.feature_layers else None
    return shift_batch(out.last_hidden_state, ids, mask, layer_features=layers)


def dead_rows(draft: GriffinDraft) -> dict[str, list[int]]:
    """Trainable weights with rows (first-dim slices) whose gradient is exactly zero."""
    dead = {}
    for name, param in draft.named_parameters():
        norms = param.grad.reshape(param.shape[0], -1).abs().sum(1) if param.grad is not None else torch.zeros(1)
        if rows := (norms == 0).nonzero().flatten().tolist():
            dead[name] = rows[:3] + (["..."] if len(rows) > 3 else [])
    return dead


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_trainable_row_learns_in_a_three_pass_step(variant):
    """One 3-pass step with each variant's defaults gives every row of every trainable weight a
    gradient. GRIFFIN-3 has no feature loss, so with R detached between passes (the official GRIFFIN
    rule, "per_pass") the R half of its token-enhanced head (down_proj rows D..2D) learned nothing."""
    torch.manual_seed(0)
    target = make_target("llama", num_hidden_layers=5)
    draft = GriffinDraft.for_target(target, variant=variant)
    batch, plan = variant_batch(target, draft), StagePlan.for_stage(3, variant, steps=1)
    cfg = TrainConfig(noise_scale=0.0)
    assert cfg.full_backprop(plan) == (variant in ("eagle3", "griffin3"))
    token_alignable_step(draft, batch, cfg, plan)
    assert dead_rows(draft) == {}
    if variant == "griffin3":
        draft.zero_grad()
        token_alignable_step(draft, batch, TrainConfig(noise_scale=0.0, ttt_backprop="per_pass"), plan)
        D = draft.cfg.hidden_size
        assert draft.layer.mlp.down_proj.weight.grad[D:].abs().sum() == 0  # the defect "full" mends
        assert draft.layer.mlp.down_proj.weight.grad[:D].abs().sum() > 0


def test_full_backprop_is_one_backward_over_the_weighted_pass_losses():
    """ "full" == autograd of sum_j decay^(j-1) * loss_j through the passes' shared graph; with one pass
    both rules agree."""
    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    batch = tiny_batch(target, T=12)
    one = StagePlan.for_stage(1, "griffin", steps=1)
    grads = []
    for rule in ("full", "per_pass"):
        draft.zero_grad()
        token_alignable_step(draft, batch, TrainConfig(noise_scale=0.0, ttt_backprop=rule), one)
        grads.append(draft.fusion.fc.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    cfg, plan = (
        TrainConfig(noise_scale=0.0, ttt_backprop="full", pass_weight_decay=0.8),
        StagePlan.for_stage(2, "griffin", steps=1),
    )
    draft.zero_grad()
    m = token_alignable_step(draft, batch, cfg, plan)
    full = draft.fusion.fc.weight.grad.clone()
    draft.zero_grad()
    # by hand: pass 2 reads pass 1's R with its graph
    P1, R1 = draft([batch.features], batch.tokens, batch.attention_mask)
    teacher = torch.softmax(draft.target_logits(batch.target_features).float(), -1)
    from griffin.losses import pass_loss, pass_losses

    l1 = pass_loss(pass_losses(draft, P1, R1, batch, teacher, batch.loss_mask, cfg.topk_loss_k), cfg, plan)
    from griffin.losses import alignment_hits, next_alignment

    mask2 = batch.loss_mask * alignment_mask(
        next_alignment(alignment_hits(draft, P1.detach(), batch.tokens, 3), None), "reference"
    )
    P2, R2 = draft([batch.features, draft.next_stream(batch.features, R1)], batch.tokens, batch.attention_mask)
    l2 = pass_loss(pass_losses(draft, P2, R2, batch, teacher, mask2, cfg.topk_loss_k), cfg, plan)
    (l1 + 0.8 * l2).backward()
    assert m["loss_1"] == pytest.approx(l1.item()) and m["loss_2"] == pytest.approx(l2.item())
    torch.testing.assert_close(full, draft.fusion.fc.weight.grad, rtol=1e-5, atol=1e-7)


def test_lk_token_terms_by_hand():
    from griffin.losses import token_term

    parts = {"token": torch.tensor(2.0), "alpha": torch.tensor(0.5)}
    assert float(token_term(parts, TrainConfig(token_loss="kl"))) == 2.0
    assert float(token_term(parts, TrainConfig(token_loss="lk"))) == pytest.approx(-math.log(0.5))
    w = math.exp(-0.5)
    assert float(token_term(parts, TrainConfig(token_loss="lk_hybrid"))) == pytest.approx(w * 2.0 + (1 - w) * 0.5)
    # the expected acceptance of identical distributions is 1, of disjoint ones 0
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    batch = tiny_batch(target, T=8)
    P = batch.target_features  # the draft predicting the target's own feature: q = p
    teacher = torch.softmax(draft.target_logits(batch.target_features).float(), -1)
    from griffin.losses import pass_losses

    assert float(pass_losses(draft, P, P, batch, teacher, batch.loss_mask, 10)["alpha"]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("token_loss", ["kl", "lk", "lk_hybrid"])
def test_every_token_loss_raises_the_expected_acceptance(token_loss):
    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    cfg, plan = TrainConfig(noise_scale=0.0, token_loss=token_loss), StagePlan.for_stage(2, "griffin", steps=20)
    batch = tiny_batch(target)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    alphas = []
    for _ in range(20):
        opt.zero_grad()
        alphas.append(token_alignable_step(draft, batch, cfg, plan)["alpha_1"])
        opt.step()
    # the tiny random target's distributions are flat, so acceptance starts high: watch what is missing
    assert 1 - alphas[-1] < 0.6 * (1 - alphas[0]), alphas


def test_out_of_vocab_positions_leave_every_loss():
    """With a reduced vocabulary, ``skip_out_of_vocab`` keeps exactly the positions whose target argmax
    (over the full vocabulary) is a draft token, EAGLE-3's rule."""
    torch.manual_seed(0)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, d2t=torch.arange(0, 128, 2))
    batch, plan = tiny_batch(target), StagePlan.for_stage(2, "griffin", steps=1)
    argmax = (batch.target_features @ target.head_weight.T).argmax(-1)  # (B, T) target ids
    expected = float((batch.loss_mask * (argmax % 2 == 0)).sum() / batch.loss_mask.sum())
    assert 0 < expected < 1
    cfg = TrainConfig(noise_scale=0.0, skip_out_of_vocab=True)
    m = token_alignable_step(draft, batch, cfg, plan, backward=False, target_head=target.head_weight)
    assert m["mask_kept_1"] == pytest.approx(expected)
    assert token_alignable_step(draft, batch, TrainConfig(), plan, backward=False)["mask_kept_1"] == 1.0
    with pytest.raises(ValueError, match="target_head"):
        token_alignable_step(draft, batch, cfg, plan, backward=False)


_RANK_LIMIT_S = 180  # one rank's whole life; it takes ~5 s alone, under a loaded suite far more


def _run_ranks(fn, *args, world_size: int = 2) -> None:
    """Runs ``fn(rank, *args)`` in ``world_size`` spawned processes and fails if any fails or outlives
    its limit. Daemonic: a rank left behind can never keep pytest from exiting."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(fn, args, nprocs=world_size, join=False, daemon=True, start_method="spawn")
    deadline = time.monotonic() + _RANK_LIMIT_S + 30
    try:
        while not ranks.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"DDP ranks still running after {_RANK_LIMIT_S + 30} s")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()


def _ddp_full_backprop(rank: int, rendezvous: str, out: str) -> None:
    """One rank: a DDP-wrapped GRIFFIN-3 draft, one full-TTT step (three forwards, one backward)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # a rank stuck anywhere (not only in a collective, which gloo's timeout covers) prints its stack and
    # exits, so the parent reports it instead of waiting
    faulthandler.dump_traceback_later(_RANK_LIMIT_S, exit=True)
    # a file rendezvous: no port to race for with the Ray workers of the rest of the suite; a time
    # limit, so that a stuck rendezvous fails instead of hanging
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    target = make_target("llama", num_hidden_layers=5)
    draft = GriffinDraft.for_target(target, variant="griffin3")
    batch = variant_batch(target, draft, seed=rank)  # each rank its own rows
    model = DistributedDataParallel(draft, broadcast_buffers=False)
    token_alignable_step(
        model, batch, TrainConfig(noise_scale=0.0), StagePlan.for_stage(3, "griffin3", steps=1), draft=draft
    )
    if rank == 0:
        torch.save({n: p.grad for n, p in draft.named_parameters()}, out)
    # no destroy_process_group: with gloo it can hang at random (pytorch/pytorch#75097); the process
    # ends here and takes its group with it


def test_full_backprop_under_ddp_matches_one_process(tmp_path):
    """Under DDP (as Ray Train wraps the draft), full TTT backprop's three forwards and one backward
    give every rank the mean of the two ranks' single-process gradients."""
    _run_ranks(_ddp_full_backprop, str(tmp_path / "rendezvous"), str(tmp_path / "grads.pt"))
    ddp = torch.load(tmp_path / "grads.pt", weights_only=True)
    torch.manual_seed(0)
    target = make_target("llama", num_hidden_layers=5)
    draft = GriffinDraft.for_target(target, variant="griffin3")
    for rank in (0, 1):  # gradients accumulate over the two ranks' batches
        token_alignable_step(
            draft,
            variant_batch(target, draft, seed=rank),
            TrainConfig(noise_scale=0.0),
            StagePlan.for_stage(3, "griffin3", steps=1),
        )
    for name, param in draft.named_parameters():
        torch.testing.assert_close(ddp[name], param.grad / 2, rtol=1e-4, atol=1e-7, msg=name)


def _ranks_step(drafts, halves, cfg, plan, shared: bool) -> list[torch.Tensor]:
    """``token_alignable_step`` on two ranks (threads, one draft and one half of the rows each), the
    mask counts exchanged as the all-reduce would (``shared``) or each rank's own; the ranks' mean
    gradient, as DDP averages it."""
    import threading

    counts, barrier = [None, None], threading.Barrier(2)

    def ranks_mean(rank):
        def mean(count):
            counts[rank] = count.detach().float()
            barrier.wait()
            total = counts[0] + counts[1]
            barrier.wait()  # both have read the pair before the next pass overwrites it
            return total / 2

        return mean

    def run(rank):
        mean = ranks_mean(rank) if shared else None
        token_alignable_step(drafts[rank], halves[rank], cfg, plan, ranks_mean=mean)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    grads = [[p.grad for p in draft.parameters() if p.requires_grad] for draft in drafts]
    return [(a + b) / 2 for a, b in zip(*grads)]


@pytest.mark.parametrize(
    "token_loss,backprop", [("kl", "per_pass"), ("kl", "full"), ("lk", "per_pass"), ("lk_hybrid", "full")]
)
def test_two_ranks_step_as_one_rank_with_their_rows(token_loss, backprop):
    """Data-parallel normalisation (docs/method.md §3.1): one step on two ranks whose rows hold very
    different numbers of trained positions (long and short prompts) gives, after DDP's average, the
    gradient of one step on one rank holding all the rows, both passes and the alignment mask
    included, for every token loss and both backprop rules. Each rank dividing by its own count
    (GRIFFIN's and HASS's rule) does not."""
    import copy

    torch.manual_seed(0)
    target = make_target("llama")
    ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = target.model(ids, output_hidden_states=True).hidden_states[-1]
    mask = torch.ones(4, 24, dtype=torch.long)
    mask[:2, :4], mask[2:, :18] = 0, 0  # rank 0's rows train on 19 positions each, rank 1's on 5
    cfg = TrainConfig(noise_scale=0.0, align_top_k=50, token_loss=token_loss, ttt_backprop=backprop)
    plan = StagePlan.for_stage(2, "griffin", steps=1)
    reference = GriffinDraft.for_target(target)
    metrics = token_alignable_step(reference, shift_batch(feats, ids, mask), cfg, plan)
    assert 0 < metrics["mask_kept_2"] < 1  # pass 2's mask is at work
    expected = [p.grad for p in reference.parameters() if p.requires_grad]
    halves = [shift_batch(feats[i : i + 2], ids[i : i + 2], mask[i : i + 2]) for i in (0, 2)]
    for shared in (True, False):
        drafts = [copy.deepcopy(reference) for _ in range(2)]
        [draft.zero_grad() for draft in drafts]
        got = _ranks_step(drafts, halves, cfg, plan, shared)
        close = all(torch.allclose(g, e, rtol=1e-4, atol=1e-7) for g, e in zip(got, expected))
        assert close == shared
