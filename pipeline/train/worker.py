"""The Ray Train worker loop (docs/method.md §3): ``train_worker`` gets the stage's ``StageJob``,
resumes via ``ray.train.get_checkpoint()``, reads its shard of the stage's datasets
(``pipeline.train.batches.ShardFeed``), steps with ``griffin.training.train_step``, evaluates the
held-out score, and reports through ``ray.train.report``. Rank 0 writes the checkpoint's draft,
optimizer and scheduler (identical on every rank under DDP) and every rank's data position; the other
ranks add only their RNG state. Rank 0 also logs to MLflow and pushes each step to the driver's ``StageChannel``
actor, which feeds the console line.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from griffin.checkpoint import load_draft, save_draft, tensors_sha256
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
from pipeline.config import RunConfig
from pipeline.resources.targets import load_target_parts
from pipeline.data.store import table_rows
from pipeline.train import failures
from pipeline.train.batches import Prefetch, ShardFeed, shifted_batches
from pipeline.train.preemption import PreemptionWatch
from pipeline.train.job import StageJob
from pipeline.train.stream import first_start

SCORE = "eval/sim_accept_len"


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
    ``draft.init_layer`` a layer): those are all a worker reads of it, by name from its weight files
    (pipeline.resources.targets.load_target_parts), in the dtype resolved for ``target.device``."""
    target = load_target_parts(cfg.target, device="cpu", layer=cfg.draft.init_layer)
    draft = _init_draft(cfg, target, init_dir, d2t)
    tied = draft.embed_weight.data_ptr() == draft.head_weight.data_ptr()  # a tied target's one tensor
    draft = draft.to(device)
    if tied:  # .to copies each buffer: keep one copy on the device, as on the host
        draft.head_weight = draft.embed_weight
    # without a reduced vocabulary the draft's frozen head is the target's whole head already
    target_head = draft.head_weight if draft.d2t is None else target.head_weight.to(device)
    del target
    gc.collect()  # reference cycles, if any, must not hold the parts' layer until a later collection
    release_freed_memory()
    return draft, target_head


TRAIN_STATE = "train_state.pt"  # rank 0: optimizer, scheduler, step, data position


def rng_state_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _save_checkpoint(directory: Path, draft, optimizer, scheduler, step, batches: Prefetch, rank, provenance) -> None:
    """Rank 0 writes what every rank holds alike (DDP): the draft, optimizer and scheduler state, the
    step, and the data position (every rank's, gathered: ranks take rows at their own pace), with the
    world size it holds for. Every rank adds its own RNG state, with its weights' hash to show that the
    ranks agree."""
    weights = tensors_sha256(dict(draft.named_parameters()))
    stream = batches.position()  # a collective: every rank
    if rank == 0:
        save_draft(draft, directory / "draft", provenance)
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
        torch.save({**state, "stream": stream, "world_size": batches.feed.world}, directory / TRAIN_STATE)
    torch.save({"rng": torch.get_rng_state(), "weights_sha256": weights}, directory / rng_state_name(rank))


