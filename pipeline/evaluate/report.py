"""Evaluation reports: metrics from generation records; JSON, Markdown tables and PNG plots; MLflow.

The metric definitions (docs/design.md §8, docs/method.md §6) are written into every report.
"""

from __future__ import annotations

import json
import os
import platform
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

import torch

from griffin.results import acceptance_length
from pipeline.files import atomic_write_json, atomic_write_text

DEFINITIONS = {
    "tau": "acceptance length: tokens committed per target verification pass, bonus token included: "
    "tau = sum over rounds (accepted + 1) / rounds, pooled over every round of every generation "
    "(the exact definition; not GRIFFIN's script, which divides by rounds - 1)",
    "per_position_acceptance": "alpha_k = #rounds accepting >= k draft tokens / #rounds accepting >= k-1",
    "acceptance_histogram": "count of rounds by draft tokens accepted (0..depth); committed = accepted + 1",
    "tokens_per_s": "new tokens (stop token included) / wall time of the whole generation call, prefill "
    "included; the median over generations (question x turn)",
    "speedup": "median tokens/s of GRIFFIN / median tokens/s of the baseline, over the same generations: "
    "a ratio of medians (EAGLE's speed.py uses a ratio of means)",
    "mismatches": "T=0 generations where a speculative method's output differs from vanilla decoding; each "
    "with the first divergent position and the target's top-two logit gap there",
    "violations": "mismatches that are not bf16 near-ties (gap > 0.25 logits): must be 0",
    "draft_ms_per_round": "in-process speculative methods: wall time of drafting (catch-up on the committed "
    "tokens + the tree's levels) over all generations / rounds; verify_ms_per_round the "
    "same for the target's verify pass with acceptance and KV compaction",
    "protocol": "per dataset and temperature, each question turn is decoded by every method back to back "
    "(order rotated per question) with the same prompt, max_new_tokens, sampling and seed; "
    "MT-Bench turn 2 carries GRIFFIN's turn-1 answer for every method; one untimed warm-up "
    "generation per method; batch 1",
}


def _acceptance(accepted: list[int], depth: int) -> dict[str, Any]:
    reached = [sum(1 for a in accepted if a >= k) for k in range(depth + 1)]  # reached[0] = rounds
    return {
        "rounds": len(accepted),
        "tau": acceptance_length(accepted),
        "per_position_acceptance": [
            reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, depth + 1)
        ],
        "acceptance_histogram": [sum(1 for a in accepted if a == k) for k in range(depth + 1)],
    }


