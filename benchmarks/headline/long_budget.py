"""Held-out expected accepted tokens against optimizer steps for the long-budget SmolLM2 drafts
(``benchmarks/headline/headline.sh smollm2-long``: one store of 2,353 conversations, the same 4,150 steps each),
and each draft's ratio to GRIFFIN at equal steps. Reads the training runs' MLflow metric history
(``eval/sim_accept_len``, measured at every checkpoint on the held-out split); writes
``benchmarks/headline/long_budget.{json,md,png}``.

    .venv/bin/python benchmarks/headline/long_budget.py [smollm2-long]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent
LABELS = {"griffin": "GRIFFIN", "hass": "HASS", "eagle": "EAGLE-2", "eagle3": "EAGLE-3", "griffin3": "GRIFFIN-3"}
METRIC = "eval/sim_accept_len"


def history(run: str, config: str) -> list[tuple[int, float]]:
    """(global step, held-out metric) over every stage of the training run ``outputs/<run>``, in order;
    ``config`` names the jobs/configs file whose MLflow tracking holds it."""
    sys.path.insert(0, str(ROOT))
    from mlflow import MlflowClient

    from pipeline.config import load_config
    from pipeline.runtime import setup_mlflow

    setup_mlflow(load_config(ROOT / "jobs" / "configs" / f"{config}.yaml"))
    client, points = MlflowClient(), []
    for stage_dir in sorted((ROOT / "outputs" / run / "train").glob("stage*")):
        run_id = (stage_dir / "mlflow_run_id").read_text().strip()
        # step 0: the registry's copy of the final metrics on the registered model, not a measurement
        metrics = sorted((m for m in client.get_metric_history(run_id, METRIC) if m.step > 0), key=lambda m: m.step)
        points += [(stage_dir.name, m.step, m.value) for m in metrics]
    return global_steps(points)


def global_steps(points: list[tuple[Any, int, float]]) -> list[tuple[int, float]]:
    """(stage, step within the stage, value), stages in order -> (global step, value): each stage
    continues the previous one's last step. A resumed stage re-measures a step it had measured
    before: the last value per step is kept."""
    out, offset, stage = [], 0, object()
    for point_stage, step, value in points:
        if point_stage != stage:
            offset, stage = (out[-1][0] if out else 0), point_stage
        out.append((offset + step, value))
    return sorted(dict(out).items())


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-long"
    curves = {v: history(f"{name}-{v}", name) for v in LABELS if (ROOT / "outputs" / f"{name}-{v}" / "train").is_dir()}
    griffin = dict(curves.get("griffin", []))
    rows = []
    for variant, points in curves.items():
        shared = [(s, v) for s, v in points if s in griffin]
        final_step, final = points[-1] if points else (None, None)
        rows.append(
            {
                "variant": variant,
                "final_step": final_step,
                "final": final,
                "griffin_over_it_at_equal_steps": {s: griffin[s] / v for s, v in shared if v}
                if variant != "griffin"
                else {},
                "curve": points,
            }
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "long_budget.json").write_text(json.dumps({"config": name, "metric": METRIC, "rows": rows}, indent=2))
    lines = [
        f"Held-out expected accepted tokens per draft step chain ({METRIC}) on `{name}`'s held-out split, "
        "measured at every checkpoint; GRIFFIN / X at the same optimizer step.",
        "",
        "| draft | steps | final held-out | GRIFFIN / it at steps 1000 / 2000 / 4000 / 4150 (mean over shared steps) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        ratios = {int(s): r for s, r in row["griffin_over_it_at_equal_steps"].items()}
        shown = " / ".join(f"{ratios[s]:.2f}" if s in ratios else "-" for s in (1000, 2000, 4000, 4150))
        mean = f" ({sum(ratios.values()) / len(ratios):.2f})" if ratios else ""
        lines.append(
            f"| {LABELS[row['variant']]} | {row['final_step']} | {row['final']:.3f} | "
            f"{shown if ratios else '-'}{mean} |"
        )
    (OUT / "long_budget.md").write_text("\n".join(lines) + "\n")
    chart(curves, OUT / "long_budget.png")
    print("\n".join(lines))


def chart(curves: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    for variant, points in curves.items():
        axes.plot([s for s, _ in points], [v for _, v in points], marker=".", label=LABELS[variant])
    axes.set(
        xlabel="optimizer step (all stages)",
        ylabel="held-out expected accepted tokens",
        title="SmolLM2-135M drafts, same data and steps",
    )
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
