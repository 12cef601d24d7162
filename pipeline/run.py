"""``griffin run -c CONFIG``: every stage end to end on one Ray cluster (local by default).

target -> [regenerate] -> [featurize] -> train (stages 1..N) -> register (candidate) -> [tune-tree]
-> evaluate through Ray Serve -> promote (champion if τ wins) -> results table. ``regenerate`` runs
when ``data.source`` is ``regenerated``; ``featurize`` unless ``train.features`` is ``online``;
``tune-tree`` when ``decode.tune`` is set, and the evaluation then decodes with the tree it picked. Every stage resumes instead of redoing: the
regenerated set and the store skip done sample ids, training skips completed stages and resumes an
interrupted one from its checkpoint, registration is idempotent on the weights' hash, a tuned tree
of the same draft, settings and machine is reused, and so is a finished evaluation of the same config,
weights and machine.

MLflow: one parent run per ``griffin run`` (resumed by a rerun on the same run directory), each stage
a child run of it (see docs/design.md, "MLflow").
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.config import DecodeSection, RunConfig
from pipeline.console import say
from pipeline.files import atomic_write_json


def steps(cfg: RunConfig) -> list[str]:
    optional = {
        "regenerate": cfg.data.source == "regenerated",
        "featurize": cfg.train.features == "offline",  # online: training computes the features it reads
        "tune-tree": cfg.decode.tune,
    }
    names = ["target", "regenerate", "featurize", "train", "register", "tune-tree", "evaluate", "promote"]
    return [name for name in names if optional.get(name, True)]


class Banners:
    def __init__(self, cfg: RunConfig):
        self.steps, self.started = steps(cfg), time.time()

    def __call__(self, name: str) -> None:
        index = self.steps.index(name)
        say(f"=== [{index + 1}/{len(self.steps)}] {name}  (t+{time.time() - self.started:.0f}s) ===")


def _tuned(cfg: RunConfig, model_uri: str) -> RunConfig:
    """``cfg`` decoding with the tree ``griffin tune-tree`` picks for this draft on this machine
    (a finished tuning of the same draft, with the same settings on the same machine, is reused)."""
    from pipeline.evaluate.tune import reusable_tuning, run_tune_tree

    tuning = reusable_tuning(cfg, model_uri)
    if tuning is not None:
        say(f"tune-tree for {model_uri} already in {cfg.run_dir / 'tune_tree'}: reused")
    else:
        tuning = run_tune_tree(cfg, draft=model_uri)
    decode = tuned_decode(cfg.decode, tuning)
    tree, sampled = decode.tree, decode.sampling_tree
    say(
        f"tree: total_tokens={tree.total_tokens} depth={tree.depth} top_k={tree.top_k} "
        f"(τ {tuning['best']['tau']:.2f} on the calibration prompts); at T > 0: {sampled.label if sampled else tree.label}"
    )
    tuned = cfg.model_copy(update={"decode": decode, "eval": cfg.eval.model_copy(update={"tree": None})})
    policy = tuned.speculation_policy
    say(
        f"serving policy (tree per batch size): {_policy_line(policy.trees)}"
        + (f"; at T > 0: {_policy_line(policy.sampling_trees)}" if decode.sampling_policy else "")
    )
    return tuned


def tuned_decode(decode: DecodeSection, tuning: dict[str, Any]) -> DecodeSection:
    """``decode`` with a tuning's trees and policies (tune_tree.json, or what
    ``griffin tune-tree`` returns); a tuning written before the sampling policy was measured keeps
    ``decode.sampling_policy``."""
    from griffin.config import TreeConfig

    def tree(measured: dict[str, Any]) -> TreeConfig:
        return TreeConfig(**{name: measured[name] for name in ("total_tokens", "depth", "top_k")})

    sampling = tuning["sampling"]
    update = {
        "tree": tree(tuning["best"]),
        "sampling_tree": tree(sampling["best"]),
        "policy": _policy(tuning["policy"]),
    }
    if sampling.get("policy"):
        update["sampling_policy"] = _policy(sampling["policy"])
    return decode.model_copy(update=update)


def _policy_line(trees: dict[int, Any]) -> str:
    """{1: 6/2/6, 4: None} -> "1: 6/2/6, 4: plain"."""
    return ", ".join(f"{size}: {tree.label if tree else 'plain'}" for size, tree in trees.items())


def _policy(policy: dict[str, Any]) -> dict[int, Any]:
    """tune_tree.json's policy {"1": tree dict, "4": null} -> decode.policy {1: TreeConfig, 4: None}."""
    from griffin.config import TreeConfig

    return {int(batch): (TreeConfig(**tree) if tree else None) for batch, tree in policy.items()}


