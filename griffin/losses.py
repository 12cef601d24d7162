"""Token-Alignable Training losses (docs/method.md §3).

Stage 1 is one EAGLE-style pass (1.0 feature loss + 0.1 token loss). A stage with j passes runs
the draft j times per step with HASS's harmonized context (each pass sees its own earlier
regressed features, ``GriffinDraft.forward``), adds the 0.5 top-10 loss to every pass, and - for
GRIFFIN, not HASS - masks out positions whose ground-truth token chain would not have been in
the draft's top-k (the token-alignment mask).

How passes backpropagate (``TrainConfig.ttt_backprop``): with a feature loss (GRIFFIN, HASS,
EAGLE-2) every pass is back-propagated on its own with the earlier R detached, so the gradients
are summed over passes, as the official code does (GRIFFIN issue #1). Without one (EAGLE-3,
GRIFFIN-3) R is trained only through the later passes that read it, so those read it with its
graph and one backward runs over the summed losses (EAGLE-3's training-time test).

The token term is forward KL (as soft cross-entropy) or an LK loss on the expected acceptance
rate (``TrainConfig.token_loss``, arXiv 2602.23881).

Shape legend: B batch, T tokens, D hidden, V draft vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import LossWindow, StagePlan, TrainConfig
from griffin.model import GriffinDraft


@dataclass
class ShiftedBatch:
    """The draft's view of a batch after the feature/token shift (docs/method.md §1):
    at position t the input is (f_t, y_t = x_{t+1}); the targets are f_{t+1} and p*_t."""

    features: Tensor  # (B, T, D_f) f_t as the draft reads it: the final feature, or k layers' (D_f = k*D)
    tokens: Tensor  # (B, T) y_t = x_{t+1}; 0 at the last position
    target_features: Tensor  # (B, T, D) f_{t+1}; 0 at the last position
    loss_mask: Tensor  # (B, T) float: assistant token and t+1 is a real token
    attention_mask: Tensor  # (B, T) 1 on real tokens


def shift_left(x: Tensor, steps: int = 1) -> Tensor:
    """(B, T) -> (B, T): x[:, t + steps], zero past the end. E.g. [a, b, c] -> [b, c, 0]."""
    return torch.cat([x[:, steps:], x.new_zeros(x.shape[0], min(steps, x.shape[1]))], dim=1)


def shift_batch(
    features: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None = None,
    window: LossWindow = "draft",
    layer_features: Tensor | None = None,
) -> ShiftedBatch:
    """features (B, T, D) the final post-norm features, input_ids / loss_mask / attention_mask (B, T),
    right-padded; ``layer_features`` (B, T, k*D) the k feature layers, the input of a multi-layer
    draft (the final features stay its targets); ``loss_mask``
    marks the reply tokens x_t (1 on each assistant reply and its end-of-turn token).

    Which pairs (f_t, x_{t+1}) -> x_{t+2} are supervised (``window``):
    - "draft": those a decode drafts, where x_{t+1} and x_{t+2} are both reply tokens. The first
      draft of a reply comes from (f_{s-1}, x_s), x_s its first token; the last predicts its
      end-of-turn token. As the official Qwen2 / LLaMA-3 data scripts, one position before EAGLE's.
    - "reference": EAGLE's unshifted mask, x_t a reply token: it misses the reply's first draft and
      trains end-of-turn -> next header, which no decode drafts.
    E.g. x = [h, a, b, e, n] (h the header's last token, reply a b e, e its end-of-turn, n after it):
    "draft" -> [1, 1, 0, 0, 0] ((f_0, a) -> b and (f_1, b) -> e); "reference" -> [0, 1, 1, 1, 0]
    ((f_1, b) -> e, (f_2, e) -> n and (f_3, n) -> the next header)."""
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    tokens = shift_left(input_ids)  # (B, T) y_t = x_{t+1}
    target = torch.cat([features[:, 1:], features.new_zeros(B, 1, features.shape[-1])], dim=1)  # (B, T, D)
    reply = loss_mask * attention_mask  # (B, T)
    if window == "draft":
        mask = shift_left(reply) * shift_left(reply, 2)  # x_{t+1} and x_{t+2} in the reply
    else:
        mask = reply * shift_left(attention_mask)  # x_t in the reply and x_{t+1} a real token
    inputs = features if layer_features is None else layer_features
    return ShiftedBatch(inputs, tokens, target, mask.float(), attention_mask)


def add_feature_noise(features: Tensor, attention_mask: Tensor, scale: float, generator=None) -> Tensor:
    """EAGLE's uniform input noise: F + (U[0,1) - 0.5) * scale * 512 / L, L = sample length (§4.4)."""
    if scale == 0:
        return features
    lengths = attention_mask.sum(1).clamp(min=1).to(features.dtype)[:, None, None]  # (B, 1, 1)
    noise = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
    return features + (noise - 0.5) * scale * 512 / lengths


def pass_losses(
    draft: GriffinDraft,
    prediction: Tensor,
    regression: Tensor,
    batch: ShiftedBatch,
    teacher: Tensor,
    mask: Tensor,
    topk_loss_k: int,
    feature_loss: bool = True,
    count: Tensor | None = None,
) -> dict[str, Tensor]:
    """Feature (SmoothL1, beta 1; only with ``feature_loss``: without it R is not a regression of
    the target feature and the term means nothing), soft token cross-entropy, top-k losses and the
    expected acceptance rate ``alpha`` under ``mask`` (B, T). teacher: (B, T, V) target
    probabilities p*_t over the draft vocabulary. ``alpha`` is mean_t sum_x min(p*_t(x), q_t(x)),
    the probability that speculative sampling accepts the draft's token at t.

    Each term is a sum over the masked positions divided by ``count``, by default their own count
    (data-parallel training passes the mean count over the ranks: ``token_alignable_step``)."""
    norm = (mask.sum() if count is None else count) + 1e-5
    log_q = torch.log_softmax(draft.logits(prediction).float(), dim=-1)  # (B, T, V)
    token = -(teacher * log_q).sum(-1)  # (B, T)
    top_p, top_idx = teacher.topk(topk_loss_k, dim=-1)  # (B, T, k)
    terms = {
        "token": token,
        "topk": -(top_p * log_q.gather(-1, top_idx)).sum(-1),  # (B, T) each
        "alpha": torch.minimum(teacher, log_q.exp()).sum(-1),
    }
    if feature_loss:
        terms["value"] = F.smooth_l1_loss(regression.float(), batch.target_features.float(), reduction="none").mean(-1)
    return {name: (x * mask).sum() / norm for name, x in terms.items()}


def token_term(parts: dict[str, Tensor], cfg: TrainConfig, alpha_all: Tensor | None = None) -> Tensor:
    """The pass's token objective (``cfg.token_loss``) from ``pass_losses``' scalars. LK-hybrid's
    weight w = scale * exp(-decay * alpha) is a schedule, not a path for gradients: alpha is detached
    there, so KL dominates while acceptance is low and the acceptance term takes over as it rises.

    ``alpha_all`` (data-parallel training, detached): the acceptance rate over every rank's positions,
    when the ranks share the denominator (``token_alignable_step``). LK-hybrid's weight is then the
    same on every rank, and LK's loss is -alpha / alpha_all, whose gradient averaged over the ranks is
    that of -log alpha_all (-log alpha's would divide each rank's gradient by its own alpha)."""
    if cfg.token_loss == "kl":
        return parts["token"]
    alpha = parts["alpha"]
    if cfg.token_loss == "lk":
        if alpha_all is not None:
            return -alpha / alpha_all.clamp(min=1e-6)
        return -torch.log(alpha.clamp(min=1e-6))
    rate = (alpha if alpha_all is None else alpha_all).detach()
    w = cfg.lk_kl_scale * torch.exp(-cfg.lk_kl_decay * rate)
    return w * parts["token"] + (1 - w) * (1 - alpha)


def pass_loss(parts: dict[str, Tensor], cfg: TrainConfig, plan: StagePlan, alpha_all: Tensor | None = None) -> Tensor:
    """One pass's loss: feature + weighted token term (EAGLE / GRIFFIN / HASS), or the token term
    alone without a feature loss (EAGLE-3, GRIFFIN-3); plus HASS's top-k term where the plan has it.
    ``alpha_all``: see ``token_term``."""
    token = token_term(parts, cfg, alpha_all)
    loss = cfg.value_weight * parts["value"] + cfg.token_weight * token if plan.feature_loss else token
    return loss + cfg.topk_weight * parts["topk"] if plan.topk_loss else loss


def in_draft_vocab(draft: GriffinDraft, batch: ShiftedBatch, target_head: Tensor) -> Tensor:
    """(B, T) float: 1 where the target's argmax over its full vocabulary (``target_head`` (V_target, D))
    is in the draft's reduced vocabulary, the positions EAGLE-3 keeps in its losses."""
    with torch.no_grad():
        argmax = (batch.target_features.to(target_head.dtype) @ target_head.T).argmax(-1)  # (B, T) target ids
        return (draft.to_draft_ids(argmax) >= 0).float()


def alignment_hits(draft: GriffinDraft, prediction: Tensor, tokens: Tensor, k: int) -> Tensor:
    """raw[t] = 1 if x_{t+2} (= y_{t+1}) is among the draft's top-k at position t. (B, T) float."""
    next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)  # (B, T)
    next_draft = draft.to_draft_ids(next_tokens)  # -1 outside a reduced vocabulary: never a hit
    top = draft.logits(prediction).topk(k, dim=-1).indices  # (B, T, k)
    hits = (top == next_draft[..., None]).any(-1).float()  # (B, T)
    hits[:, -1] = 0.0  # nothing to predict after the last position
    return hits


