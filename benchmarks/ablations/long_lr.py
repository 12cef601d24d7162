"""Does the LR sweep's pick hold at the long budget? Held-out expected accepted tokens at every
checkpoint of the long-budget GRIFFIN run at the sweep's stage-1 lr (``jobs/configs/smollm2-long.yaml``,
1e-3, read from its MLflow history) against the shipped draft's run at 5e-4, on the same 2,353
conversations, held-out rows, schedule shape and steps (``benchmarks/long_draft/training.json``).
The run may still be going: the table holds the steps both have measured. Writes
``benchmarks/ablations/long_lr.{json,md,png}``.

    .venv/bin/python benchmarks/ablations/long_lr.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "headline"))
sys.path.insert(0, str(ROOT))

from long_budget import global_steps, history  # noqa: E402

OUT = Path(__file__).parent
CONFIG = "smollm2-long"


def shipped_curve() -> list[tuple[int, float]]:
    """(global step, held out) of the shipped draft's training: stages 2-3 continue stage 1's count."""
    saved = json.loads((Path(__file__).parents[1] / "long_draft" / "training.json").read_text())
    return global_steps([(p["stage"], p["step"], p["held_out_expected_accepted_tokens"]) for p in saved["curve"]])


def main() -> None:
    from pipeline.config import load_config

    cfg = load_config(ROOT / "jobs" / "configs" / f"{CONFIG}.yaml")
    new_lr = cfg.train.schedule[0].lr
    new = history(cfg.run_name, CONFIG)  # [(global step, held out)]
    old = dict(shipped_curve())
    shared = [(step, old[step], value) for step, value in new if step in old]
    OUT.mkdir(exist_ok=True)
    (OUT / "long_lr.json").write_text(
        json.dumps(
            {
                "config": CONFIG,
                "stage1_lr": {"shipped": 5e-4, "new": new_lr},
                "metric": "eval/sim_accept_len",
                "shipped": sorted(old.items()),
                "new": new,
                "ratio_at_equal_steps": {step: value / base for step, base, value in shared},
            },
            indent=2,
        )
    )
    lines = [
        f"GRIFFIN on `{CONFIG}`'s store, the same schedule shape (stage 1 of 4,000 steps decaying over the stage, "
        "then 100 + 50 steps of stages 2-3 at 3e-5); held-out expected accepted tokens at each checkpoint.",
        "",
        f"| step | shipped draft's run, stage-1 lr 5e-4 | stage-1 lr {new_lr:g} | ratio |",
        "|---|---|---|---|",
    ]
    lines += [f"| {step} | {base:.3f} | {value:.3f} | {value / base:.3f} |" for step, base, value in shared]
    (OUT / "long_lr.md").write_text("\n".join(lines) + "\n")
    chart(sorted(old.items()), new, new_lr, OUT / "long_lr.png")
    print("\n".join(lines))


def chart(old: list, new: list, new_lr: float, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4))
    axes = figure.subplots()
    axes.plot([s for s, _ in old], [v for _, v in old], marker=".", label="stage-1 lr 5e-4 (shipped draft)")
    axes.plot([s for s, _ in new], [v for _, v in new], marker=".", label=f"stage-1 lr {new_lr:g}")
    axes.set(
        xlabel="optimizer step (all stages)",
        ylabel="held-out expected accepted tokens",
        title="SmolLM2-135M GRIFFIN, long budget: the sweep's LR against the shipped one",
    )
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
