"""Collect `benchmarks/method_ablations/run.sh`'s results into benchmarks/method_ablations/
{results.json, results.md}: each run's best held-out expected accepted tokens per stage (its
_complete.json), the comparison each ablation makes against its baseline, and the interleaved
evaluation's τ, per-position acceptance and speedup (outputs/smollm2-abl-g-kl/eval/report.json).

    .venv/bin/python benchmarks/method_ablations/collect.py
"""

from __future__ import annotations

import json
import shutil
from datetime import date
from pathlib import Path

from griffin.config import TreeConfig

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
SCORE = "eval/sim_accept_len"
# run -> (what changed, its baseline run); the baseline's stage-3 score is compared with the run's
ABLATIONS = {
    "e3-perpass": ("EAGLE-3, R detached between passes (per_pass) vs full TTT backprop", "e3"),
    "g3-perpass": ("GRIFFIN-3, R detached between passes (per_pass) vs full TTT backprop", "g3"),
    "g-lk": ("GRIFFIN, LK-hybrid token loss vs KL", "g-kl"),
    "e3-lk": ("EAGLE-3, LK-hybrid token loss vs KL", "e3"),
    "g-reply": ("GRIFFIN, draft vocabulary from reply tokens vs all tokens (stage 1, step 200)", "g-kl"),
    "e3-oov": ("EAGLE-3, positions with an out-of-vocabulary target argmax skipped vs kept (stage 1, step 200)", "e3"),
    "g-pw08": ("GRIFFIN, pass weights 0.8^k vs 1", "g-kl"),
    "e3-pw08": ("EAGLE-3, pass weights 0.8^k vs 1", "e3"),
}
VARIANTS = {"g-kl": "GRIFFIN", "e3": "EAGLE-3", "g3": "GRIFFIN-3"}
HALF_BUDGET = {"g-reply", "e3-oov"}  # the first 200 of the baseline's 400 stage-1 steps, same LR schedule
HALF_STEP = 200


def machine() -> str:
    """The CPU model and vector ISA (what decides these figures), e.g. "AMD EPYC, AVX512, 2 CPUs"."""
    from pipeline.evaluate.report import machine_identity

    m = machine_identity()
    return f"{m.get('cpu_model') or m.get('processor')}, {m.get('cpu_capability')}, {m.get('cpu_count')} CPUs"


def held_out(run: str) -> dict[str, float]:
    """{"stage 1": score, "stage 3": score} of the run's completed stages."""
    stages = sorted((ROOT / "outputs" / f"smollm2-abl-{run}" / "train").glob("stage*/_complete.json"))
    return {
        f"stage {json.loads(p.read_text())['stage']}": json.loads(p.read_text())["best_metrics"][SCORE] for p in stages
    }


def score_at(run: str, stage: int, step: int) -> float | None:
    """The held-out score a run logged to MLflow at ``step`` of ``stage`` (rank 0's eval)."""
    from mlflow.tracking import MlflowClient

    done = ROOT / "outputs" / f"smollm2-abl-{run}" / "train" / f"stage{stage}" / "_complete.json"
    if not done.exists():
        return None
    client = MlflowClient(f"sqlite:///{ROOT / 'outputs' / 'mlflow.db'}")
    history = client.get_metric_history(json.loads(done.read_text())["mlflow_run_id"], SCORE)
    return next((m.value for m in history if m.step == step), None)


def compared(run: str, base: str) -> tuple[float | None, float | None]:
    """(run's score, baseline's score) at equal steps."""
    if run in HALF_BUDGET:
        return score_at(run, 1, HALF_STEP), score_at(base, 1, HALF_STEP)
    return held_out(run).get("stage 3"), held_out(base).get("stage 3")


def decode_rows(report: dict) -> tuple[dict, list[str]]:
    result, rows = {}, []
    for key, entry in report["results"].items():
        vanilla = entry["methods"]["vanilla"]["tokens_per_s_median"]
        for label, method in entry["methods"].items():
            if label == "vanilla":
                continue
            speedup = method["tokens_per_s_median"] / vanilla
            result.setdefault(key, {})[label] = {
                "tau": method["tau"],
                "per_position_acceptance": method["per_position_acceptance"],
                "tokens_per_s": method["tokens_per_s_median"],
                "speedup_vs_vanilla": speedup,
            }
            rows.append(
                f"| {key} | {label} | {method['tau']:.2f} | "
                f"{' / '.join(f'{a:.2f}' for a in method['per_position_acceptance'])} | "
                f"{method['tokens_per_s_median']:.1f} | {speedup:.2f}x |"
            )
    return result, rows


def main() -> None:
    runs = {run: held_out(run) for run in [*VARIANTS, *ABLATIONS]}
    lines = [
        "# Method ablations on SmolLM2-135M-Instruct (`benchmarks/method_ablations/run.sh`)",
        "",
        f"Machine: {machine()}, bf16 training, {date.today()}. Held-out expected "
        "accepted tokens (`eval/sim_accept_len`, 5-step greedy chains on the store's held-out 5%; the best "
        "checkpoint of each stage).",
        "",
        "## Variants at equal budget",
        "",
        "| variant | stage 1 | stage 3 |",
        "|---|---:|---:|",
    ]
    for run, name in VARIANTS.items():
        scores = runs[run]
        lines.append(
            f"| {name} | {scores.get('stage 1', float('nan')):.3f} | {scores.get('stage 3', float('nan')):.3f} |"
        )
    lines += [
        "",
        "## Ablations (best of stage 3 against the baseline's, or at step 200 of stage 1 where noted)",
        "",
        "| run | what changed | run | baseline | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    comparisons = {}
    for run, (what, base) in ABLATIONS.items():
        mine, theirs = compared(run, base)
        if mine is None or theirs is None:
            lines.append(f"| {run} | {what} | not run | | |")
            continue
        comparisons[run] = {
            "what": what,
            "baseline": base,
            "score": mine,
            "baseline_score": theirs,
            "ratio": mine / theirs,
        }
        lines.append(f"| {run} | {what} | {mine:.3f} | {theirs:.3f} | {mine / theirs:.3f}x |")
    result = {"held_out": runs, "ablations": comparisons}
    report_path = ROOT / "outputs" / "smollm2-abl-g-kl" / "eval" / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        shutil.copy(report_path, HERE / "report.json")
        shutil.copy(report_path.with_suffix(".md"), HERE / "report.md")
        result["tree"], (result["decode"], rows) = report["tree"], decode_rows(report)
        tree = report["tree"]
        lines += [
            "",
            f"## Decoding, tree {TreeConfig(**tree).label}, interleaved in one "
            "process, medians (`report.md` beside this file)",
            "",
            "| dataset / T | draft | τ | per-position acceptance | tokens/s | vs vanilla |",
            "|---|---|---:|---|---:|---:|",
            *rows,
        ]
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
