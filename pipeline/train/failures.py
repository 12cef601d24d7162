"""Bounded retries for real crashes while preemptions retry without limit (``train.max_same_failures``).

Ray Train 2.60 counts node preemptions apart from other failures (``FailureConfig.max_preemption_failures``,
-1: always recover) and offers no hook to judge the rest: its failure policy is not pluggable. A node
lost without a drain notice reads as an ordinary worker death, so a preemptible cluster runs with
``train.max_failures: -1``, and a deterministic bug would then restart forever. This module bounds that
from inside the workers: a worker whose loop raises records the exception's signature (type and the
innermost frame, not the message, whose numbers vary) with the last checkpoint step in the stage's
ledger file before raising. The same signature at the same checkpoint N times in a row, no progress
saved between, and the next attempt's workers refuse to train: they return at once, and the driver
raises with the recorded error. A death that kills the process (preemption, OOM killer) records
nothing and breaks no streak; a checkpoint taken between two crashes starts the count again.

One record per attempt: the first rank to raise writes it and the collateral errors of the others
(collective aborts when a peer died) are ignored, so a 2-worker group counts one failure, not two.
The ledger lives in the stage directory, beside the checkpoints, on the storage every rank shares.
"""

from __future__ import annotations

import fcntl
import json
import traceback
import uuid
from pathlib import Path
from typing import Any

from pipeline.files import atomic_write_json

LEDGER = "_failures.json"


def signature(error: BaseException) -> str:
    """Type and where it was raised: stable across attempts when the bug is the same."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(error).__module__}.{type(error).__qualname__}{where}"


def read(stage_dir: str | Path) -> dict[str, Any] | None:
    path = Path(stage_dir) / LEDGER
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or cut short by a killed writer
        return None


def clear(stage_dir: str | Path) -> None:
    """A new ``griffin train`` starts the count afresh: someone decided to try again."""
    (Path(stage_dir) / LEDGER).unlink(missing_ok=True)


def exhausted(stage_dir: str | Path, limit: int | None) -> dict[str, Any] | None:
    """The ledger's record when it holds ``limit`` identical failures in a row (None: train on)."""
    record = read(stage_dir)
    return record if limit and record and record["count"] >= limit else None


def start_attempt(stage_dir: str | Path, rank: int, limit: int | None) -> tuple[str, dict[str, Any] | None]:
    """(this attempt's id, the record that ends the run or None), the same on every rank: rank 0
    decides and broadcasts, so no rank trains while another gives up."""
    from ray.train.collective import broadcast_from_rank_zero

    mine = (uuid.uuid4().hex, exhausted(stage_dir, limit)) if rank == 0 else None
    return tuple(broadcast_from_rank_zero(mine))


def record(stage_dir: str | Path, attempt: str, error: BaseException, checkpoint_step: int) -> dict[str, Any]:
    """Count ``error`` in the ledger (see the module docstring); returns the ledger's record."""
    stage_dir = Path(stage_dir)
    with open(stage_dir / f"{LEDGER}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one attempt may raise at once
        previous = read(stage_dir)
        if previous and previous["attempt"] == attempt:
            return previous  # a peer's collateral error: this attempt is counted already
        sig = signature(error)
        same = previous and previous["signature"] == sig and previous["checkpoint_step"] == checkpoint_step
        entry = {
            "attempt": attempt,
            "signature": sig,
            "message": f"{type(error).__name__}: {error}"[:2000],
            "checkpoint_step": checkpoint_step,
            "count": previous["count"] + 1 if same else 1,
        }
        atomic_write_json(stage_dir / LEDGER, entry)  # whole or absent, whatever kills the writer
        return entry


def injected(marker: Path, times: int) -> bool:
    """``train.debug_fail_at_step``'s testing hook: True on the first ``times`` arrivals at the step,
    counted in ``marker`` so that restarted workers see the earlier injections."""
    done = int(marker.read_text() or 0) if marker.exists() else 0
    if done >= times:
        return False
    marker.write_text(str(done + 1))
    return True
