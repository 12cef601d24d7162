"""Pure-PyTorch training pieces that the Ray Train loop wraps (docs/method.md §3.4, docs/design.md §8).

- ``make_optimizer`` / ``make_scheduler``: AdamW (0.9, 0.95), linear warm-up then linear decay.
- ``train_step``: one optimizer step over ``grad_accum`` micro-batches, each running every pass
  of the stage (``griffin.losses.token_alignable_step``); gradients clipped by value (±0.5), bf16
  autocast optional.
- ``evaluate_acceptance``: offline acceptance on held-out batches. Starting at each assistant
  position the draft runs greedily through k steps on its own regressed features (the harmonized
  pass k is exactly that chain, see ``GriffinDraft.forward``); step k counts as accepted when its
  argmax equals the target's argmax and every earlier step was accepted. Counts are float64 sums
  so they can be all-reduced across workers; ``acceptance_metrics`` turns them into
  ``eval/acc_k`` and ``eval/sim_accept_len = Σ_k Π_{i≤k} acc_i``.

Shape legend: B batch, T tokens, D hidden, V draft vocab, K eval draft steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from griffin.config import StagePlan, TrainConfig
from griffin.losses import ShiftedBatch, shift_right, token_alignable_step
from griffin.model import GriffinDraft


def make_optimizer(model: nn.Module, cfg: TrainConfig, plan: StagePlan) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=plan.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, plan: StagePlan
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``cfg.warmup_steps``, then linear decay to 0 at ``plan.total_steps``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        return max(0.0, (plan.total_steps - step) / max(1, plan.total_steps - cfg.warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast(device: torch.device, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def train_step(
    model: nn.Module,
    draft: GriffinDraft,
    micro_batches: Iterable[ShiftedBatch],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainConfig,
    plan: StagePlan,
    bf16: bool = True,
    generator: torch.Generator | None = None,
    target_head: Tensor | None = None,
    ranks_mean: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, float]:
    """One optimizer step. ``model`` may be the DDP wrapper of ``draft``; ``target_head`` (V_target, D)
    is the full LM head, needed for ``cfg.skip_out_of_vocab``; ``ranks_mean``: the mean of a count over
    the data-parallel ranks (``griffin.losses.pass_losses``)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    tokens = 0
    for batch in micro_batches:
        with autocast(batch.features.device, bf16):
            metrics = token_alignable_step(
                model, batch, cfg, plan, draft, generator=generator, target_head=target_head, ranks_mean=ranks_mean
            )
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value / cfg.grad_accum
        tokens += int(batch.attention_mask.sum())
    torch.nn.utils.clip_grad_value_(draft.parameters(), cfg.grad_clip_value)
    optimizer.step()
    scheduler.step()
    totals["lr"] = float(scheduler.get_last_lr()[0])
    totals["tokens"] = float(tokens)
    return totals


@torch.no_grad()
def teacher_ids(
    draft: GriffinDraft, batch: ShiftedBatch, target_head: Tensor | None = None, bf16: bool = False
) -> Tensor:
    """The target's greedy next-token ids (B, T) at every position of ``batch``. ``target_head``
    (V_target, D) is the full LM head, so a reduced draft vocabulary is judged against the target's
    real argmax (default: the draft's own head). It depends only on the data: compute it once."""
    with autocast(batch.features.device, bf16):
        if target_head is None:
            return draft.to_target_ids(draft.target_logits(batch.target_features).argmax(-1))
        return (batch.target_features.to(target_head.dtype) @ target_head.T).argmax(-1)


@torch.no_grad()
def acceptance_counts(
    draft: GriffinDraft,
    batch: ShiftedBatch,
    steps: int,
    target_head: Tensor | None = None,
    bf16: bool = False,
    teacher: Tensor | None = None,
    top_k: int = 1,
) -> Tensor:
    """(2, K) float64: row 0 = accepted chains per step, row 1 = chains that reached the step.
    ``teacher``: ``teacher_ids(draft, batch, target_head, bf16)`` when already computed.
    ``top_k`` > 1 accepts a step when the target's token is among the draft's k best: the chain a tree
    with top-k branching and no node budget would keep, an upper bound on what a decode tree recovers
    of the draft's first-choice misses."""
    draft.eval()
    if teacher is None:
        teacher = teacher_ids(draft, batch, target_head, bf16)  # (B, T)
    next_token = torch.cat([batch.tokens[:, 1:], torch.zeros_like(batch.tokens[:, :1])], 1)  # (B, T) x_{t+2}
    greedy_data = teacher == next_token  # the data follows the target's greedy path here
    counts = torch.zeros(2, steps, dtype=torch.float64)
    reach = batch.loss_mask > 0  # (B, T) chains start at assistant positions
    streams = [batch.features]
    for k in range(steps):
        with autocast(batch.features.device, bf16):
            P, R = draft(streams, batch.tokens, batch.attention_mask)  # pass k+1: (B, T, D)
            logits = draft.logits(P)  # (B, T, V_draft)
            # top_k = 1 by argmax, whose tie-breaking the greedy decoder shares (topk's is unspecified)
            best = logits.argmax(-1, keepdim=True) if top_k == 1 else logits.topk(top_k, dim=-1).indices
            guesses = draft.to_target_ids(best)  # (B, T, k) target ids
        accepted = reach & (guesses == teacher.unsqueeze(-1)).any(-1)
        counts[0, k], counts[1, k] = accepted.sum(), reach.sum()
        # step k+1 at position r continues the chain that was accepted at r-1 on greedy data
        reach = shift_right((accepted & greedy_data).float()).bool()
        streams.append(draft.next_stream(batch.features, R))
    return counts


def acceptance_metrics(counts: Tensor) -> dict[str, float]:
    """``counts`` (2, K) summed over the eval set -> eval/acc_k and eval/sim_accept_len."""
    metrics, survive, total = {}, 1.0, 0.0
    for k in range(counts.shape[1]):
        acc = float(counts[0, k] / counts[1, k]) if counts[1, k] > 0 else 0.0
        metrics[f"eval/acc_{k}"] = acc
        survive *= acc
        total += survive
    metrics["eval/sim_accept_len"] = total
    metrics["eval/chains"] = float(counts[1, 0])
    return metrics