def shift_right(x: Tensor) -> Tensor:
    """(B, T) -> (B, T) with x[:, t-1] at t and 0 at t=0."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x[:, :-1]], dim=1)


def next_alignment(hits: Tensor, previous: Tensor | None) -> Tensor:
    """Cumulative alignment along the draft chain: cum_j[t] = hits_j[t] * cum_{j-1}[t-1] (§4.3)."""
    return hits if previous is None else hits * shift_right(previous)


def alignment_mask(cumulative: Tensor, mask_shift: str) -> Tensor:
    """The mask for the next pass. "reference" is the official code's index (it includes whether the
    next pass's own target was in the top-k); "decode" shifts it one position to the right, the
    chain a decode-time draft actually followed (docs/method.md §3.3)."""
    return cumulative if mask_shift == "reference" else shift_right(cumulative)


def ranked_pass_loss(
    draft: GriffinDraft,
    prediction: Tensor,
    regression: Tensor,
    batch: ShiftedBatch,
    teacher: Tensor,
    mask: Tensor,
    cfg: TrainConfig,
    plan: StagePlan,
    ranks_mean: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One pass's loss over the denominator the ranks share (``ranks_mean``: see
    ``token_alignable_step``; None on one rank), and its terms as this rank's own means, as a rank
    reports them."""
    count = mask.sum()
    shared = ranks_mean(count) if ranks_mean is not None else count
    parts = pass_losses(draft, prediction, regression, batch, teacher, mask, cfg.topk_loss_k, plan.feature_loss, shared)
    # every rank's acceptance rate: the mean of the ranks' alphas, all over the one denominator
    alpha_all = ranks_mean(parts["alpha"].detach()) if ranks_mean and cfg.token_loss != "kl" else None
    with torch.no_grad():
        own = {name: value * (shared + 1e-5) / (count + 1e-5) for name, value in parts.items()}
    return pass_loss(parts, cfg, plan, alpha_all), {"loss": pass_loss(own, cfg, plan).detach(), **own}


