"""The stage-1 ablations' table (``benchmarks/ablations/stage1_ablations.sh``, see there for the design).

Per arm: the held-out expected accepted tokens (``eval/sim_accept_len``) at every checkpoint, from the
runs' MLflow history, the per-step acceptance of the stage's best checkpoint, and its ratio to the
default arm. The held-out chains start on the "draft" window in every arm, so the reply's first
draft, which only the "draft" window trains, is scored in all of them.
Writes benchmarks/ablations/stage1_ablations.{json,md,png} (the plot: the metric against training tokens, so
arms with other batch sizes line up). ``benchmarks/ablations/lr_sweep.sh`` reuses the table for its
own arms, runs and config (``--arms``, ``--prefix``, ``--config``, ``--base``, ``--out``).

    .venv/bin/python benchmarks/ablations/stage1_ablations.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ablations import stage_score
from long_budget import METRIC, history

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent
CONFIG = "smollm2-long"
BASE = "window-draft"
ARMS = {
    BASE: "default: `loss_window: draft`, random decoder init",
    "window-reference": "`train.method.loss_window=reference` (EAGLE's unshifted mask)",
    "init-last": "`draft.init_layer=-1` (decoder layer from the target's last layer)",
}
ACCS = ("eval/acc_0", "eval/acc_1", "eval/acc_2")


def arm(run: str, config: str) -> dict | None:
    best = stage_score(run, 1)  # the stage's best checkpoint: METRIC and ACCS
    if best is None:
        return None
    saved = json.loads((ROOT / "outputs" / run / "train" / "stage1" / "best" / "config.json").read_text())
    batch_tokens = saved["provenance"]["resolved_config"]["train"]["batch_tokens"]
    return {"run": run, "batch_tokens": batch_tokens, "curve": history(run, config), "best": best}


def plot(arms: dict[str, dict | None], labels: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for name, label in labels.items():
        if arms[name]:
            steps, values = zip(*arms[name]["curve"])
            ax.plot([s * arms[name]["batch_tokens"] / 1e3 for s in steps], values, marker="o", label=label)
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel(f"held-out {METRIC}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(arms: dict[str, dict | None], labels: dict[str, str], base: str, config: str) -> list[str]:
    """A markdown table: held-out metric per checkpoint, per-step acceptance and ratio to ``base``. Its
    columns are training tokens, so arms with different batch sizes line up at equal data."""

    def by_tokens(a: dict) -> dict[int, float]:
        return {s * a["batch_tokens"] // 1000: v for s, v in a["curve"]}

    kilotokens = sorted({t for a in arms.values() if a for t in by_tokens(a)})
    base_score = arms[base]["best"][METRIC] if arms.get(base) else None
    lines = [
        f"GRIFFIN stage 1 from scratch on `{config}`'s store, the same seed and held-out rows; "
        f"`{METRIC}` at each checkpoint (held-out chains start on the draft window in every arm).",
        "",
        "| arm | "
        + " | ".join(f"{t}k tokens" for t in kilotokens)
        + " | acc_0 / acc_1 / acc_2 (best) | best / default |",
        "|---|" + "---|" * (len(kilotokens) + 2),
    ]
    for name, label in labels.items():
        a = arms[name]
        if a is None:
            lines.append(f"| {label} | " + " | ".join("-" for _ in kilotokens) + " | not run | - |")
            continue
        curve = by_tokens(a)
        accs = " / ".join(f"{a['best'][k]:.3f}" for k in ACCS)
        ratio = f"{a['best'][METRIC] / base_score:.3f}" if base_score else "-"
        lines.append(
            f"| {label} | "
            + " | ".join(f"{curve[t]:.3f}" if t in curve else "-" for t in kilotokens)
            + f" | {accs} | {ratio} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG, help="the jobs/configs file whose MLflow holds the runs")
    parser.add_argument("--prefix", default="smollm2-abl-", help="run name = prefix + arm")
    parser.add_argument("--base", default=BASE, help="the arm the ratios divide by")
    parser.add_argument("--arms", nargs="+", metavar="NAME=LABEL", help="default: this file's ablation arms")
    parser.add_argument("--out", default="stage1_ablations", help="benchmarks/ablations/<out>.{json,md}")
    args = parser.parse_args()
    labels = dict(a.split("=", 1) for a in args.arms) if args.arms else ARMS
    arms = {name: arm(args.prefix + name, args.config) for name in labels}
    (OUT / f"{args.out}.json").write_text(json.dumps({"config": args.config, "metric": METRIC, "arms": arms}, indent=2))
    lines = table(arms, labels, args.base, args.config)
    (OUT / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    plot(arms, labels, OUT / f"{args.out}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
