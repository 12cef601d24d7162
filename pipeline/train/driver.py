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

import gc
import hashlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.config import DraftConfig, StagePlan
from griffin.model import GriffinDraft
from griffin.target import fast_bf16, release_freed_memory
from griffin.training import (
    acceptance_counts,
    acceptance_metrics,
    make_optimizer,
    make_scheduler,
    teacher_ids,
    train_step,
)
from griffin.checkpoint import load_draft, save_draft, tensors_sha256
from pipeline.config import RunConfig, StageSection, config_from_dict
from pipeline.console import Progress, say
from pipeline.runtime import ensure_ray, setup_mlflow
from pipeline.data.store import check_capture_key, part_files
from pipeline.resources.drafts import check_lineage, resolve_draft
from pipeline.resources.targets import draft_feature_layers, load_target, target_fingerprint
from pipeline.train.batches import eval_split, rank_rows, reduced_vocabulary, shifted_batches, split_rows

SCORE = "eval/sim_accept_len"


def stage_dir(cfg: RunConfig, stage: int) -> Path:
    return cfg.run_dir / "train" / f"stage{stage}"


def stage_plan(cfg: RunConfig, stage: StageSection) -> StagePlan:
    """What one stage runs per step: passes from the stage number, the loss and mask set from the
    variant, the LR from the schedule, and an LR decay that spans the stage unless pinned."""
    return StagePlan.for_stage(stage.stage, cfg.draft.variant, stage.steps, stage.lr, cfg.train.method.total_steps)


# ---------------------------------------------------------------- worker side -------------
def _init_draft(cfg: RunConfig, target, init_dir: str | None, d2t: list[int] | None) -> GriffinDraft:
    if init_dir:
        return load_draft(init_dir, target, dtype=torch.float32)  # fp32 master weights
    torch.manual_seed(cfg.train.seed)  # identical init on every rank
    d2t_tensor = torch.tensor(d2t) if d2t else None
    draft = GriffinDraft.for_target(target, variant=cfg.draft.variant, d2t=d2t_tensor, **cfg.draft.overrides)
    if cfg.draft.init_layer is not None:
        draft.start_from_target_layer(target.backbone.layers[cfg.draft.init_layer])
    return draft.cast_parameters(torch.float32)  # fp32 master weights; frozen target tensors stay


def _worker_draft(cfg: RunConfig, init_dir: str | None, d2t: list[int] | None, device) -> tuple[GriffinDraft, Tensor]:
    """A worker's draft on ``device`` and the target's full LM head there (V_target, D), the teacher of
    the held-out score. The target only lends the draft its frozen embedding and head (and
    ``draft.init_layer`` a layer), so it is loaded on the CPU (in the dtype resolved for
    ``target.device``) and dropped: a worker keeps those tensors, not the whole target
    (benchmarks/training/train_memory.md), and its GPU never holds the target."""
    target = load_target(cfg.target, device="cpu")
    draft = _init_draft(cfg, target, init_dir, d2t)
    tied = draft.embed_weight.data_ptr() == draft.head_weight.data_ptr()  # a tied target's one tensor
    draft = draft.to(device)
    if tied:  # .to copies each buffer: keep one copy on the device, as on the host
        draft.head_weight = draft.embed_weight
    # without a reduced vocabulary the draft's frozen head is the target's whole head already
    target_head = draft.head_weight if draft.d2t is None else target.head_weight.to(device)
    del target
    gc.collect()  # reference cycles, if any, must not hold the target's layers until a later collection
    release_freed_memory()
    return draft, target_head


def _save_checkpoint(directory: Path, draft, optimizer, scheduler, step, rows, rank, provenance) -> None:
    if rank == 0:
        save_draft(draft, directory / "draft", provenance)
    weights = tensors_sha256(dict(draft.named_parameters()))  # ranks must agree (DDP)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "rows_consumed": rows,
            "rng": torch.get_rng_state(),
            "weights_sha256": weights,
        },
        directory / f"train_state_rank{rank}.pt",
    )


