"""The headline tables from the runs ``benchmarks/headline/headline.sh`` made: the paper's shape (tau and
speedup per dataset x temperature x method), the goals checked, and the data/training facts.

Reads ``outputs/<name>-griffin/eval/report.json`` (one interleaved evaluation of all drafts and
baselines), ``.../tune_tree/tune_tree.json``, the feature store manifest and each variant's training
summaries; writes ``benchmarks/headline/headline.json``, ``headline.md`` and ``headline.png``.

    python benchmarks/headline/headline.py [smollm2-full]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent
DRAFTS = {"eagle": "EAGLE-2", "hass": "HASS", "griffin": "GRIFFIN", "eagle3": "EAGLE-3", "griffin3": "GRIFFIN-3"}
SINGLE_LAYER, MULTI_LAYER = ("griffin", "hass", "eagle"), ("eagle3", "griffin3")
BASELINES = {"hf_generate": "HF generate", "hf_prompt_lookup": "HF prompt lookup"}
DATASETS = {"mt_bench": "MT-Bench", "humaneval": "HumanEval"}
# the drafts issue's goals (GRIFFIN's τ on MT-Bench at T=0; speedups are means over the datasets)
GOALS = {
    "tau_mt_bench_T0": 2.6,
    "speedup_vs_vanilla_T0": 2.0,
    "speedup_vs_hf_generate_T0": 2.6,
    "tau_vs_hass": 1.05,
    "tau_vs_eagle": 1.12,
    "speedup_vs_vanilla_T1": 1.5,
    "tau_multi_layer_vs_single_T0": 1.15,
}  # the EAGLE-3 issue's: best of EAGLE-3/GRIFFIN-3 over best of the rest


def _load(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run benchmarks/headline/headline.sh first")
    return json.loads(path.read_text())


def _training(run_dir: Path) -> list[dict]:
    stages = []
    for done in sorted((run_dir / "train").glob("stage*/_complete.json")):
        summary = json.loads(done.read_text())
        metrics = summary["best_metrics"]
        stages.append(
            {
                "stage": summary["stage"],
                "best": summary["best"],
                **{k: metrics.get(k) for k in ("eval/sim_accept_len", "eval/acc_0", "eval/acc_1", "train/loss")},
            }
        )
    return stages


def collect(name: str) -> dict:
    outputs = ROOT / "outputs"
    report = _load(outputs / f"{name}-griffin" / "eval" / "report.json")
    tune = _load(outputs / f"{name}-griffin" / "tune_tree" / "tune_tree.json")
    store = Path(report["config"]["features"]["store"] or outputs / f"{name}-griffin" / "features")
    manifest = _load(store / "_manifest.json")
    rows = {}
    for key, result in report["results"].items():  # "mt_bench/T0"
        methods, vanilla = result["methods"], result["methods"]["vanilla"]["tokens_per_s_median"]
        rows[key] = {
            m: {
                "tau": e.get("tau"),
                "tokens_per_s": e["tokens_per_s_median"],
                "speedup_vs_vanilla": e["tokens_per_s_median"] / vanilla,
                "generations": e["generations"],
                "draft_ms_per_round": e.get("draft_ms_per_round"),
                "verify_ms_per_round": e.get("verify_ms_per_round"),
            }
            for m, e in methods.items()
        }
        rows[key]["griffin"]["speedup_vs_hf_generate"] = result["speedup"].get("hf_generate")
        rows[key]["violations"] = sum(1 for m in result["mismatches"] if not m["near_tie"])
        rows[key]["near_ties"] = sum(1 for m in result["mismatches"] if m["near_tie"])
    return {
        "target": report["target"],
        "tree": report["tree"],
        "hardware": report["hardware"],
        "eval": {
            k: report["config"]["eval"][k]
            for k in ("datasets", "num_questions", "temperatures", "max_new_tokens", "baselines")
        },
        "data": {
            "conversations": manifest["totals"]["rows"],
            "tokens": manifest["totals"]["tokens"],
            "max_len": report["config"]["data"]["max_len"],
        },
        "training": {v: _training(outputs / f"{name}-{v}") for v in DRAFTS if (outputs / f"{name}-{v}").is_dir()},
        "tune_tree": {k: tune[k] for k in ("best", "expected_speedup", "verify_ms_by_tokens", "vanilla_tokens_per_s")},
        "results": rows,
        "goals": goals(rows),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def goals(rows: dict) -> dict:
    def over(temperature: str, field: str, method: str = "griffin") -> float:
        return _mean([r[method][field] for k, r in rows.items() if k.endswith(temperature) and r[method].get(field)])

    def tau_ratio(other: str) -> float:  # nan while that draft is not in the evaluation
        return _mean(
            [r["griffin"]["tau"] / r[other]["tau"] for k, r in rows.items() if k.endswith("/T0") and other in r]
        )

    def best_ratio(these: tuple[str, ...], those: tuple[str, ...]) -> float:
        ratios = []
        for key, row in rows.items():
            mine, theirs = [row[m]["tau"] for m in these if m in row], [row[m]["tau"] for m in those if m in row]
            if key.endswith("/T0") and mine and theirs:
                ratios.append(max(mine) / max(theirs))
        return _mean(ratios)

    measured = {
        "tau_mt_bench_T0": rows.get("mt_bench/T0", {}).get("griffin", {}).get("tau", float("nan")),
        "speedup_vs_vanilla_T0": over("/T0", "speedup_vs_vanilla"),
        "speedup_vs_hf_generate_T0": over("/T0", "speedup_vs_hf_generate"),
        "tau_vs_hass": tau_ratio("hass"),
        "tau_vs_eagle": tau_ratio("eagle"),
        "speedup_vs_vanilla_T1": over("/T1", "speedup_vs_vanilla"),
        "tau_multi_layer_vs_single_T0": best_ratio(MULTI_LAYER, SINGLE_LAYER),
    }
    prompt_lookup = over("/T0", "speedup_vs_vanilla", "hf_prompt_lookup")
    result = {k: {"goal": GOALS[k], "measured": v, "met": v >= GOALS[k]} for k, v in measured.items()}
    result["ahead_of_prompt_lookup_T0"] = {
        "goal": prompt_lookup,
        "measured": measured["speedup_vs_vanilla_T0"],
        "met": measured["speedup_vs_vanilla_T0"] > prompt_lookup,
    }
    return result


def markdown(data: dict) -> str:
    lines = [
        f"Target {data['target']}; tree {data['tree']} (picked by `griffin tune-tree`); "
        f"{data['data']['conversations']} ShareGPT conversations, {data['data']['tokens']:,} tokens "
        f"(max_len {data['data']['max_len']}); {data['eval']['num_questions']} questions per dataset "
        f"(MT-Bench: both turns), {data['eval']['max_new_tokens']} new tokens, batch 1.",
        "",
    ]
    temperatures = sorted({key.split("/")[1] for key in data["results"]})
    datasets = [d for d in DATASETS if any(k.startswith(d + "/") for k in data["results"])]
    for temperature in temperatures:
        header = " | ".join(f"{DATASETS[d]} speedup | {DATASETS[d]} τ" for d in datasets)
        lines += [
            f"**T = {temperature[1:]}** (speedup = median tokens/s over vanilla decoding in the same "
            "implementation; τ = tokens per target pass)",
            "",
            f"| method | {header} | mean speedup | mean τ |",
            "|---" * (3 + 2 * len(datasets)) + "|",
        ]
        evaluated = {m for d in datasets for m in data["results"][f"{d}/{temperature}"]}
        for method, label in {m: lab for m, lab in {**BASELINES, **DRAFTS}.items() if m in evaluated}.items():
            cells, speedups, taus = [], [], []
            for dataset in datasets:
                row = data["results"][f"{dataset}/{temperature}"].get(method)
                if row is None:
                    cells += ["-", "-"]
                    continue
                speedups.append(row["speedup_vs_vanilla"])
                cells.append(f"{row['speedup_vs_vanilla']:.2f}x")
                if row["tau"] is not None:
                    taus.append(row["tau"])
                cells.append(f"{row['tau']:.2f}" if row["tau"] is not None else "-")
            mean_tau = f"{_mean(taus):.2f}" if taus else "-"
            lines.append(f"| {label} | {' | '.join(cells)} | {_mean(speedups):.2f}x | {mean_tau} |")
        vanilla = " / ".join(
            f"{data['results'][f'{d}/{temperature}']['vanilla']['tokens_per_s']:.1f}" for d in datasets
        )
        lines += ["", f"Vanilla tokens/s ({' / '.join(DATASETS[d] for d in datasets)}): {vanilla}."]
        costs = []  # drafts timed in-process on every dataset
        for method, label in DRAFTS.items():
            timed = [data["results"][f"{d}/{temperature}"].get(method) for d in datasets]
            if all(row and row.get("draft_ms_per_round") is not None for row in timed):
                costs.append(
                    f"{label} "
                    + " / ".join(f"{row['draft_ms_per_round']:.1f} + {row['verify_ms_per_round']:.1f}" for row in timed)
                )
        if costs:
            lines += [
                "",
                f"Draft + verify ms per round ({' / '.join(DATASETS[d] for d in datasets)}): " + "; ".join(costs) + ".",
            ]
        lines += [""]
    lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
    for name, goal in data["goals"].items():
        met = "not measured" if goal["measured"] != goal["measured"] else "yes" if goal["met"] else "NO"
        lines.append(f"| {name} | {goal['goal']:.2f} | {goal['measured']:.2f} | {met} |")
    checks = [
        f"{k}: {r['violations']} violations, {r['near_ties']} bf16 near-tie divergences"
        for k, r in data["results"].items()
        if k.endswith("/T0")
    ]
    lines += ["", "T=0 losslessness (speculative vs vanilla, every draft): " + "; ".join(checks) + "."]
    return "\n".join(lines) + "\n"


def chart(data: dict, path: Path) -> None:
    """Speedup (every method) and τ (the drafts) per dataset/temperature. Each method keeps one
    colour in both panels, and one legend sits outside the bars, under them."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    keys = list(data["results"])
    evaluated = set.intersection(*(set(row) for row in data["results"].values()))
    methods = {m: label for m, label in {**BASELINES, **DRAFTS}.items() if m in evaluated}
    drafts = {m: label for m, label in DRAFTS.items() if m in evaluated}
    palette = colormaps["tab10"].colors
    colour = {method: palette[i % len(palette)] for i, method in enumerate({**BASELINES, **DRAFTS})}  # fixed
    figure = Figure(figsize=(12, 4.8))
    left, right = figure.subplots(1, 2)

    def bars(axes, shown: dict[str, str], value: str) -> None:
        width = 0.8 / len(shown)
        for i, method in enumerate(shown):
            xs = [g + i * width for g in range(len(keys))]
            axes.bar(xs, [data["results"][k][method][value] for k in keys], width, color=colour[method])
        axes.set_xticks([g + 0.4 - width / 2 for g in range(len(keys))], keys)

    bars(left, methods, "speedup_vs_vanilla")
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    left.set(ylabel="speedup over vanilla (x)", title="speedup (ratio of median tokens/s)")
    bars(right, drafts, "tau")
    right.set(ylabel="τ (tokens per target pass)", title="acceptance length")
    from matplotlib.patches import Patch

    figure.legend(
        handles=[Patch(color=colour[m], label=label) for m, label in methods.items()],
        loc="lower center",
        ncol=len(methods),
        fontsize="small",
        frameon=False,
    )
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=110)


