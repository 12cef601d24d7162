"""The stage-1 ablations' table (``benchmarks/stage1_ablations.sh``, see there for the design).

Per arm: the held-out expected accepted tokens (``eval/sim_accept_len``) at every checkpoint, from the
runs' MLflow history, the per-step acceptance of the stage's best checkpoint, and its ratio to the
default arm. The held-out chains start on the "draft" window in every arm, so the reply's first
draft, which only the "draft" window trains, is scored in all of them.
Writes benchmarks/stage1_ablations.{json,md}.

    .venv/bin/python benchmarks/stage1_ablations.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ablations import stage_score
from long_budget import METRIC, history

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent
CONFIG = "smollm2-long"
BASE = "window-draft"
ARMS = {BASE: "default: `loss_window: draft`, random decoder init",
        "window-reference": "`train.method.loss_window=reference` (EAGLE's unshifted mask)",
        "init-last": "`draft.init_layer=-1` (decoder layer from the target's last layer)"}
ACCS = ("eval/acc_0", "eval/acc_1", "eval/acc_2")


def arm(name: str) -> dict | None:
    run = f"smollm2-abl-{name}"
    best = stage_score(run, 1)  # the stage's best checkpoint: METRIC and ACCS
    return None if best is None else {"run": run, "curve": history(run, CONFIG), "best": best}


def main() -> None:
    arms = {name: arm(name) for name in ARMS}
    (OUT / "stage1_ablations.json").write_text(json.dumps({"config": CONFIG, "metric": METRIC, "arms": arms}, indent=2))
    steps = sorted({s for a in arms.values() if a for s, _ in a["curve"]})
    base = arms[BASE]["best"][METRIC] if arms[BASE] else None
    lines = [f"GRIFFIN stage 1 from scratch on `{CONFIG}`'s store, the same seed, steps and held-out rows; "
             f"`{METRIC}` at each checkpoint (held-out chains start on the draft window in every arm).", "",
             "| arm | " + " | ".join(f"step {s}" for s in steps) + " | acc_0 / acc_1 / acc_2 (best) | best / default |",
             "|---|" + "---|" * (len(steps) + 2)]
    for name, label in ARMS.items():
        a = arms[name]
        if a is None:
            lines.append(f"| {label} | " + " | ".join("-" for _ in steps) + " | not run | - |")
            continue
        curve = dict(a["curve"])
        accs = " / ".join(f"{a['best'][k]:.3f}" for k in ACCS)
        ratio = f"{a['best'][METRIC] / base:.3f}" if base else "-"
        lines.append(f"| {label} | " + " | ".join(f"{curve[s]:.3f}" if s in curve else "-" for s in steps)
                     + f" | {accs} | {ratio} |")
    (OUT / "stage1_ablations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