def results_table(summary: dict[str, Any]) -> str:
    lines = [
        "| dataset / T | τ (GRIFFIN) | GRIFFIN tok/s | vanilla tok/s | speedup vs vanilla |",
        "|---|---|---|---|---|",
    ]
    for key, row in summary["results"].items():
        tps = row["tokens_per_s"]
        lines.append(
            f"| {key} | {row['tau']:.3f} | {tps.get('griffin', 0):.1f} | {tps.get('vanilla', 0):.1f} | "
            f"{row['speedup'].get('vanilla', float('nan')):.2f}x |"
        )
    return "\n".join(lines)


@contextmanager
def _stage_run(cfg: RunConfig, name: str) -> Iterator[None]:
    """A child run of ``griffin run``'s run for a stage that logs none of its own (featurize, promote...):
    its parameters and numeric results (``_log_results``) land there."""
    import mlflow

    with mlflow.start_run(run_name=f"{cfg.run_name}-{name}", nested=True, tags={"griffin.stage": name}):
        yield


def _log_results(result: dict[str, Any]) -> None:
    import mlflow

    numbers = {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    mlflow.log_metrics(numbers)
    mlflow.log_dict(json.loads(json.dumps(result, default=str)), "result.json")


def run_all(cfg: RunConfig) -> dict[str, Any]:
    """Every stage in one parent MLflow run (``pipeline_run``: resumed by a rerun), each stage its child.
    Holds the run directory's lease (``pipeline.lock``; re-entrant: ``griffin run`` already holds it) so
    that a caller from Python is kept from another writer too."""
    from pipeline.lock import run_lock
    from pipeline.resources.check_target import check_family
    from pipeline.runtime import ensure_ray, pipeline_run

    banner = Banners(cfg)
    # the family check reads the config only: an unsupported target is refused before Ray starts or a
    # stage spends anything (griffin check-target also checks decoding)
    family = check_family(cfg)
    say(f"target family {family['family']}: " + "; ".join(family["uses"]))
    with run_lock(cfg.run_dir, "pipeline.run.run_all"):
        ensure_ray(cfg)
        with pipeline_run(cfg) as run:
            say(f"MLflow run {run.info.run_id} in {cfg.tracking_uri}")
            result = _stages(cfg, banner)
        say(f"\nfinished in {time.time() - banner.started:.0f}s")
        result["elapsed_s"] = time.time() - banner.started
        atomic_write_json(cfg.run_dir / "run_summary.json", result)
    return {
        "locations": result["locations"],
        "promotion": result["promotion"]["promoted"],
        "elapsed_s": round(result["elapsed_s"]),
    }


def _stages(cfg: RunConfig, banner: Banners) -> dict[str, Any]:
    from pipeline.evaluate.evaluate import run_eval
    from pipeline.data.featurize import run_featurize
    from pipeline.registry.register import promote, register
    from griffin.target import resolve_dtype
    from pipeline.resources.identity import target_identity
    from pipeline.train.driver import run_train

    banner("target")
    target = target_identity(cfg.target)  # config and shapes: the stages load what they need themselves
    text = target.hf_config.get_text_config()
    say(
        f"target {target.name}: {text.model_type}, {text.num_hidden_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}; {resolve_dtype(cfg.target.dtype, cfg.target.device)} on {cfg.target.device}"
    )
    if "regenerate" in banner.steps:
        from pipeline.data.regenerate import run_regenerate

        banner("regenerate")
        with _stage_run(cfg, "regenerate"):
            _log_results(run_regenerate(cfg))
    featurized = None
    if "featurize" in banner.steps:
        banner("featurize")
        with _stage_run(cfg, "featurize"):
            featurized = run_featurize(cfg)
            _log_results(featurized)
    banner("train")
    trained = run_train(cfg)  # a child run per stage (pipeline.train.driver)
    banner("register")
    version = register(cfg, trained["best"])  # inside the training run, or a child run of its own
    say(f"registered {version['model_uri']} (candidate; {'new' if version['created'] else 'already registered'})")
    if "tune-tree" in banner.steps:
        banner("tune-tree")
        with _stage_run(cfg, "tune-tree"):
            cfg = _tuned(cfg, version["model_uri"])
    banner("evaluate")
    summary = run_eval(cfg, draft=version["model_uri"], reuse_finished=True)  # a child run (report.log_report)
    banner("promote")
    with _stage_run(cfg, "promote"):
        promotion = promote(cfg, version["version"])
        _log_results(promotion)
    say(f"promotion: {'champion' if promotion['promoted'] else 'not promoted'} ({promotion['reason']})")

    table = results_table(summary)
    locations = {
        "report": str(cfg.run_dir / "eval" / "report.md"),
        "feature_store": cfg.store_path if featurized else "none (train.features=online)",
        "checkpoints": str(cfg.run_dir / "train"),
        "best_draft": trained["best"],
        "mlflow": cfg.tracking_uri,
        "model": version["model_uri"],
    }
    say("\n" + table + "\n")
    for name, where in locations.items():
        say(f"{name:>13}: {where}")
    return {"table": table, "locations": locations, "promotion": promotion, "summary": summary, "featurize": featurized}
