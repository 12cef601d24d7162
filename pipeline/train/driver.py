"""Token-alignable training on Ray Train (docs/method.md §3).

``run_train(cfg)`` runs the schedule stage by stage (stage 1: one pass; stage j: j harmonized
passes), each stage a ``TorchTrainer`` run named ``<run_name>-stage<j>`` under
``<run_dir>/ray_train`` and initialised from the previous stage's best draft. The worker loop only
wires data, DDP, reporting and checkpoints; the step and the evaluation are ``griffin.training``.

Outputs: ``<run_dir>/train/stage<j>/best`` (a draft directory) and ``_complete.json`` per stage,
and ``<run_dir>/train/best`` for the last stage. A rerun skips completed stages and resumes an
interrupted one from its latest checkpoint (same run name + storage path).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from griffin.config import DraftConfig, StagePlan
from griffin.model import GriffinDraft
from pipeline.config import RunConfig, StageSection
from pipeline.console import Progress, say
from pipeline.files import atomic_write_json, atomic_write_text, read_marker, reuse_key
from pipeline.runtime import cluster_address, ensure_ray, feature_dataset, recorded_run, setup_mlflow
from pipeline.data.integrity import require_unique_ids
from pipeline.data.store import check_capture_key
from pipeline.train import failures
from pipeline.data.parts import ACTOR_START_S
from pipeline.train.inputs import (
    check_stage_fits,
    data_config,
    estimated_bytes,
    materialize,
    materialized_parts,
    online_parts,
    should_materialize,
    stored_eval,
    stored_parts,
)
from pipeline.train.stream import epochs_hint, train_stream
from pipeline.resources.drafts import check_lineage, resolve_draft
from pipeline.resources.identity import target_fingerprint, target_identity
from pipeline.resources.targets import draft_feature_layers
from pipeline.train.channel import StageChannel
from pipeline.train.job import StageJob
from pipeline.train.worker import SCORE, TRAIN_STATE, train_worker
from pipeline.data.heldout import held_out_ids, store_part_ids
from pipeline.train.batches import reduced_vocabulary, store_tokens

logger = logging.getLogger(__name__)


def stage_dir(cfg: RunConfig, stage: int) -> Path:
    return cfg.run_dir / "train" / f"stage{stage}"


def stage_plan(cfg: RunConfig, stage: StageSection) -> StagePlan:
    """What one stage runs per step: passes from the stage number, the loss and mask set from the
    variant, the LR from the schedule, and an LR decay that spans the stage unless pinned."""
    return StagePlan.for_stage(stage.stage, cfg.draft.variant, stage.steps, stage.lr, cfg.train.method.total_steps)


@contextmanager
def _console_progress(stage: StageSection, stages: list[int]) -> Iterator[tuple[Progress, Any]]:
    """While ``fit`` runs: the stage's console line, fed by the ``StageChannel`` actor that rank 0
    pushes each step to; yields (the line, the actor handle for the workers).
    "stage 2/3" for a schedule of stages 1..3; "stage 3" for a schedule that is not (a fine-tune)."""
    import ray

    of = f"/{len(stages)}" if stages == list(range(1, len(stages) + 1)) else ""
    progress = Progress(f"train stage {stage.stage}{of}", stage.steps, "steps")
    channel = ray.remote(num_cpus=0)(StageChannel).remote()
    stop = threading.Event()

    def watch() -> None:
        first = True
        while not stop.wait(2.0):
            try:
                state = ray.get(channel.latest.remote(), timeout=10)
            except Exception:  # Ray going down with the driver: the line just stops moving
                return
            if state:
                if first:  # a resumed stage starts near there: its rate counts from the step it resumed at
                    progress.initial, first = max(state["step"] - 1, 0), False
                score = f"  held-out {state['score']:.3f}" if state.get("score") is not None else ""
                progress.update(state["step"], f"loss {state['loss']:.3f}{score}")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield progress, channel
    finally:
        stop.set()
        watcher.join()
        ray.kill(channel)


def _trainer(cfg: RunConfig, stage: StageSection, job: StageJob | None, datasets: dict[str, Any]):
    """The stage's TorchTrainer: ``train_worker`` on ``train.num_workers`` workers, given ``job``, each
    reading its split of ``datasets`` (``pipeline.train.inputs``), checkpoints kept by the held-out score, resumable
    under the same run name and storage path."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_worker,
        train_loop_config={"job": job},
        datasets=datasets,
        dataset_config=data_config(),
        scaling_config=ScalingConfig(
            num_workers=cfg.train.num_workers,
            use_gpu=cfg.train.use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker, **cfg.train.resources},
            placement_strategy=cfg.train.placement_strategy,
        ),
        run_config=RayRunConfig(
            name=f"{cfg.run_name}-stage{stage.stage}",
            storage_path=str((cfg.run_dir / "ray_train").resolve()),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.train.num_to_keep, checkpoint_score_attribute=SCORE, checkpoint_score_order="max"
            ),
            # preemptions (a drained node) have their own budget, unlimited; max_failures counts the rest,
            # bounded again by train.max_same_failures (pipeline.train.failures) when it is -1
            failure_config=FailureConfig(max_failures=cfg.train.max_failures, max_preemption_failures=-1),
        ),
    )


