"""What the driver hands every worker of a training stage (``StageJob``), typed on both sides of the Ray
hop. Light on purpose: whatever unpickles it (Ray Train's controller, each worker) imports this module,
and nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from griffin.config import StagePlan
from pipeline.config import RunConfig, StageSection


@dataclass(frozen=True)
class StageJob:
    """What the driver hands every worker of a stage, typed on both sides of the Ray hop (pickled, as
    ``train_loop_config["job"]``): the run's config with the URIs the driver resolved, never re-read
    from a worker's environment."""

    run: RunConfig
    stage: StageSection
    plan: StagePlan
    init_dir: str | None  # the draft the stage starts from (None: a fresh draft)
    d2t: list[int] | None  # the reduced vocabulary: draft id -> target id (None: the target's own)
    has_eval: bool  # the run holds rows out: the "eval" dataset exists
    epochs_hint: int  # the epochs one stream execution is sized for (pipeline.train.stream)
    mlflow_run_id: str
    stage_dir: Path
    provenance: dict[str, Any]  # recorded with every checkpoint's draft
    channel: Any = None  # the stage's StageChannel actor (pipeline.train.channel)
