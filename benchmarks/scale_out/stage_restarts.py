"""What a training stage pays for its epochs, a worker's death and a resume, measured on a real stage.

The tiny target, ``train.features: online`` (the target actors featurize each part as training reads
it; ``train.materialize: false``, so the stream runs its actors for the whole stage), 2 workers, 1
feature actor, a stage long enough to read more than one epoch, a checkpoint every 4 steps. Run twice
on a local Ray: once undisturbed, once with a training worker killed (SIGKILL, no notice) after step 6,
which Ray Train restarts (``train.max_failures``). Counted from the Ray state API and the stages' own
audit files:

- target loads: the feature actors (``PartFeatures``, each loads the target) started for the stage;
- epochs read, from the "<epoch>:<sample id>"s each step trained on;
- steps lost to the kill: steps trained again after the restart (the audit logs every attempt);
- rows featurized again by the resume: the rows of the part the stream resumes in that come before its
  resume row (featurized with the part, then dropped), and the rows each rank skips in its first block.

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
KILL_AFTER_STEP = 6


def stage_config(out: Path, name: str):
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
            "train.eval_every=4",
            "train.max_failures=2",
            "train.method.warmup_steps=0",
            "train.schedule=[{stage: 1, steps: 16, lr: 0.002}]",
        ],
    )


def feature_actors() -> set[str]:
    from ray.util.state import list_actors

    return {
        a.actor_id for a in list_actors(limit=10_000, raise_on_missing_output=False) if "PartFeatures" in a.class_name
    }


def kill_a_worker_after(audit: Path, step: int, stop: threading.Event) -> dict:
    """Watch rank 0's audit; once it logs ``step``, SIGKILL the rank-1 training worker's process."""
    from ray.util.state import list_actors

    killed: dict = {}

    def watch() -> None:
        while not stop.is_set():
            steps = [json.loads(line)["step"] for line in audit.read_text().splitlines()] if audit.exists() else []
            if steps and steps[-1] >= step:
                workers = [a for a in list_actors(detail=True, limit=10_000) if "RayTrainWorker" in a.class_name]
                alive = sorted((a for a in workers if a.state == "ALIVE"), key=lambda a: a.pid)
                os.kill(alive[-1].pid, signal.SIGKILL)
                killed.update({"after_step": steps[-1], "pid": alive[-1].pid})
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def audit_steps(cfg) -> tuple[list[int], list[set[int]]]:
    """Rank 0's logged steps (every attempt's) and the epochs each step trained on."""
    from pipeline.train.driver import stage_dir

    records = [json.loads(line) for line in (stage_dir(cfg, 1) / "data_rank0.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [{int(s.split(":")[0]) for s in r["sample_ids"]} for r in records]


def resume_recomputed(cfg) -> dict:
    """Where the killed stage resumed (its checkpoint before the kill) and the rows it featurized or
    read again: the resume part's rows before the resume row, and the skipped rows of each rank."""
    import torch

    from pipeline.train.worker import TRAIN_STATE

    run = cfg.run_dir / "ray_train" / f"{cfg.run_name}-stage1"
    saved = sorted(p for p in run.glob("checkpoint_*") if (p / TRAIN_STATE).exists())
    states = [torch.load(p / TRAIN_STATE, weights_only=True) for p in saved]
    resumed = max((s for s in states if s["step"] <= KILL_AFTER_STEP), key=lambda s: s["step"])
    at = resumed["stream"]
    return {
        "from_step": resumed["step"],
        "position": at,
        "rows_before_resume_row": at["row"],
        "rows_skipped_per_rank": at["skip"],
        "rows_again": at["row"] + at["skip"] * resumed["world_size"],
    }


def run_stage(out: Path, name: str, kill: bool) -> dict:
    from pipeline.train.driver import run_train, stage_dir

    cfg = stage_config(out, name)
    before = feature_actors()
    stop, started = threading.Event(), time.perf_counter()
    killed = kill_a_worker_after(stage_dir(cfg, 1) / "data_rank0.jsonl", KILL_AFTER_STEP, stop) if kill else {}
    try:
        run_train(cfg)
    finally:
        stop.set()
    steps, epochs = audit_steps(cfg)
    replayed = len(steps) - len(set(steps))
    result = {
        "seconds": round(time.perf_counter() - started, 1),
        "target_loads": len(feature_actors() - before),
        "pool_size": cfg.features.num_actors,
        "epochs_read": sorted(set().union(*epochs)),
        "steps_logged": steps,
        "steps_lost": replayed,
        "checkpoint_every": cfg.train.checkpoint_every,
    }
    return result | ({"killed": killed, "resume": resume_recomputed(cfg)} if kill else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/stage-restarts")
    args = parser.parse_args()
    import shutil

    from pipeline.runtime import ensure_ray

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    ensure_ray(stage_config(out, "setup"))
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/scale_out/stage_restarts.py",
        "undisturbed": run_stage(out, "undisturbed", kill=False),
        "worker_killed": run_stage(out, "killed", kill=True),
    }
    (HERE / "stage_restarts.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