def token_alignable_step(
    model: nn.Module,
    batch: ShiftedBatch,
    cfg: TrainConfig,
    plan: StagePlan,
    draft: GriffinDraft | None = None,
    backward: bool = True,
    generator: torch.Generator | None = None,
    target_head: Tensor | None = None,
    ranks_mean: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, float]:
    """One training step's forward passes and backward (no optimizer step).

    ``model`` may be a DDP wrapper of ``draft``; the frozen head is read from ``draft``. With full
    TTT backprop (``cfg.full_backprop``) each later pass reads the earlier passes' R with its graph
    and one backward runs over the summed, ``pass_weight_decay``-weighted pass losses; otherwise R is
    detached and every pass backpropagates on its own. ``target_head`` (V_target, D), the full LM
    head, is needed only for ``cfg.skip_out_of_vocab``. ``ranks_mean`` (data-parallel training) turns a
    rank's count of masked positions into the mean over the ranks, the losses' denominator: DDP then
    averages the ranks' gradients, so every masked position of every rank weighs the same, however the
    ranks' counts differ (docs/method.md §3.1). Returns this rank's mean losses over passes plus
    per-pass values and the fraction of positions kept by the mask."""
    draft = draft if draft is not None else cast(GriffinDraft, model)
    n_passes, full = plan.passes, cfg.full_backprop(plan)
    inputs = (
        add_feature_noise(batch.features, batch.attention_mask, cfg.noise_scale, generator)
        if model.training
        else batch.features
    )
    with torch.no_grad():
        teacher = torch.softmax(draft.target_logits(batch.target_features).float(), dim=-1)  # (B, T, V)
    base = batch.loss_mask
    if cfg.skip_out_of_vocab and draft.d2t is not None:
        if target_head is None:
            raise ValueError("train.method.skip_out_of_vocab needs the target's full LM head (target_head)")
        base = base * in_draft_vocab(draft, batch, target_head)
    streams, mask, cumulative = [inputs], base, None
    total: Tensor | float = 0.0
    base_count = batch.loss_mask.sum().clamp(min=1)
    metrics: dict[str, float] = {}
    for j in range(1, n_passes + 1):
        P, R = model(streams, batch.tokens, batch.attention_mask)  # (B, T, D) each
        loss, own = ranked_pass_loss(draft, P, R, batch, teacher, mask, cfg, plan, ranks_mean)
        weighted = cfg.pass_weight_decay ** (j - 1) * loss / cfg.grad_accum
        if backward and full:
            total = total + weighted
        elif backward:
            weighted.backward()
        metrics.update({f"{name}_{j}": float(value) for name, value in own.items()})
        metrics[f"mask_kept_{j}"] = float(mask.sum() / base_count)
        if j == n_passes:
            break
        # next stream: the draft's own regressed features, one position later; with R's graph when full
        with torch.set_grad_enabled(full and torch.is_grad_enabled()):
            streams.append(draft.next_stream(inputs, R))
        if plan.alignment_mask:
            with torch.no_grad():
                cumulative = next_alignment(alignment_hits(draft, P, batch.tokens, cfg.align_top_k), cumulative)
                mask = base * alignment_mask(cumulative, cfg.mask_shift)
    if backward and full and isinstance(total, Tensor):
        total.backward()
    for name in own:  # "loss" and each term
        metrics[name] = sum(metrics[f"{name}_{j}"] for j in range(1, n_passes + 1)) / n_passes
    return metrics
