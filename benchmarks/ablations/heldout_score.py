"""Held-out acceptance of drafts on any feature store's held-out rows (its ``train.eval_fraction``
split), with chains that start at every reply position or only at each reply's first draft.

- ``--starts first``: the pooled held-out metric (``eval/sim_accept_len``) starts a chain at every
  reply position, so the one pair that only ``loss_window: draft`` trains, (f_{s-1}, x_s) -> x_{s+1}
  with x_s a reply's first token, is about one chain in a few hundred there. A decode drafts from
  exactly that pair in the first round of every reply. This scores chains that start there only.
- ``--starts all`` with ``--store``: the training's own metric, on another store's held-out rows, e.g.
  drafts trained on original and on regenerated answers, each scored on both.

acc_k and the expected accepted tokens of a greedy chain (teacher-forced features, the target's
greedy ids), per draft. ``--top-k 1 10`` also scores chains that survive while the target's token is
among the draft's k best (a tree's branching without its node budget). Writes benchmarks/ablations/<out>.{json,md}.

    .venv/bin/python benchmarks/ablations/heldout_score.py [--store DIR] [--starts first|all] [--top-k 1 ...] \
        [--out first_draft] NAME=DRAFT_DIR [NAME=DRAFT_DIR ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from griffin.losses import shift_batch, shift_left  # noqa: E402
from griffin.target import fast_bf16  # noqa: E402
from griffin.training import acceptance_counts, acceptance_metrics, teacher_ids  # noqa: E402
from griffin.checkpoint import load_draft  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.resources.targets import load_target  # noqa: E402
from pipeline.data.store import pad_batches, part_files  # noqa: E402
from pipeline.data.heldout import eval_split  # noqa: E402
from pipeline.train.batches import split_rows  # noqa: E402

CONFIG = ROOT / "jobs" / "configs" / "smollm2-long.yaml"
STEPS = 5


def heldout_batches(store: str, cfg, hidden_size: int, device, first_only: bool) -> list:
    """The store's held-out batches with chains starting where a decode's do (the "draft" window), or
    with ``first_only`` at each reply's first draft only: position t with x_t outside the reply and
    x_{t+1}, x_{t+2} in it."""
    files, ids = part_files(store), eval_split(store, cfg.train.eval_fraction)
    batches = []
    for batch in pad_batches(split_rows(files, ids, keep=True), cfg.train.batch_tokens, hidden_size, False):
        shifted = shift_batch(
            batch["features"].to(device),
            batch["input_ids"].to(device),
            batch["loss_mask"].to(device),
            batch["attention_mask"].to(device),
            "draft",
        )
        if first_only:
            reply = batch["loss_mask"] * batch["attention_mask"]  # (B, T)
            first = (1 - reply) * shift_left(reply) * shift_left(reply, 2)  # (B, T)
            shifted = dataclasses.replace(shifted, loss_mask=first.float().to(device))
        batches.append(shifted)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(CONFIG), help="the target's config (default: smollm2-long's)")
    parser.add_argument("--store", help="feature store (default: the config's)")
    parser.add_argument("--starts", choices=("first", "all"), default="first")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1], help="accept within the draft's k best")
    parser.add_argument("--out", default="first_draft", help="benchmarks/ablations/<out>.{json,md}")
    parser.add_argument("drafts", nargs="+", metavar="NAME=DRAFT_DIR")
    args = parser.parse_args()
    drafts = dict(arg.split("=", 1) for arg in args.drafts)
    cfg = load_config(args.config)
    store = args.store or cfg.store_path
    target = load_target(cfg.target)
    device, head = target.device, target.head_weight
    bf16 = fast_bf16(device)  # the training's own held-out precision (train.precision: auto)
    batches = heldout_batches(store, cfg, target.hf_config.hidden_size, device, args.starts == "first")
    results = {}
    for name, path in drafts.items():
        draft = load_draft(path, target, dtype=torch.float32)
        if draft.cfg.feature_layers:
            raise SystemExit(
                f"{name}: a multi-layer draft (EAGLE-3, GRIFFIN-3) reads feature layers, which this "
                "scorer does not load; score it through its training's held-out metric"
            )
        teachers = [teacher_ids(draft, b, head, bf16) for b in batches]
        for k in args.top_k:
            counts = sum(
                acceptance_counts(draft, b, STEPS, bf16=bf16, teacher=t, top_k=k) for b, t in zip(batches, teachers)
            )
            metrics = acceptance_metrics(counts)
            results[name if k == 1 else f"{name} top-{k}"] = {"draft": path, "top_k": k, **metrics}
            print(name, k, {m: round(v, 4) for m, v in metrics.items()}, flush=True)
    out = Path(__file__).parent
    (out / f"{args.out}.json").write_text(
        json.dumps(
            {"store": store, "starts": args.starts, "steps": STEPS, "top_k": args.top_k, "results": results}, indent=2
        )
    )
    where = "each reply's first draft" if args.starts == "first" else "every reply position (the draft window)"
    lines = [
        f"Chains that start at {where}, held-out rows of `{Path(store).name}` "
        f"({int(next(iter(results.values()))['eval/chains'])} chains).",
        "",
        "| draft | acc_0 | acc_1 | acc_2 | expected accepted tokens |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {r['eval/acc_0']:.3f} | {r['eval/acc_1']:.3f} | {r['eval/acc_2']:.3f} | "
        f"{r['eval/sim_accept_len']:.3f} |"
        for name, r in results.items()
    ]
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