def _restore(checkpoint, draft, optimizer, scheduler, rank) -> tuple[int, dict[str, Any] | None]:
    """Load the latest checkpoint into this rank; (step, where the stream resumes), (0, None) without one."""
    if checkpoint is None:
        return 0, None
    from safetensors.torch import load_file

    with checkpoint.as_directory() as directory:
        draft.load_state_dict(load_file(Path(directory) / "draft" / "model.safetensors"), strict=True)
        state = torch.load(Path(directory) / TRAIN_STATE, weights_only=True)
        rng = torch.load(Path(directory) / rng_state_name(rank), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(rng["rng"])
    return state["step"], state["stream"]


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


def ranks_mean(world: int):
    """The mean of a count over the ``world`` ranks (one scalar all-reduce), or None on one rank: the
    loss's denominator, so that every masked position of a step weighs the same on every rank."""
    if world == 1:
        return None

    def mean(count: Tensor) -> Tensor:
        total = count.detach().float().clone()
        torch.distributed.all_reduce(total)
        return total / world

    return mean


def _eval_rows(job: StageJob) -> list[dict]:
    """This rank's share of the held-out rows (none when the run holds none out)."""
    import ray.train

    if not job.has_eval:
        return []
    tables = ray.train.get_dataset_shard("eval").iter_batches(batch_size=None, batch_format="pyarrow")
    return [row for table in tables for row in table_rows(table)]


def _evaluate(draft, eval_set: list[tuple], cfg: RunConfig, world: int, bf16: bool) -> dict[str, float]:
    """eval/acc_k and eval/sim_accept_len on the held-out rows, in the training precision."""
    counts = torch.zeros(2, cfg.train.eval_steps, dtype=torch.float64)
    for batch, teacher in eval_set:
        counts += acceptance_counts(draft, batch, cfg.train.eval_steps, bf16=bf16, teacher=teacher)
    if world > 1:
        torch.distributed.all_reduce(counts)
    return acceptance_metrics(counts)


def _audit(stage_dir: Path, rank: int, step: int, ids: list[list[str]], feed: ShardFeed) -> None:
    """The data audit trail: which samples each rank trained on at each step, on which node, the bytes
    of the blocks it has read so far in this attempt (and of the rows in them it had trained on before
    a resume: none come with their features), and the rows and bytes of each epoch it read to the end."""
    import ray

    record = {
        "step": step,
        "node": ray.get_runtime_context().get_node_id(),
        "sample_ids": [s for b in ids for s in b],
        "bytes_read": sum(feed.block_bytes),
        "bytes_read_again": feed.read_again,
        "epochs_read": feed.finished,
    }
    with open(stage_dir / f"data_rank{rank}.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")


def _report_rank0(
    job: StageJob,
    client: Any,
    step: int,
    report: dict[str, float],
    rate: float,
    eta: float,
) -> None:
    """Rank 0's step report: a log line, the driver's console line (``StageChannel``) and MLflow."""
    from mlflow.entities import Metric

    stage = job.stage
    score = f" {SCORE} {report[SCORE]:.3f}" if SCORE in report else ""
    loss = report["train/loss"]
    # to the process's own stdout: Ray Train's print patch both logs a print to stdout and, when
    # anything has wrapped sys.stdout, echoes it, so a plain print reached the console twice
    print(
        f"[train stage {stage.stage}] step {step}/{stage.steps} loss {loss:.4f} tok/s {rate:.0f} eta {eta:.0f}s"
        + score,
        file=sys.__stdout__,
        flush=True,
    )
    job.channel.update.remote(step, loss, report.get(SCORE))
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, step) for k, v in report.items()]
    client.log_batch(job.mlflow_run_id, metrics=metrics, synchronous=False)  # off the step's critical path


@contextmanager
def _rank0_tracking(cfg: RunConfig, run_id: str, rank: int) -> Iterator[Any]:
    """Rank 0's MLflow client for the stage's run (None on other ranks), with the node's system metrics
    (``system/rank0/*``) sampled into that run meanwhile; queued metrics are flushed on the way out.
    The URI is the driver's (``cfg.tracking_uri``), never this worker's environment."""
    if rank != 0:
        yield None
        return
    import mlflow
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    from mlflow.tracking import MlflowClient

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=10, resume_logging=True, node_id="rank0", tracking_uri=cfg.tracking_uri
    )
    monitor.start()
    try:
        yield MlflowClient(cfg.tracking_uri)
    finally:
        monitor.finish()
        mlflow.set_tracking_uri(cfg.tracking_uri)  # MLflow keeps one store per URI: this flushes the client's queue
        mlflow.flush_async_logging()


