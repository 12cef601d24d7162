"""Issue 8's ablation tables from the runs ``benchmarks/ablations.sh`` made (see there for the design).

Score: ``eval/sim_accept_len`` of each stage's best checkpoint (held-out simulated acceptance: the
expected number of accepted draft tokens of a 5-step greedy chain drafted with the draft's own
features, sum_k prod_{i<=k} acc_i; tau of a chain is 1 + this) and the per-step acceptance ``eval/acc_k``. Writes benchmarks/ablations.json and ablations.md.

    python benchmarks/ablations.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent
RUNS = ROOT / "outputs"
METRICS = ("eval/sim_accept_len", "eval/acc_0", "eval/acc_1", "eval/acc_2")


def stage_score(run: str, stage: int) -> dict | None:
    done = RUNS / run / "train" / f"stage{stage}" / "_complete.json"
    if not done.is_file():
        return None
    metrics = json.loads(done.read_text())["best_metrics"]
    return {k: metrics.get(k) for k in METRICS}


def rows() -> dict[str, dict | None]:
    table = {
        "N=1 (stage-1 init, k=3)": stage_score("smollm2-full-griffin", 1),
        "N=2, k=3": stage_score("smollm2-abl-k3", 2),
        "N=3, k=3 (GRIFFIN default)": stage_score("smollm2-abl-k3", 3),
        "N=4, k=3": stage_score("smollm2-abl-k3", 4),
        "N=3, k=1": stage_score("smollm2-abl-k1", 3),
        "N=3, k=5": stage_score("smollm2-abl-k5", 3),
        "N=3, k=3, mask_shift=decode": stage_score("smollm2-abl-shift-decode", 3),
        "stage 1 only: GRIFFIN, 8k vocab": stage_score("smollm2-abl-s1-base", 1),
        "stage 1 only: without TGF": stage_score("smollm2-abl-s1-no-tgf", 1),
        "stage 1 only: without TEH": stage_score("smollm2-abl-s1-no-teh", 1),
        "stage 1 only: 4k vocab": stage_score("smollm2-abl-s1-vocab-4k", 1),
        "stage 1 only: 16k vocab": stage_score("smollm2-abl-s1-vocab-16k", 1),
        "stage 1 only: full 49152 vocab": stage_score("smollm2-abl-s1-vocab-full", 1),
    }
    return table


def markdown(table: dict[str, dict | None]) -> str:
    lines = ["| configuration | sim accepted / chain (held-out) | acc_0 | acc_1 | acc_2 |", "|---|---|---|---|---|"]
    for name, score in table.items():
        if score is None:
            lines.append(f"| {name} | not run | | | |")
            continue
        cells = [f"{score[m]:.3f}" if score[m] is not None else "-" for m in METRICS]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    table = rows()
    (OUT / "ablations.json").write_text(json.dumps(table, indent=2))
    (OUT / "ablations.md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
