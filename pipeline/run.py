"""``griffin run -c CONFIG``: every stage end to end on one Ray cluster (local by default).

target -> featurize -> train (stages 1..N) -> register (candidate) -> evaluate through Ray Serve
-> promote (champion if τ wins) -> results table. Every stage resumes instead of redoing: the
store skips done sample ids, training skips completed stages and resumes an interrupted one from
its checkpoint, registration is idempotent on the weights' hash, and the evaluation report of the
same model version is reused.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pipeline.config import RunConfig
from pipeline.console import say

STEPS = ["target", "featurize", "train", "register", "evaluate", "promote"]


def _banner(index: int, started: float) -> None:
    say(f"=== [{index + 1}/{len(STEPS)}] {STEPS[index]}  (t+{time.time() - started:.0f}s) ===")


def _cached_eval(cfg: RunConfig, model_uri: str) -> dict[str, Any] | None:
    report = cfg.run_dir / "eval" / "report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        if data.get("draft") == model_uri:
            return data["summary"]
    return None


def results_table(summary: dict[str, Any]) -> str:
    lines = ["| dataset / T | τ (GRIFFIN) | GRIFFIN tok/s | vanilla tok/s | speedup vs vanilla |",
             "|---|---|---|---|---|"]
    for key, row in summary["results"].items():
        tps = row["tokens_per_s"]
        lines.append(f"| {key} | {row['tau']:.3f} | {tps.get('griffin', 0):.1f} | {tps.get('vanilla', 0):.1f} | "
                     f"{row['speedup'].get('vanilla', float('nan')):.2f}x |")
    return "\n".join(lines)


def run_all(cfg: RunConfig) -> dict[str, Any]:
    from pipeline.evaluate import run_eval
    from pipeline.featurize import run_featurize
    from pipeline.registry import promote, register
    from pipeline.runtime import ensure_ray
    from pipeline.resources import load_target
    from pipeline.train import run_train

    started = time.time()
    ensure_ray(cfg)
    _banner(0, started)
    target = load_target(cfg.target)
    say(f"target {target.name}: {sum(p.numel() for p in target.model.parameters()) / 1e6:.1f}M params, "
        f"{target.dtype}, {target.device}")
    del target
    _banner(1, started)
    featurized = run_featurize(cfg)
    _banner(2, started)
    trained = run_train(cfg)
    _banner(3, started)
    version = register(cfg, trained["best"])
    say(f"registered {version['model_uri']} (candidate; {'new' if version['created'] else 'already registered'})")
    _banner(4, started)
    summary = _cached_eval(cfg, version["model_uri"])
    if summary is None:
        summary = run_eval(cfg, draft=version["model_uri"])
    else:
        say(f"evaluation of {version['model_uri']} already in {cfg.run_dir / 'eval'}: reused")
    _banner(5, started)
    promotion = promote(cfg, version["version"])
    say(f"promotion: {'champion' if promotion['promoted'] else 'not promoted'} ({promotion['reason']})")

    table = results_table(summary)
    locations = {
        "report": str(cfg.run_dir / "eval" / "report.md"),
        "feature_store": cfg.store_path,
        "checkpoints": str(cfg.run_dir / "train"),
        "best_draft": trained["best"],
        "mlflow": cfg.tracking_uri,
        "model": version["model_uri"],
    }
    say("\n" + table + "\n")
    for name, where in locations.items():
        say(f"{name:>13}: {where}")
    say(f"\nfinished in {time.time() - started:.0f}s")
    result = {"table": table, "locations": locations, "promotion": promotion, "summary": summary,
              "featurize": featurized, "elapsed_s": time.time() - started}
    (cfg.run_dir / "run_summary.json").write_text(json.dumps(result, indent=2, default=str))
    return {"locations": locations, "promotion": promotion["promoted"], "elapsed_s": round(result["elapsed_s"])}