def _restore(checkpoint, draft, optimizer, scheduler, rank) -> tuple[int, int]:
    if checkpoint is None:
        return 0, 0
    from safetensors.torch import load_file

    with checkpoint.as_directory() as directory:
        draft.load_state_dict(load_file(Path(directory) / "draft" / "model.safetensors"), strict=True)
        state = torch.load(Path(directory) / f"train_state_rank{rank}.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["rows_consumed"]


def _eval_set(draft, eval_rows: list[dict], cfg: RunConfig, target_head, bf16: bool) -> list[tuple]:
    """The held-out batches with the target's greedy ids on them, built once per worker: the teacher
    is a (T, V_target) head matmul per batch that never changes between evaluations. Chains start
    where a decode's do (the "draft" window), whatever window training uses, so that drafts trained
    either way are scored alike."""
    batches = [
        batch
        for batch, _ in shifted_batches(
            iter(eval_rows),
            cfg.train.batch_tokens,
            draft.cfg.hidden_size,
            target_head.device,
            "draft",
            bool(draft.cfg.feature_layers),
        )
    ]
    return [(batch, teacher_ids(draft, batch, target_head, bf16)) for batch in batches]


def _evaluate(draft, eval_set: list[tuple], cfg: RunConfig, world: int, bf16: bool) -> dict[str, float]:
    """eval/acc_k and eval/sim_accept_len on the held-out rows, in the training precision."""
    counts = torch.zeros(2, cfg.train.eval_steps, dtype=torch.float64)
    for batch, teacher in eval_set:
        counts += acceptance_counts(draft, batch, cfg.train.eval_steps, bf16=bf16, teacher=teacher)
    if world > 1:
        torch.distributed.all_reduce(counts)
    return acceptance_metrics(counts)


def train_worker(config: dict[str, Any]) -> None:
    import ray
    import ray.train
    import ray.train.torch
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    cfg, stage = config_from_dict(config["run"]), StageSection(**config["stage"])
    method, plan = cfg.train.method, StagePlan(**config["plan"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    draft, target_head = _worker_draft(cfg, config["init_dir"], config["d2t"], device)
    model = ray.train.torch.prepare_model(draft, parallel_strategy_kwargs={"broadcast_buffers": False})
    optimizer = make_optimizer(draft, method, plan)
    scheduler = make_scheduler(optimizer, method, plan)
    step, rows_consumed = _restore(ray.train.get_checkpoint(), draft, optimizer, scheduler, rank)
    files, eval_ids = config["files"], set(config["eval_ids"])
    layers = bool(draft.cfg.feature_layers)  # a multi-layer draft reads the store's feature layers
    rows = rank_rows(files, eval_ids, rank, world, cfg.train.seed, rows_consumed, layers)
    batches = shifted_batches(rows, cfg.train.batch_tokens, draft.cfg.hidden_size, device, method.loss_window, layers)
    eval_rows = [r for i, r in enumerate(split_rows(files, eval_ids, keep=True, layers=layers)) if i % world == rank]
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and fast_bf16(device))
    eval_set = _eval_set(draft, eval_rows, cfg, target_head, bf16)
    client = MlflowClient(cfg.tracking_uri) if rank == 0 else None
    fail_marker = Path(config["stage_dir"]) / "_injected_failure"
    started, tokens_done, first_step = time.time(), 0.0, step

    while step < stage.steps:
        micro, ids = zip(*[next(batches) for _ in range(method.grad_accum)])
        generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + step * world + rank)
        metrics = train_step(model, draft, micro, optimizer, scheduler, method, plan, bf16, generator, target_head)
        step += 1
        rows_consumed += sum(len(x) for x in ids)
        tokens_done += metrics["tokens"] * world
        with open(Path(config["stage_dir"]) / f"data_rank{rank}.jsonl", "a") as log:  # data audit trail
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "node": ray.get_runtime_context().get_node_id(),
                        "sample_ids": [s for batch in ids for s in batch],
                    }
                )
                + "\n"
            )
        if cfg.train.debug_fail_at_step == step and not fail_marker.exists():
            fail_marker.touch()
            raise RuntimeError(f"injected failure at step {step} (train.debug_fail_at_step)")
        report = {f"train/{k}": v for k, v in metrics.items()}
        do_ckpt = step % cfg.train.checkpoint_every == 0 or step == stage.steps
        if do_ckpt or step % cfg.train.eval_every == 0:
            report.update(_evaluate(draft, eval_set, cfg, world, bf16))
        if rank == 0:
            elapsed = time.time() - started
            rate = tokens_done / max(elapsed, 1e-9)
            eta = elapsed / (step - first_step) * (stage.steps - step)
            print(
                f"[train stage {stage.stage}] step {step}/{stage.steps} loss {metrics['loss']:.4f} "
                f"tok/s {rate:.0f} eta {eta:.0f}s" + (f" {SCORE} {report[SCORE]:.3f}" if SCORE in report else ""),
                flush=True,
            )
            _write_progress(Path(config["stage_dir"]), step, metrics["loss"], report.get(SCORE))
            client.log_batch(
                config["mlflow_run_id"],
                metrics=[Metric(k, float(v), int(time.time() * 1000), step) for k, v in report.items()],
            )
        if do_ckpt:
            with tempfile.TemporaryDirectory() as tmp:
                provenance = {**config["provenance"], "step": step, "metrics": report}
                _save_checkpoint(Path(tmp), draft, optimizer, scheduler, step, rows_consumed, rank, provenance)
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        elif SCORE in report:
            ray.train.report(report)