def attach_to_registry(name: str, files: list[Path]) -> None:
    """One MLflow run holding the headline files; each variant's candidate version is tagged with it."""
    sys.path.insert(0, str(ROOT))
    from pipeline.config import load_config
    from pipeline.runtime import setup_mlflow

    cfg = load_config(ROOT / "jobs" / "configs" / f"{name}.yaml")
    mlflow = setup_mlflow(cfg)
    with mlflow.start_run(run_name=f"{name}-headline", tags={"stage": "headline"}) as run:
        for path in files:
            mlflow.log_artifact(str(path), "headline")
    client = mlflow.MlflowClient()
    for variant in DRAFTS:
        model = f"{cfg.target_slug}-{variant}"
        try:
            version = client.get_model_version_by_alias(model, "candidate")
        except mlflow.exceptions.MlflowException:
            continue  # not trained (yet) for this comparison
        client.set_model_version_tag(model, version.version, "headline_run_id", run.info.run_id)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-full"
    data = collect(name)
    stem = "headline" if name == "smollm2-full" else f"headline-{name}"
    files = [OUT / f"{stem}.json", OUT / f"{stem}.md", OUT / f"{stem}.png"]
    files[0].write_text(json.dumps(data, indent=2))
    files[1].write_text(markdown(data))
    chart(data, files[2])
    attach_to_registry(name, files)
    print(markdown(data))


if __name__ == "__main__":
    main()
