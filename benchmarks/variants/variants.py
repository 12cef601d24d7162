"""Collect `benchmarks/variants/variants.sh`'s results into benchmarks/variants/{variants.json, variants.md}:
each variant's best held-out expected accepted tokens per stage (from its runs' _complete.json) and
the interleaved evaluation's τ, per-position acceptance, tokens/s and speedup over vanilla (from
outputs/smollm2-variants-griffin/eval/report.json), plus the report itself.

    .venv/bin/python benchmarks/variants/variants.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from griffin.config import TreeConfig

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent
VARIANTS = ("griffin", "eagle3", "griffin3")
SCORE = "eval/sim_accept_len"


def held_out(variant: str) -> dict[str, float]:
    stages = sorted((ROOT / "outputs" / f"smollm2-variants-{variant}" / "train").glob("stage*/_complete.json"))
    return {
        f"stage {json.loads(p.read_text())['stage']}": json.loads(p.read_text())["best_metrics"][SCORE] for p in stages
    }


def main() -> None:
    OUT.mkdir(exist_ok=True)
    report_dir = ROOT / "outputs" / "smollm2-variants-griffin" / "eval"
    report = json.loads((report_dir / "report.json").read_text())
    for name in ("report.json", "report.md"):
        shutil.copy(report_dir / name, OUT / name)
    labels = {"griffin": "griffin", "eagle3": "eagle3", "griffin3": "griffin3"}
    rows, result = [], {"tree": report["tree"], "held_out": {v: held_out(v) for v in VARIANTS}, "decode": {}}
    for key, entry in report["results"].items():
        vanilla = entry["methods"]["vanilla"]["tokens_per_s_median"]
        for variant in VARIANTS:
            method = entry["methods"].get(labels[variant])
            if method is None:
                continue
            result["decode"].setdefault(key, {})[variant] = {
                "tau": method["tau"],
                "per_position_acceptance": method["per_position_acceptance"],
                "tokens_per_s": method["tokens_per_s_median"],
                "speedup_vs_vanilla": method["tokens_per_s_median"] / vanilla,
            }
            rows.append(
                f"| {key} | {variant} | {method['tau']:.2f} | "
                f"{' / '.join(f'{a:.2f}' for a in method['per_position_acceptance'])} | "
                f"{method['tokens_per_s_median']:.1f} | {method['tokens_per_s_median'] / vanilla:.2f}x |"
            )
    (OUT / "variants.json").write_text(json.dumps(result, indent=2))
    tree = report["tree"]
    lines = [
        "# GRIFFIN vs EAGLE-3 vs GRIFFIN-3 on SmolLM2 (`benchmarks/variants/variants.sh`)",
        "",
        "Held-out expected accepted tokens (`eval/sim_accept_len`, best checkpoint of each stage):",
        "",
        "| variant | " + " | ".join(result["held_out"]["griffin"]) + " |",
        "|---|" + "---:|" * len(result["held_out"]["griffin"]),
    ]
    for variant in VARIANTS:
        lines.append(f"| {variant} | " + " | ".join(f"{v:.3f}" for v in result["held_out"][variant].values()) + " |")
    lines += [
        "",
        f"Decoding, tree {TreeConfig(**tree).label}, interleaved in one process, medians:",
        "",
        "| dataset / T | variant | τ | per-position acceptance | tokens/s | vs vanilla |",
        "|---|---|---:|---|---:|---:|",
        *rows,
    ]
    (OUT / "variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