def _write_progress(out: Path, step: int, loss: float, score: float | None) -> None:
    """Where the stage is, for the driver's console line (atomic: the driver reads it any time)."""
    previous = _read_progress(out)
    record = {"step": step, "loss": loss, "score": score if score is not None else previous.get("score")}
    tmp = out / ".progress.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / "progress.json")


def _read_progress(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@contextmanager
def _console_progress(out: Path, stage: StageSection, stages: list[int]) -> Iterator[Progress]:
    """While ``fit`` runs: the stage's console line, fed from the progress file rank 0 writes.
    "stage 2/3" for a schedule of stages 1..3; "stage 3" for a schedule that is not (a fine-tune)."""
    of = f"/{len(stages)}" if stages == list(range(1, len(stages) + 1)) else ""
    progress = Progress(
        f"train stage {stage.stage}{of}", stage.steps, "steps", initial=_read_progress(out).get("step", 0)
    )  # a resumed stage starts near there
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(2.0):
            state = _read_progress(out)
            if state:
                score = f"  held-out {state['score']:.3f}" if state.get("score") is not None else ""
                progress.update(state["step"], f"loss {state['loss']:.3f}{score}")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield progress
    finally:
        stop.set()
        watcher.join()


# ---------------------------------------------------------------- driver side -------------
def _run_stage(cfg: RunConfig, stage: StageSection, init_dir: str | None, d2t, context: dict[str, Any]) -> Path:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = stage_dir(cfg, stage.stage)
    out.mkdir(parents=True, exist_ok=True)
    mlflow = setup_mlflow(cfg)
    plan = stage_plan(cfg, stage)
    run_id_file = out / "mlflow_run_id"
    if not _run_exists(mlflow, run_id_file):  # reuse the MLflow run when an interrupted stage resumes
        with mlflow.start_run(run_name=f"{cfg.run_name}-stage{stage.stage}") as run:
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
            run_id_file.write_text(run.info.run_id)
    run_id = run_id_file.read_text().strip()
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "run": cfg.resolved(),
            "stage": stage.model_dump(),
            "plan": plan.model_dump(mode="json"),
            "init_dir": init_dir,
            "d2t": d2t,
            "files": part_files(cfg.store_path),
            "eval_ids": sorted(context["eval_ids"]),
            "mlflow_run_id": run_id,
            "stage_dir": str(out.resolve()),
            "provenance": {
                **context["provenance"],
                "stage": stage.stage,
                "train_run_id": run_id,
                "init_from": init_dir,
            },
        },
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
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
        ),
    )
    with _console_progress(out, stage, [s.stage for s in cfg.train.schedule]) as progress:
        result = trainer.fit()
    best_checkpoint, best_metrics = max(result.best_checkpoints, key=lambda item: item[1][SCORE])
    progress.update(stage.steps)
    progress.close(f"best held-out {SCORE.split('/')[-1]} {best_metrics[SCORE]:.3f}")
    with best_checkpoint.as_directory() as directory:
        shutil.rmtree(out / "best", ignore_errors=True)
        shutil.copytree(Path(directory) / "draft", out / "best")
    _log_curves(mlflow, run_id, out)
    summary = {"stage": stage.stage, "best_metrics": best_metrics, "mlflow_run_id": run_id, "best": str(out / "best")}
    (out / "_complete.json").write_text(json.dumps(summary, indent=2, default=str))
    return out / "best"