def check_resume_world_size(cfg: RunConfig, stage: StageSection) -> None:
    """Refuse to resume a stage at another world size than its latest checkpoint was saved at: each rank's
    data position (rows taken) holds for that world only, so another would skip the wrong rows. The
    world size is the number of ranks that saved their RNG state there (rank 0 also records it)."""
    run = cfg.run_dir / "ray_train" / f"{cfg.run_name}-stage{stage.stage}"
    checkpoints = sorted(p for p in run.glob("checkpoint_*") if p.is_dir() and any(p.glob("rng_rank*.pt")))
    if not checkpoints:
        return
    state = checkpoints[-1] / TRAIN_STATE
    if state.exists() and "stream" not in torch.load(state, weights_only=True, mmap=True):
        raise ValueError(
            f"stage {stage.stage} would resume from {checkpoints[-1]}, saved by an earlier version that read "
            "its data in another order: start the stage again under another run_name"
        )
    saved = len(list(checkpoints[-1].glob("rng_rank*.pt")))  # Ray names checkpoints by time: the last is the latest
    if saved != cfg.train.num_workers:
        raise ValueError(
            f"stage {stage.stage} would resume from {checkpoints[-1]}, saved by {saved} workers, with "
            f"train.num_workers={cfg.train.num_workers}: each rank's place in the data holds for {saved} ranks "
            f"only. Resume with train.num_workers={saved}, or start the stage again under another run_name"
        )


