"""End to end on the tiny target: `griffin run` killed during training, and rerun to the weights of an
uninterrupted training."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.train.driver import run_train
from tests.conftest import assert_same_train_state, last_checkpoint
from tests.test_e2e import GRIFFIN, REPO, griffin, overrides


def trained_by_step(run_dir: Path) -> dict[tuple[int, int], list[str]]:
    """(rank, step) -> the sample ids trained on; a step replayed after a resume keeps its last record."""
    logs = sorted((run_dir / "train" / "stage1").glob("data_rank*.jsonl"))
    return {(rank, r["step"]): r["sample_ids"] for rank, f in enumerate(logs) for r in map(json.loads, f.open())}


@pytest.mark.timeout(900)
def test_interrupted_run_resumes_to_the_uninterrupted_runs_weights(tmp_path, ray_local):
    """Kill `griffin run` once training has checkpointed; the rerun finishes from that checkpoint and
    ends where an uninterrupted training on the same features ends: the same sample ids at every
    step on every rank, and at the last step bit-identical weights, optimizer and data position."""
    schedule = ["train.schedule=[{stage: 1, steps: 8, lr: 0.003}]", "train.checkpoint_every=2", "train.eval_every=2"]
    args = [
        "run",
        "-c",
        "jobs/configs/tiny.yaml",
        *overrides(tmp_path, "kill"),
        *schedule,
        "eval.through_serve=false",
        "eval.num_questions=1",
        "eval.max_new_tokens=4",
    ]  # Serve: the other test
    # the killed run's Ray Train polls at its default 2 s (conftest sets 0.25 s): a report waits for the
    # previous one to be polled, which paces its tiny steps so that the kill lands mid-stage (a report
    # every 2 steps: the step after the next report is ~2 s after the first checkpoint is recorded)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2",
    }
    proc = subprocess.Popen(
        [*GRIFFIN, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # kill once Ray Train has recorded a checkpoint (its manager snapshot lists it): a checkpoint
    # folder alone is not yet one that a rerun restores
    snapshot = tmp_path / "kill" / "ray_train" / "kill-stage1" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 400
    while time.time() < deadline and "checkpoint_" not in (snapshot.read_text() if snapshot.is_file() else ""):
        time.sleep(0.05)
    assert proc.poll() is None, "griffin run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log = tmp_path / "kill" / "train" / "stage1" / "data_rank0.jsonl"
    steps_before = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    assert 2 <= max(steps_before) < 8

    rerun = griffin(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    resumed = steps[len(steps_before) :]
    assert resumed[0] > 1 and resumed[-1] == 8  # continued from a checkpoint, not from step 1

    # the reference: the same training on the same features, uninterrupted (on the suite's Ray)
    store = tmp_path / "kill" / "features"  # complete before the kill
    run_train(
        load_config(
            REPO / "jobs/configs/tiny.yaml", [*overrides(tmp_path, "ref"), *schedule, f"features.store={store}"]
        )
    )
    trained, expected = trained_by_step(tmp_path / "kill"), trained_by_step(tmp_path / "ref")
    assert trained == expected and len(expected) >= 8
    assert_same_train_state(
        last_checkpoint(tmp_path / "kill", "kill", 1), last_checkpoint(tmp_path / "ref", "ref", 1), world=1
    )