def _round_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Drafting and verifying ms per round, pooled over generations; only where every generation has
    them (none through the endpoint)."""
    rounds = sum(len(r["accepted_per_round"]) for r in rows)
    if not rounds or any(r.get("draft_seconds") is None for r in rows):
        return {}
    return {
        f"{part}_ms_per_round": 1000 * sum(r[f"{part}_seconds"] for r in rows) / rounds for part in ("draft", "verify")
    }


def _group(rows: list[dict[str, Any]], methods: list[str], depth: int) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        entry = {
            "generations": len(mine),
            "new_tokens": sum(r["new_tokens"] for r in mine),
            "tokens_per_s_median": median(r["tokens_per_s"] for r in mine),
        }
        if mine and mine[0]["accepted_per_round"] is not None:
            entry.update(_acceptance([a for r in mine for a in r["accepted_per_round"]], depth))
            entry.update(_round_cost(mine))
        stats[method] = entry
    griffin = stats["griffin"]["tokens_per_s_median"]
    speedup = {m: griffin / s["tokens_per_s_median"] for m, s in stats.items() if m != "griffin"}
    for method, entry in stats.items():  # other drafts against the same vanilla (the paper's table)
        if "tau" in entry:
            entry["speedup_vs_vanilla"] = entry["tokens_per_s_median"] / stats["vanilla"]["tokens_per_s_median"]
    mismatches = [
        {"method": r["method"], "question_id": r["question_id"], "turn": r["turn"], **r["divergence"]}
        for r in rows
        if r["mismatch"]
    ]
    return {"methods": stats, "speedup": speedup, "mismatches": mismatches}


def violations(result: dict[str, Any]) -> list[dict[str, Any]]:
    """T=0 divergences from vanilla that bf16 rounding cannot explain (see evaluate.first_divergence)."""
    return [m for m in result["mismatches"] if not m["near_tie"]]


def hardware() -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_identity() -> dict[str, Any]:
    """What of ``hardware()`` decides a speed measurement: two machines that agree on it run the same
    kernels on the same cores (the vector ISA matters: one "AMD EPYC" has AVX-512 BF16, another AVX2)."""
    keys = ("processor", "cpu_model", "cpu_capability", "cpu_count", "torch_threads", "gpu", "torch")
    return {key: value for key, value in hardware().items() if key in keys}


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def summarize(records: list[dict[str, Any]], methods: list[str], cfg: Any, target: Any, draft_uri: str | None):
    """The report: per dataset x temperature results, flat MLflow metrics and the returned summary."""
    groups = defaultdict(list)
    for row in records:
        groups[(row["dataset"], row["temperature"])].append(row)
    results, metrics, summary = {}, {}, {}
    for (dataset, temperature), rows in groups.items():
        key = f"{Path(dataset).stem}/T{temperature:g}"
        result = results[key] = _group(rows, methods, cfg.eval_tree.depth)
        summary[key] = {
            "tau": result["methods"]["griffin"]["tau"],
            "speedup": result["speedup"],
            "tokens_per_s": {m: s["tokens_per_s_median"] for m, s in result["methods"].items()},
            "mismatches": len(result["mismatches"]),
        }
        metrics[f"{key}/tau"] = summary[key]["tau"]
        metrics[f"{key}/mismatches"] = summary[key]["mismatches"]
        metrics[f"{key}/violations"] = summary[key]["violations"] = len(violations(result))
        metrics.update({f"{key}/tokens_per_s/{m}": v for m, v in summary[key]["tokens_per_s"].items()})
        metrics.update({f"{key}/speedup/{m}": v for m, v in result["speedup"].items()})
        metrics.update({f"{key}/tau/{m}": e["tau"] for m, e in result["methods"].items() if "tau" in e})
    mode = "through_serve" if cfg.eval.through_serve else "in_process"
    return {
        "definitions": DEFINITIONS,
        "mode": mode,
        "target": target.name,
        "draft": draft_uri,
        "tree": cfg.eval_tree.model_dump(),
        "sampling_tree": cfg.decode.sampling_tree.model_dump() if cfg.decode.sampling_tree else None,
        "draft_tokens_per_round": cfg.eval_tree.total_tokens - 1,
        "hardware": hardware(),
        "config": cfg.resolved(),
        "results": results,
        "metrics": metrics,
        "summary": {"mode": mode, "results": summary},
    }


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Evaluation: {report['target']} with draft {report['draft']}",
        "",
        f"Mode: {report['mode']}. Tree: {report['tree']} ({report['draft_tokens_per_round']} draft tokens "
        f"per round). Hardware: {report['hardware']['processor']}, {report['hardware']['cpu_count']} CPUs, "
        f"{report['hardware']['torch_threads']} torch threads.",
        "",
        "Definitions:",
        "",
    ]
    lines += [f"- **{name}**: {text}" for name, text in report["definitions"].items()]
    for key, result in report["results"].items():
        lines += [
            "",
            f"## {key}",
            "",
            "| method | generations | median tokens/s | tau | speedup vs vanilla "
            "| GRIFFIN speedup over it | draft / verify ms per round |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for method, entry in result["methods"].items():
            tau = f"{entry['tau']:.3f}" if "tau" in entry else "-"
            own = f"{entry['speedup_vs_vanilla']:.2f}x" if "speedup_vs_vanilla" in entry else "-"
            speedup = f"{result['speedup'][method]:.2f}x" if method in result["speedup"] else "-"
            cost = (
                f"{entry['draft_ms_per_round']:.1f} / {entry['verify_ms_per_round']:.1f}"
                if "draft_ms_per_round" in entry
                else "-"
            )
            lines.append(
                f"| {method} | {entry['generations']} | {entry['tokens_per_s_median']:.1f} | {tau} | {own} "
                f"| {speedup} | {cost} |"
            )
        alphas = result["methods"]["griffin"]["per_position_acceptance"]
        lines += [
            "",
            "GRIFFIN per-position acceptance: "
            + ", ".join(f"a{k + 1}={a:.3f}" if a is not None else f"a{k + 1}=n/a" for k, a in enumerate(alphas)),
            "",
            f"Acceptance histogram (rounds by accepted 0..depth): "
            f"{result['methods']['griffin']['acceptance_histogram']}",
        ]
        if bad := violations(result):
            lines += [
                "",
                f"**LOSSLESSNESS VIOLATION: {len(bad)} T=0 generations differ from vanilla where the "
                f"target's choice was not a near-tie: {bad}**",
            ]
        if ties := [m for m in result["mismatches"] if m["near_tie"]]:
            lines += [
                "",
                f"{len(ties)} T=0 generations left vanilla's at a bf16 near-tie (top-two logit gap <= "
                f"{max(m['gap'] for m in ties):.3f}): the tree verify and the single-token step round "
                "differently, not an algorithmic difference (the fp32 tests check exact equality). "
                f"Where: {[(m['method'], m['question_id'], m['turn'], m['index']) for m in ties]}",
            ]
    return "\n".join(lines) + "\n"


def _bar_chart(
    path: Path, title: str, ylabel: str, series: dict[str, dict[str, float]], reference: float | None = None
) -> None:
    """Grouped bars: one group per dataset x temperature, one bar per method."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(max(6, 1.6 * len(series)), 4))
    axes = figure.add_subplot()
    names = list(dict.fromkeys(name for values in series.values() for name in values))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [g + i * width for g in range(len(series))]
        axes.bar(xs, [values.get(name, 0.0) for values in series.values()], width, label=name)
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(series))], list(series))
    if reference is not None:
        axes.axhline(reference, color="black", linewidth=0.8, linestyle="--")
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _histogram(path: Path, results: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    for key, result in results.items():
        counts = result["methods"]["griffin"]["acceptance_histogram"]
        total = sum(counts) or 1
        axes.plot(range(len(counts)), [c / total for c in counts], marker="o", label=key)
    axes.set_xlabel("draft tokens accepted per round")
    axes.set_ylabel("fraction of rounds")
    axes.set_title("GRIFFIN acceptance histogram")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def write_reports(eval_dir: Path, report: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    """report.json, report.md, generations.jsonl and three PNGs under ``eval_dir``."""
    eval_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(eval_dir / "report.json", report)  # ship and register read it: whole or absent
    atomic_write_text(eval_dir / "report.md", _markdown(report))
    with open(eval_dir / "generations.jsonl", "w") as out:
        for row in records:
            out.write(json.dumps(row) + "\n")
    results = report["results"]
    taus = {k: {m: e["tau"] for m, e in r["methods"].items() if "tau" in e} for k, r in results.items()}
    _bar_chart(eval_dir / "tau.png", "Acceptance length tau (bonus token included)", "tau", taus)
    _bar_chart(
        eval_dir / "speedup.png",
        "GRIFFIN speedup over each baseline (ratio of median tokens/s)",
        "speedup (x)",
        {k: r["speedup"] for k, r in results.items()},
        reference=1.0,
    )
    _histogram(eval_dir / "acceptance_histogram.png", results)
    return eval_dir


def _registry_version(uri: str | None) -> dict[str, str]:
    """{'draft_model_name', 'draft_model_version', 'draft_model_id'} for a models:/name@alias or
    models:/name/version URI (the model id: the MLflow 3 logged model the version points at)."""
    if not uri or not uri.startswith("models:/"):
        return {}
    from mlflow import MlflowClient

    path, client = uri.removeprefix("models:/"), MlflowClient()
    if "@" in path:
        version = client.get_model_version_by_alias(*path.split("@", 1))
    else:
        version = client.get_model_version(*path.rsplit("/", 1))
    model_id = version.model_id or (version.source or "").removeprefix("models:/")
    return {"draft_model_name": version.name, "draft_model_version": str(version.version), "draft_model_id": model_id}


def _log_model_metrics(mlflow: Any, metrics: dict[str, float], drafts: dict[str, str | None]) -> None:
    """Each registered draft's own measurements (``<dataset>/T<t>/<metric>/<label>``) also on its logged
    model (``model_id``), so the model's page in MLflow shows what it was measured at."""
    for label, uri in drafts.items():
        model_id = _registry_version(uri).get("draft_model_id")
        ours = {key.removesuffix(f"/{label}"): value for key, value in metrics.items() if key.endswith(f"/{label}")}
        if model_id and ours:
            mlflow.log_metrics(ours, model_id=model_id)


def log_report(cfg: Any, report: dict[str, Any], eval_dir: Path, draft_uri: str | None) -> str:
    """One MLflow run with the metrics, config and report files, tagged with the draft's model version;
    the version itself gets the measured tau as tags (``eval.<dataset>.T<t>.tau``) for promotion."""
    from pipeline.registry.register import record_evaluation
    from pipeline.runtime import setup_mlflow

    mlflow = setup_mlflow(cfg)
    tags = {"stage": "eval", "draft_uri": str(draft_uri), **_registry_version(draft_uri)}
    # nested: a child of `griffin run`'s run when one is active, a top-level run otherwise
    with mlflow.start_run(run_name=f"{cfg.run_name}-eval", tags=tags, nested=True) as run:
        mlflow.log_metrics(report["metrics"])
        mlflow.log_dict(cfg.resolved(), "config.json")
        mlflow.log_artifacts(str(eval_dir), "eval")
        _log_model_metrics(mlflow, report["metrics"], {"griffin": draft_uri, **cfg.eval.extra_drafts})
    # each registered draft's version gets its own measured tau (tags eval.<dataset>.T<t>.tau), for promotion;
    # tau depends on the tree budget, so the version also says which tree and which run measured it
    tree = cfg.eval_tree
    for label, uri in {"griffin": draft_uri, **cfg.eval.extra_drafts}.items():
        if version := _registry_version(uri):
            name, number = version["draft_model_name"], version["draft_model_version"]
            taus = {
                f"eval.{key.removesuffix(f'/{label}').replace('/', '.')}": value
                for key, value in report["metrics"].items()
                if key.endswith(f"/tau/{label}")
            }
            # a real T=0 divergence (not a bf16 near-tie) blocks promotion (registry._refusal)
            broken = sum(m["method"] == label for result in report["results"].values() for m in violations(result))
            about = {"eval_run_id": run.info.run_id, "eval_tree": tree.label}
            record_evaluation(mlflow.MlflowClient(), name, number, taus, broken, **about)
    return run.info.run_id