def _run_stage(cfg: RunConfig, stage: StageSection, init_dir: str | None, d2t, context: dict[str, Any]) -> Path:
    out = stage_dir(cfg, stage.stage)
    out.mkdir(parents=True, exist_ok=True)
    mlflow = setup_mlflow(cfg)
    plan = stage_plan(cfg, stage)
    run_id_file = out / "mlflow_run_id"
    if not _run_exists(mlflow, run_id_file):  # reuse the MLflow run when an interrupted stage resumes
        # nested: a child of `griffin run`'s run when one is active, a top-level run otherwise
        with mlflow.start_run(run_name=f"{cfg.run_name}-stage{stage.stage}", nested=True) as run:
            mlflow.log_params(
                {
                    "variant": cfg.draft.variant,
                    "stage": stage.stage,
                    "steps": stage.steps,
                    "workers": cfg.train.num_workers,
                    **cfg.train.method.model_dump(),
                    **{f"plan.{k}": v for k, v in plan.model_dump().items()},
                }
            )
            mlflow.log_dict(cfg.resolved(), "resolved_config.json")
            digest = context["provenance"]["feature_manifest_sha256"]
            online = cfg.train.features == "online"
            source = str(cfg.training_data.source) if online else cfg.store_path
            dataset = feature_dataset(source, digest, f"online:{Path(source).name}" if online else None)
            mlflow.log_input(dataset, context="training", tags={"sha256": digest, "features": cfg.train.features})
            atomic_write_text(run_id_file, run.info.run_id)
    run_id = run_id_file.read_text().strip()
    job = StageJob(
        run=cfg,
        stage=stage,
        plan=plan,
        init_dir=init_dir,
        d2t=d2t,
        has_eval=context["inputs"]["eval"] is not None,
        epochs_hint=_epochs_hint(cfg, stage, context["inputs"]),
        mlflow_run_id=run_id,
        stage_dir=out.resolve(),
        provenance={**context["provenance"], "stage": stage.stage, "train_run_id": run_id, "init_from": init_dir},
    )
    with (
        _console_progress(stage, [s.stage for s in cfg.train.schedule]) as (progress, channel),
        # RUNNING while the workers log into it: rank 0's system metrics monitor stops when it ends
        mlflow.start_run(run_id=run_id, nested=True, log_system_metrics=False),
    ):
        failures.clear(out)
        check_resume_world_size(cfg, stage)
        datasets = _stage_datasets(cfg, context["inputs"], channel)
        result = _trainer(cfg, stage, dataclasses.replace(job, channel=channel), datasets).fit()
        if given_up := failures.exhausted(out, cfg.train.max_same_failures):
            raise RuntimeError(
                f"train stage {stage.stage} stopped after the same failure {given_up['count']} times in a row "
                f"with no checkpoint between (train.max_same_failures): {given_up['message']} "
                f"({given_up['signature']}; ledger {out / failures.LEDGER})"
            )
    best_checkpoint, best_metrics = max(result.best_checkpoints, key=lambda item: item[1][SCORE])
    progress.update(stage.steps)
    progress.close(f"best held-out {SCORE.split('/')[-1]} {best_metrics[SCORE]:.3f}")
    with best_checkpoint.as_directory() as directory:
        shutil.rmtree(out / "best", ignore_errors=True)
        shutil.copytree(Path(directory) / "draft", out / "best")
    _log_curves(mlflow, run_id, out)
    summary = {"stage": stage.stage, "best_metrics": best_metrics, "mlflow_run_id": run_id, "best": str(out / "best")}
    atomic_write_json(out / "_complete.json", summary)  # whole or absent: a cut-short marker never skips a stage
    return out / "best"


def _run_exists(mlflow, run_id_file: Path) -> bool:
    return recorded_run(mlflow, run_id_file) is not None  # not when recorded in another tracking store


def _log_curves(mlflow, run_id: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    client = mlflow.tracking.MlflowClient()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, keys in zip(axes, (["train/loss", "train/value", "train/token"], [SCORE, "eval/acc_0"])):
        for key in keys:
            history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
            if history:
                ax.plot([m.step for m in history], [m.value for m in history], label=key)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=90)
    plt.close(fig)
    client.log_artifact(run_id, str(out / "curves.png"))


def _checked_init(cfg: RunConfig, target) -> str | None:
    """``train.init_from``: the draft the first stage starts from (e.g. another run's stage-1 best, so
    that ablations of the later stages share one stage 1, or a shipped draft to fine-tune): any form
    ``pipeline.resources`` resolves, trained for this target and of this run's variant. Also checks
    ``draft.init_layer`` (the other way to start), here on the driver, so that a bad one fails before
    Ray Train starts."""
    if cfg.draft.init_layer is not None:
        layers = len(target.backbone.layers)
        if cfg.train.init_from is not None:
            raise ValueError("draft.init_layer and train.init_from both say where the draft starts; keep one")
        if not -layers <= cfg.draft.init_layer < layers:
            raise ValueError(
                f"draft.init_layer={cfg.draft.init_layer}: the target has {layers} decoder layers "
                f"(0..{layers - 1}, or -1..-{layers} from the end)"
            )
        draft_cfg = DraftConfig.from_target(target.hf_config, variant=cfg.draft.variant, **cfg.draft.overrides)
        with torch.device("meta"):  # shapes only: the variant and shapes fit, or a clear error
            draft = GriffinDraft(draft_cfg, target.embed_weight, target.head_weight)
        draft.start_from_target_layer(target.backbone.layers[cfg.draft.init_layer])
    if cfg.train.init_from is None:
        return None
    draft_dir = resolve_draft(cfg.train.init_from, cfg)
    check_lineage(draft_dir, target, cfg.train.init_from)
    variant = json.loads((draft_dir / "config.json").read_text()).get("griffin", {}).get("variant")
    if variant != cfg.draft.variant:
        raise ValueError(f"train.init_from holds a {variant!r} draft but draft.variant={cfg.draft.variant!r}")
    return str(draft_dir)


