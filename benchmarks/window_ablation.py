"""The first-draft window ablation's table (``benchmarks/window_ablation.sh``, see there for the design).

Per arm: the held-out expected accepted tokens (``eval/sim_accept_len``) at every checkpoint, from the
runs' MLflow history, and the per-step acceptance of the stage's best checkpoint. The held-out chains
start on the "draft" window in both arms, so the reply's first draft, which only the "draft" window
trains, is scored in both. Writes benchmarks/window_ablation.{json,md}.

    .venv/bin/python benchmarks/window_ablation.py
"""

from __future__ import annotations

import json
from pathlib import Path

from long_budget import METRIC, history

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent
CONFIG = "smollm2-long"
ARMS = {"draft": "draft (default: pairs from the reply's first token)",
        "reference": "reference (EAGLE's unshifted mask)"}
ACCS = ("eval/acc_0", "eval/acc_1", "eval/acc_2")


def arm(window: str) -> dict | None:
    run = f"smollm2-abl-window-{window}"
    done = ROOT / "outputs" / run / "train" / "stage1" / "_complete.json"
    if not done.is_file():
        return None
    best = json.loads(done.read_text())["best_metrics"]
    return {"run": run, "curve": history(run, CONFIG), "best": {k: best.get(k) for k in (METRIC, *ACCS)}}


def main() -> None:
    arms = {window: arm(window) for window in ARMS}
    (OUT / "window_ablation.json").write_text(json.dumps({"config": CONFIG, "metric": METRIC, "arms": arms}, indent=2))
    steps = sorted({s for a in arms.values() if a for s, _ in a["curve"]})
    lines = [f"GRIFFIN stage 1 from scratch on `{CONFIG}`'s store, the same seed, steps and held-out rows; "
             f"`{METRIC}` at each checkpoint (held-out chains start on the draft window in both arms).", "",
             "| `train.method.loss_window` | " + " | ".join(f"step {s}" for s in steps) + " | acc_0 / acc_1 / acc_2 (best) |",
             "|---|" + "---|" * (len(steps) + 1)]
    for window, label in ARMS.items():
        a = arms[window]
        if a is None:
            lines.append(f"| {label} | " + " | ".join("-" for _ in steps) + " | not run |")
            continue
        curve = dict(a["curve"])
        accs = " / ".join(f"{a['best'][k]:.3f}" for k in ACCS)
        lines.append(f"| {label} | " + " | ".join(f"{curve[s]:.3f}" if s in curve else "-" for s in steps)
                     + f" | {accs} |")
    if all(arms.values()):
        final = {w: arms[w]["best"][METRIC] for w in ARMS}
        lines += ["", f"draft / reference at the best checkpoint: {final['draft'] / final['reference']:.3f}"]
    (OUT / "window_ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