def _run_exists(mlflow, run_id_file: Path) -> bool:
    if not run_id_file.exists():
        return False
    try:
        mlflow.tracking.MlflowClient().get_run(run_id_file.read_text().strip())
        return True
    except mlflow.exceptions.MlflowException:  # recorded in another tracking store
        return False


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


def run_train(cfg: RunConfig, stage: int | None = None) -> dict[str, Any]:
    """Train every stage of ``cfg.train.schedule`` (or only ``stage``), resuming where it stopped."""
    schedule = cfg.train.schedule
    if stage is not None and stage not in [s.stage for s in schedule]:
        raise ValueError(f"stage {stage} is not in train.schedule (stages: {[s.stage for s in schedule]})")
    ensure_ray(cfg)
    target = load_target(cfg.target)
    manifest = check_capture_key(cfg.store_path, target_fingerprint(target), cfg.data.max_len)
    _check_store_layers(cfg, target, manifest)
    manifest_sha = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()
    eval_ids = eval_split(cfg.store_path, cfg.train.eval_fraction)
    d2t = None
    if cfg.draft.draft_vocab_size:
        d2t = reduced_vocabulary(
            cfg.store_path,
            cfg.draft.draft_vocab_size,
            target.vocab_size,
            eval_ids,
            reply_only=cfg.draft.vocab_from == "reply",
        ).tolist()
    context = {
        "eval_ids": eval_ids,
        "provenance": {
            "store": cfg.store_path,
            "algorithm": "griffin",
            "variant": cfg.draft.variant,
            "target": target_fingerprint(target),
            "feature_manifest_sha256": manifest_sha,
            "resolved_config": cfg.resolved(),
        },
    }
    summaries, init_dir = [], _checked_init(cfg, target)
    for item in schedule:
        done = stage_dir(cfg, item.stage) / "_complete.json"
        if done.exists():
            say(f"[train] stage {item.stage} already complete: {done.parent / 'best'}")
        elif stage is None or item.stage == stage:
            _run_stage(cfg, item, init_dir, d2t if init_dir is None else None, context)
        elif stage is not None and item.stage < stage:
            raise ValueError(
                f"stage {stage} starts from stage {item.stage}, which has not been trained yet; "
                f"run `griffin train` without --stage or with --stage {item.stage} first"
            )
        if done.exists():
            summaries.append(json.loads(done.read_text()))
            init_dir = str(done.parent / "best")
        if stage is not None and item.stage == stage:
            break
    if summaries and summaries[-1]["stage"] == schedule[-1].stage:
        final = cfg.run_dir / "train" / "best"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(summaries[-1]["best"], final)
    return {"stages": summaries, "best": str(cfg.run_dir / "train" / "best")}