def _check_store_layers(cfg: RunConfig, target, manifest: dict[str, Any]) -> None:
    """A multi-layer draft (EAGLE-3, GRIFFIN-3) trains only on a store holding exactly its layers."""
    wanted = draft_feature_layers(cfg, target)
    stored = manifest["capture_key"].get("feature_layers")
    if wanted and list(wanted) != stored:
        raise ValueError(
            f"draft.variant={cfg.draft.variant!r} reads target layers {list(wanted)}, but the feature store "
            f"{cfg.store_path} holds {stored or 'only the final feature'}; featurize into a new "
            f"features.store with features.layers={list(wanted)} (or 'auto')"
        )


def _stored_data(cfg: RunConfig, target) -> dict[str, Any]:
    """The feature store's sample ids, tokens and datasets, after checking it fits this target and draft."""
    weights = lambda: target.weights_sha256  # noqa: E731  (only for a store made before file digests)
    manifest = check_capture_key(cfg.store_path, target_fingerprint(target), cfg.data.max_len, weights)
    _check_store_layers(cfg, target, manifest)
    part_ids, layers = store_part_ids(cfg.store_path), bool(draft_feature_layers(cfg, target))
    sample_ids = [sid for ids in part_ids.values() for sid in ids]
    require_unique_ids(cfg.store_path, sample_ids)  # a repeated row would be trained on twice
    key, tokens = manifest["capture_key"], sum(f["tokens"] for f in manifest["files"])
    return {
        "sample_ids": sample_ids,
        "tokens": lambda: store_tokens(cfg.store_path),
        "inputs": lambda eval_ids: (
            stored_parts(part_ids, key["dtype"], layers, eval_ids, cfg.train.seed),
            stored_eval(part_ids, key["dtype"], layers, eval_ids),
        ),
        "mean_length": tokens / max(len(sample_ids), 1),
        "bytes": estimated_bytes(tokens, key["hidden_size"], key["dtype"], len(draft_feature_layers(cfg, target))),
        "sha256": reuse_key(manifest),
    }


def _online_data(cfg: RunConfig, target) -> dict[str, Any]:
    """The tokenized conversations' sample ids, tokens and datasets that featurize them as training
    reads them; the digest covers what a store's manifest would pin (capture key and sample ids)."""
    from pipeline.data.featurize import prepare_samples

    key, samples, _ = prepare_samples(cfg, target)
    if not samples:
        raise ValueError("train.features=online: no conversation of the data selection could be used")
    tokens, layers = sum(len(s.input_ids) for s in samples), len(key.get("feature_layers", ()))
    return {
        "sample_ids": [s.sample_id for s in samples],
        "tokens": lambda: ((s.sample_id, s.input_ids, s.loss_mask) for s in samples),
        "inputs": lambda eval_ids: online_parts(cfg, key, samples, eval_ids),
        "mean_length": tokens / len(samples),
        "bytes": estimated_bytes(tokens, key["hidden_size"], cfg.features.dtype, layers),
        "sha256": reuse_key({"capture_key": key, "sample_ids": sorted(s.sample_id for s in samples)}),
    }


