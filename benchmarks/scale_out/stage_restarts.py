"""What a training stage pays for its epochs, a worker's death and a resume, measured on a real stage.

The tiny target, ``train.features: online`` (the target actors featurize each part as training reads
it; ``train.materialize: false``, so the stream runs its actors for the whole stage), 2 workers, 1
feature actor, a first stage long enough to read more than one epoch, a checkpoint every 4 steps. Run
twice on a local Ray: two stages undisturbed, then one stage with a training worker killed (SIGKILL, no
notice) after step 10, which Ray Train restarts (``train.max_failures``). Ray Train polls reports every
0.25 s here (2 s by default; a checkpoint counts once polled, and these steps take ~0.2 s). Counted
from the Ray state API and the stages' own audit files:

- target loads: the feature actors (``PartFeatures``, each loads the target) started: the held-out
  rows' pool once a run (they are featurized once and held), and the stream's pool once a stage;
- epochs read, from the "<epoch>:<sample id>"s each step trained on;
- steps lost to the kill: steps trained again after the restart (the audit logs every attempt);
- what the resume read again: the bytes of the rows each rank had trained on that reached it with their
  features in the restarted attempt (its audit's ``bytes_read_again``; the stream leaves those rows
  empty), beside the rows left unread: the resume part's rows before its resume row (not in the
  stream, never featurized) and the rows each rank skips.

Writes benchmarks/scale_out/stage_restarts.json (restart_cost.py reads it into restart_cost.json).

    python benchmarks/scale_out/stage_restarts.py [--out /tmp/stage-restarts]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KILL_AFTER_STEP = 10
POLL_S = (
    "0.25"  # Ray Train's report poll (2 s by default): a checkpoint counts once polled, and these steps take ~0.2 s
)


def stage_config(out: Path, name: str, schedule: str = "[{stage: 1, steps: 16, lr: 0.002}]"):
    from pipeline.config import load_config

    return load_config(
        ROOT / "jobs/configs/tiny.yaml",
        [
            f"output_dir={out}",
            f"run_name={name}",
            "data.limit=96",
            "train.features=online",
            "train.materialize=false",
            "train.num_workers=2",
            "features.num_actors=1",
            "train.batch_tokens=256",
            "train.checkpoint_every=4",
            "train.num_to_keep=10",  # every checkpoint stays: the one a restart resumed from is read back
            "train.eval_every=4",
            "train.max_failures=2",
            "train.method.warmup_steps=0",
            f"train.schedule={schedule}",
        ],
    )


def actors(**kwargs) -> list:
    """Every actor of this process's Ray, dead ones too (the State API of its own GCS)."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000, **kwargs)


def feature_actors() -> set[str]:
    return {a.actor_id for a in actors(raise_on_missing_output=False) if "PartFeatures" in a.class_name}


def kill_a_worker_after(audit: Path, step: int, stop: threading.Event) -> dict:
    """Watch rank 0's audit; once it logs ``step``, SIGKILL the rank-1 training worker's process."""
    killed: dict = {}

    def watch() -> None:
        while not stop.is_set():
            steps = [json.loads(line)["step"] for line in audit.read_text().splitlines()] if audit.exists() else []
            if steps and steps[-1] >= step:
                workers = [a for a in actors(detail=True) if "RayTrainWorker" in a.class_name]
                alive = sorted((a for a in workers if a.state == "ALIVE"), key=lambda a: a.pid)
                os.kill(alive[-1].pid, signal.SIGKILL)
                killed.update({"after_step": steps[-1], "pid": alive[-1].pid})
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def audit_records(cfg, stage: int, rank: int) -> list[dict]:
    """A rank's audit records of a stage (pipeline.train.worker._audit), every attempt's, in order."""
    from pipeline.train.driver import stage_dir

    return [json.loads(line) for line in (stage_dir(cfg, stage) / f"data_rank{rank}.jsonl").read_text().splitlines()]


def audit_steps(cfg, stage: int) -> tuple[list[int], list[set[int]]]:
    """Rank 0's logged steps (every attempt's) and the epochs each step trained on."""
    records = audit_records(cfg, stage, 0)
    return [r["step"] for r in records], [{int(s.split(":")[0]) for s in r["sample_ids"]} for r in records]


def resume_recomputed(cfg, steps: list[int]) -> dict:
    """Where the killed stage resumed (the checkpoint at the step before the restarted attempt's first)
    and the rows it featurized or read again: the resume part's rows before the resume row, and the
    skipped rows of each rank."""
    import torch

    from pipeline.train.worker import TRAIN_STATE

    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    from_step = steps[restart] - 1
    if from_step == 0:
        return {"from_step": 0, "bytes_read_again": None, "why": "no checkpoint had reached Ray Train: started over"}
    run = cfg.run_dir / "ray_train" / f"{cfg.run_name}-stage1"
    saved = [
        torch.load(p / TRAIN_STATE, weights_only=True) for p in run.glob("checkpoint_*") if (p / TRAIN_STATE).exists()
    ]
    resumed = next(s for s in saved if s["step"] == from_step)
    at = resumed["stream"]
    skips = at["skips"]  # rank 0 saves every rank's (pipeline.train.batches.ShardFeed.position)
    again = [audit_records(cfg, 1, rank)[-1]["bytes_read_again"] for rank in range(cfg.train.num_workers)]
    return {
        "from_step": from_step,
        "position": at,
        "rows_before_resume_row": at["row"],
        "rows_skipped_per_rank": skips,
        "rows_left_unread": at["row"] + sum(skips),
        "bytes_read_again_per_rank": again,
        "bytes_read_again": sum(again),
    }


def run_stages(out: Path, name: str, kill: bool, schedule: str) -> dict:
    from pipeline.train.driver import run_train, stage_dir

    cfg = stage_config(out, name, schedule)
    before = feature_actors()
    stop, started = threading.Event(), time.perf_counter()
    killed = kill_a_worker_after(stage_dir(cfg, 1) / "data_rank0.jsonl", KILL_AFTER_STEP, stop) if kill else {}
    try:
        run_train(cfg)
    finally:
        stop.set()
    steps, epochs = audit_steps(cfg, 1)
    result = {
        "seconds": round(time.perf_counter() - started, 1),
        "stages": len(cfg.train.schedule),
        "target_loads": len(feature_actors() - before),
        "pool_size": cfg.features.num_actors,
        "stage1_epochs_read": sorted(set().union(*epochs)),
        "stage1_steps_logged": steps,
        "steps_lost": len(steps) - len(set(steps)),
        "checkpoint_every": cfg.train.checkpoint_every,
    }
    return result | ({"killed": killed, "resume": resume_recomputed(cfg, steps)} if kill else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/stage-restarts")
    args = parser.parse_args()
    import shutil

    from pipeline.runtime import ensure_ray

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = POLL_S
    ensure_ray(stage_config(out, "setup"))
    two = "[{stage: 1, steps: 16, lr: 0.002}, {stage: 2, steps: 4, lr: 0.002}]"
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/scale_out/stage_restarts.py",
        "ray_train_poll_s": float(POLL_S),
        "undisturbed": run_stages(out, "undisturbed", kill=False, schedule=two),
        "worker_killed": run_stages(out, "killed", kill=True, schedule="[{stage: 1, steps: 16, lr: 0.002}]"),
    }
    (HERE / "stage_restarts.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
