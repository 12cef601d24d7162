"""Acceptance of the first draft of each reply, on the held-out rows of a feature store.

The pooled held-out metric (``eval/sim_accept_len``) starts a chain at every reply position, so the
one pair that only ``loss_window: draft`` trains, (f_{s-1}, x_s) -> x_{s+1} with x_s a reply's first
token, is about one chain in a few hundred there. A decode drafts from exactly that pair in the first
round of every reply. This scores chains that start there only: acc_k and the expected accepted
tokens of a greedy chain (teacher-forced features, the target's greedy ids), for each draft given.
Writes benchmarks/first_draft.{json,md}.

    .venv/bin/python benchmarks/first_draft.py NAME=DRAFT_DIR [NAME=DRAFT_DIR ...]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from griffin.losses import shift_batch, shift_left  # noqa: E402
from griffin.target import fast_bf16  # noqa: E402
from griffin.training import acceptance_counts, acceptance_metrics, teacher_ids  # noqa: E402
from griffin.weights import load_draft  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.resources import load_target  # noqa: E402
from pipeline.store import pad_batches, part_files  # noqa: E402
from pipeline.train_data import eval_split, split_rows  # noqa: E402

CONFIG = ROOT / "jobs" / "configs" / "smollm2-long.yaml"
STEPS = 5


def first_draft_batches(cfg, hidden_size: int, device) -> list:
    """Held-out batches whose chains start only at each reply's first draft: position t with x_t
    outside the reply and x_{t+1}, x_{t+2} in it."""
    files, ids = part_files(cfg.store_path), eval_split(cfg.store_path, cfg.train.eval_fraction)
    batches = []
    for batch in pad_batches(split_rows(files, ids, keep=True), cfg.train.batch_tokens, hidden_size, False):
        reply = batch["loss_mask"] * batch["attention_mask"]  # (B, T)
        first = (1 - reply) * shift_left(reply) * shift_left(reply, 2)  # (B, T)
        shifted = shift_batch(batch["features"].to(device), batch["input_ids"].to(device),
                              batch["loss_mask"].to(device), batch["attention_mask"].to(device), "draft")
        batches.append(dataclasses.replace(shifted, loss_mask=first.float().to(device)))
    return batches


def main() -> None:
    drafts = dict(arg.split("=", 1) for arg in sys.argv[1:])
    cfg = load_config(CONFIG)
    target = load_target(cfg.target)
    device, head = target.device, target.head_weight
    bf16 = fast_bf16(device)  # the training's own held-out precision (train.precision: auto)
    batches = first_draft_batches(cfg, target.hf_config.hidden_size, device)
    results = {}
    for name, path in drafts.items():
        draft = load_draft(path, target, dtype=torch.float32)
        counts = sum(acceptance_counts(draft, b, STEPS, bf16=bf16, teacher=teacher_ids(draft, b, head, bf16))
                     for b in batches)
        results[name] = {"draft": path, **acceptance_metrics(counts)}
        print(name, {k: round(v, 4) for k, v in results[name].items() if k != "draft"}, flush=True)
    out = Path(__file__).parent
    (out / "first_draft.json").write_text(json.dumps({"store": cfg.store_path, "steps": STEPS, "results": results},
                                                      indent=2))
    lines = [f"Chains that start at each reply's first draft, held-out rows of `{cfg.store_path}` "
             f"({int(next(iter(results.values()))['eval/chains'])} replies).", "",
             "| draft | acc_0 | acc_1 | acc_2 | expected accepted tokens |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['eval/acc_0']:.3f} | {r['eval/acc_1']:.3f} | {r['eval/acc_2']:.3f} | "
              f"{r['eval/sim_accept_len']:.3f} |" for name, r in results.items()]
    (out / "first_draft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