def _inputs(cfg: RunConfig, data: dict[str, Any], eval_ids: set[str]) -> dict[str, Any]:
    """The stages' training parts and held-out dataset, materialized when ``train.materialize`` says so
    (``pipeline.train.inputs``), the online held-out rows always (their target actors then start once a
    run, not once a stage): built when the first stage to run starts, so that a rerun whose stages
    are all complete reads nothing."""
    # never workers waiting on feature actors or read tasks that cannot start: online on any cluster (after
    # its autoscaler had time), offline where Ray Train cannot grow it either (a local Ray)
    local = cluster_address(cfg) is None
    if cfg.train.features == "online" or local:
        check_stage_fits(cfg, 0.0 if local else ACTOR_START_S)
    parts, held_out = data["inputs"](eval_ids)
    hold = should_materialize(cfg.train.materialize, data["bytes"])
    if hold:
        logger.info("train: materializing the train and held-out rows (~%.1f MB) for every epoch", data["bytes"] / 1e6)
        parts = materialized_parts(parts)
    if held_out is not None and (hold or cfg.train.features == "online"):
        held_out = materialize(held_out)
    rows = len(data["sample_ids"]) - len(eval_ids)
    return {"parts": parts, "eval": held_out, "rows": rows, "mean_length": data["mean_length"]}


def _stage_datasets(cfg: RunConfig, inputs: dict[str, Any], start) -> dict[str, Any]:
    """The stage's ``train`` stream (its executions start where ``start``, the stage's ``StageChannel``, says)
    and the held-out dataset."""
    train = train_stream(inputs["parts"], start)
    return {"train": train, **({"eval": inputs["eval"]} if inputs["eval"] is not None else {})}


def _epochs_hint(cfg: RunConfig, stage: StageSection, inputs: dict[str, Any]) -> int:
    micro, world = cfg.train.method.grad_accum, cfg.train.num_workers
    return epochs_hint(stage.steps, micro, world, cfg.train.batch_tokens, inputs["rows"], inputs["mean_length"])


def run_train(cfg: RunConfig, stage: int | None = None) -> dict[str, Any]:
    """Train every stage of ``cfg.train.schedule`` (or only ``stage``), resuming where it stopped."""
    schedule = cfg.train.schedule
    if stage is not None and stage not in [s.stage for s in schedule]:
        raise ValueError(f"stage {stage} is not in train.schedule (stages: {[s.stage for s in schedule]})")
    ensure_ray(cfg)
    target = target_identity(cfg.target)  # config, tokenizer, shapes, fingerprint: no weights on the driver
    data = _online_data(cfg, target) if cfg.train.features == "online" else _stored_data(cfg, target)
    eval_ids = held_out_ids(data["sample_ids"], cfg.train.eval_fraction)
    d2t = None
    if cfg.draft.draft_vocab_size:
        d2t = reduced_vocabulary(
            data["tokens"](),
            cfg.draft.draft_vocab_size,
            target.vocab_size,
            eval_ids,
            reply_only=cfg.draft.vocab_from == "reply",
        ).tolist()
    context = {
        "inputs": None,  # built for the first stage that runs
        "provenance": {
            "store": cfg.store_path if cfg.train.features == "offline" else None,
            "features": cfg.train.features,
            "algorithm": "griffin",
            "variant": cfg.draft.variant,
            "target": target_fingerprint(target),
            "feature_manifest_sha256": data["sha256"],
            "resolved_config": cfg.resolved(),
        },
    }
    summaries, init_dir = [], _checked_init(cfg, target)
    for item in schedule:
        done = stage_dir(cfg, item.stage) / "_complete.json"
        if read_marker(done) is not None:
            say(f"[train] stage {item.stage} already complete: {done.parent / 'best'}")
        elif stage is None or item.stage == stage:
            context["inputs"] = context["inputs"] or _inputs(cfg, data, eval_ids)
            _run_stage(cfg, item, init_dir, d2t if init_dir is None else None, context)
        elif stage is not None and item.stage < stage:
            raise ValueError(
                f"stage {stage} starts from stage {item.stage}, which has not been trained yet; "
                f"run `griffin train` without --stage or with --stage {item.stage} first"
            )
        if (summary := read_marker(done)) is not None:
            summaries.append(summary)
            init_dir = str(done.parent / "best")
        if stage is not None and item.stage == stage:
            break
    if summaries and summaries[-1]["stage"] == schedule[-1].stage:
        final = cfg.run_dir / "train" / "best"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(summaries[-1]["best"], final)
    return {"stages": summaries, "best": str(cfg.run_dir / "train" / "best")}