def train_worker(config: dict[str, StageJob]) -> None:
    import ray.train

    job = config["job"]
    cfg, stage_dir = job.run, job.stage_dir
    rank = ray.train.get_context().get_world_rank()
    attempt, given_up = failures.start_attempt(stage_dir, rank, cfg.train.max_same_failures)
    if given_up:  # returning ends the run (raising would be retried); the driver reports why
        print(f"[train] rank {rank}: not starting: {given_up['count']} identical failures: {given_up['message']}")
        return
    at = {"checkpoint_step": 0}  # the last step saved: a failure after a newer one is not "the same" again
    with _rank0_tracking(cfg, job.mlflow_run_id, rank) as client:
        try:
            _train(job, client, at)
        except Exception as error:
            failures.record(stage_dir, attempt, error, at["checkpoint_step"])
            raise


def _train(job: StageJob, client: Any, at: dict[str, int]) -> None:
    import ray
    import ray.train
    import ray.train.torch

    cfg, stage, plan = job.run, job.stage, job.plan
    method = cfg.train.method
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    draft, target_head = _worker_draft(cfg, job.init_dir, job.d2t, device)
    model = ray.train.torch.prepare_model(draft, parallel_strategy_kwargs={"broadcast_buffers": False})
    optimizer = make_optimizer(draft, method, plan)
    scheduler = make_scheduler(optimizer, method, plan)
    step, position = _restore(ray.train.get_checkpoint(), draft, optimizer, scheduler, rank)
    at["checkpoint_step"] = step
    layers = bool(draft.cfg.feature_layers)  # a multi-layer draft reads the store's feature layers
    shard, epochs = ray.train.get_dataset_shard("train"), job.epochs_hint
    start = position or first_start(0, epochs)
    feed = ShardFeed(shard, rank, world, device, cfg.train, job.channel, start, epochs)
    batches = Prefetch(feed, draft.cfg.hidden_size, method.loss_window, layers, stage.steps - step, method.grad_accum)
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and fast_bf16(device))
    eval_set = _eval_set(draft, _eval_rows(job), cfg, target_head, bf16)
    fail_marker = job.stage_dir / "_injected_failure"
    preemption = PreemptionWatch(cfg.train.preemption_check_every, cfg.train.debug_drain_at_step, rank)
    started, tokens_done, first_step = time.time(), 0.0, step

    while step < stage.steps:
        micro, ids = batches.next()
        generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + step * world + rank)
        metrics = train_step(
            model, draft, micro, optimizer, scheduler, method, plan, bf16, generator, target_head, ranks_mean(world)
        )
        step += 1
        tokens_done += metrics["tokens"] * world
        _audit(job.stage_dir, rank, step, ids, feed)
        if cfg.train.debug_fail_at_step == step and failures.injected(fail_marker, cfg.train.debug_fail_times):
            raise RuntimeError(f"injected failure at step {step} (train.debug_fail_at_step)")
        report = {f"train/{k}": v for k, v in metrics.items()}
        notice = preemption.due(step)  # a node of this group is about to go: save now (pipeline.train.preemption)
        do_ckpt = step % cfg.train.checkpoint_every == 0 or step == stage.steps or notice is not None
        if do_ckpt or step % cfg.train.eval_every == 0:
            report.update(_evaluate(draft, eval_set, cfg, world, bf16))
        if rank == 0:
            rate = tokens_done / max(time.time() - started, 1e-9)
            eta = (time.time() - started) / (step - first_step) * (stage.steps - step)
            _report_rank0(job, client, step, report, rate, eta)
            if notice is not None:
                print(
                    f"[train stage {stage.stage}] preemption notice ({notice}): checkpoint at step {step}", flush=True
                )
        if do_ckpt:
            with tempfile.TemporaryDirectory() as tmp:
                provenance = {**job.provenance, "step": step, "metrics": report}
                _save_checkpoint(Path(tmp), draft, optimizer, scheduler, step, batches, rank, provenance)
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            at["checkpoint_step"] = step
        elif SCORE in report:
            ray.train.report(report)
    batches.close()  # on a failure the worker's process goes, and its thread with it
