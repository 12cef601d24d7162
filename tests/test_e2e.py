"""End to end on the tiny target: `griffin run` through real Ray Data, Ray Train, MLflow and Ray Serve, killed
during training, rerun to the end (and to the weights of an uninterrupted training), and rerun again as a
no-op. One run that a user would make, instead of a whole run and a separate interrupted one: each
`griffin run` starts its own Ray and every stage's processes, most of what the test costs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.train.driver import run_train
from tests.conftest import assert_same_train_state, free_port, last_checkpoint

REPO = Path(__file__).resolve().parents[1]
GRIFFIN = [sys.executable, "-m", "pipeline.cli"]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

# Every optional step too: the target's own answers as training data, the tree tuned here. The EAGLE-3
# variant, so that its target layers go through every stage (featurize's layers column, training, the
# registry, Serve); the same resume of a GRIFFIN draft on 2 ranks is test_train.py's restarted group.
# One training stage: each stage is a Ray Train run of its own, and a schedule's stages, each from the
# previous best, are test_train.py's schedule run. A checkpoint every 2 of its 8 steps: the kill lands
# between two.
STEPS = [
    "draft.variant=eagle3",
    "data.source=regenerated",
    "regenerate.max_new_tokens=24",
    "decode.tune=true",
    "decode.tune_prompts=1",
    "decode.tune_max_new_tokens=8",
    "train.schedule=[{stage: 2, steps: 8, lr: 0.003}]",
    "train.checkpoint_every=2",
    "train.eval_every=2",
]


def griffin(*args, timeout=600, **kwargs):
    return subprocess.run(
        [*GRIFFIN, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, **kwargs
    )


def overrides(tmp_path, name):
    return [f"output_dir={tmp_path}", f"run_name={name}", f"serve.port={free_port()}"]


def trained_by_step(run_dir: Path, stage: int) -> dict[tuple[int, int], list[str]]:
    """(rank, step) -> the sample ids trained on; a step replayed after a resume keeps its last record."""
    logs = sorted((run_dir / "train" / f"stage{stage}").glob("data_rank*.jsonl"))
    return {(rank, r["step"]): r["sample_ids"] for rank, f in enumerate(logs) for r in map(json.loads, f.open())}


def kill_once_checkpointed(args: list[str], run_dir: Path) -> list[int]:
    """Starts `griffin run`, SIGKILLs it (its whole process group) once Ray Train has recorded a
    checkpoint of the stage (its manager snapshot lists one: a checkpoint folder alone is not yet one
    that a rerun restores), and returns the steps rank 0 had trained."""
    # the killed run's Ray Train polls at its default 2 s (conftest sets 0.25 s): a report waits for the
    # previous one to be polled, which paces its tiny steps so that the kill lands mid-stage (a report
    # every 2 steps: the step after the next report is ~2 s after the first checkpoint is recorded)
    env = {**ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}
    proc = subprocess.Popen(
        [*GRIFFIN, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    snapshot = run_dir / "ray_train" / f"{run_dir.name}-stage2" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 500
    while time.time() < deadline and "checkpoint_" not in (snapshot.read_text() if snapshot.is_file() else ""):
        time.sleep(0.05)
    assert proc.poll() is None, "griffin run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log = run_dir / "train" / "stage2" / "data_rank0.jsonl"
    return [json.loads(x)["step"] for x in log.read_text().splitlines()]


@pytest.mark.timeout(1200)
def test_griffin_run_killed_in_training_resumes_to_the_end_and_reruns_as_a_no_op(tmp_path, ray_local):
    args = ["run", "-c", "jobs/configs/tiny.yaml", *overrides(tmp_path, "e2e"), *STEPS]
    run_dir = tmp_path / "e2e"
    steps_before = kill_once_checkpointed(args, run_dir)
    assert 2 <= max(steps_before) < 8

    first = griffin(*args)  # the run a user makes after the kill: it finishes every stage
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = [
        json.loads(x)["step"] for x in (run_dir / "train" / "stage2" / "data_rank0.jsonl").read_text().splitlines()
    ]
    resumed = steps[len(steps_before) :]
    assert resumed[0] > 1 and resumed[-1] == 8  # continued from a checkpoint, not from step 1
    # the one line on stderr: the killed run's lease, taken over (pipeline.lock)
    assert re.fullmatch(
        r"took over the stale lease \S+griffin.lock of `griffin run .*` \(pid \d+ .* is gone\n", first.stderr
    )
    check_console(first.stdout)
    check_run_outputs(tmp_path, run_dir)
    check_registry(tmp_path, run_dir)

    # the reference: the same training on the same features, uninterrupted (on the suite's Ray): the same
    # sample ids at every step, and at the last step bit-identical weights, optimizer and data position
    store = run_dir / "features"
    run_train(
        load_config(REPO / "jobs/configs/tiny.yaml", [*overrides(tmp_path, "ref"), *STEPS, f"features.store={store}"])
    )
    trained, expected = trained_by_step(run_dir, 2), trained_by_step(tmp_path / "ref", 2)
    assert trained == expected and len(expected) >= 8
    assert_same_train_state(last_checkpoint(run_dir, "e2e", 2), last_checkpoint(tmp_path / "ref", "ref", 2), world=1)

    # another rerun (on another port) redoes nothing: every stage and the evaluation are reused
    second = griffin("run", "-c", "jobs/configs/tiny.yaml", *overrides(tmp_path, "e2e"), *STEPS)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "stage 2 already complete" in second.stdout, second.stdout
    assert "(already complete)" in second.stdout and "tune-tree for" in second.stdout
    assert re.search(r"evaluation of \S+ with these settings already in \S+: reused", second.stdout), second.stdout
    assert len(second.stdout.splitlines()) < 40  # a console a person can read
    assert len(registry_client(tmp_path).search_model_versions("name = 'tiny-llama-eagle3'")) == 1


def check_console(out: str) -> None:
    """A line per stage; Ray's, MLflow's and the workers' output goes to the log the first line names."""
    for step in ("target", "regenerate", "featurize", "train", "register", "tune-tree", "evaluate", "promote"):
        assert f"] {step}" in out
    assert "| dataset / T | τ (GRIFFIN)" in out and "mt_bench/T0" in out
    log = Path(out.splitlines()[0].split("logs in ")[1])
    assert "Traceback" not in out and "WARNING" not in out
    # one closing line for the stage (its wall time at the end); a slow machine adds 2-minute heartbeats
    closing = [line for line in out.splitlines() if line.startswith("[train stage 2]") and re.search(r" in \S+$", line)]
    assert len(out.splitlines()) < 40 and len(closing) == 1 and log.stat().st_size > 0
    assert " row/s]" not in log.read_text()  # no Ray Data progress bars redrawn into the log


def check_run_outputs(tmp_path: Path, run_dir: Path) -> None:
    """The run's summary, store, evaluation (through Serve, with the tuned trees) and regenerated data."""
    summary = json.loads((run_dir / "run_summary.json").read_text())
    for key in ("report", "best_draft"):
        assert Path(summary["locations"][key]).exists()
    manifest = json.loads((run_dir / "features" / "_manifest.json").read_text())
    assert manifest["complete"] is True and manifest["capture_key"]["feature_layers"] == [1, 2]
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["mode"] == "through_serve" and report["summary"]["results"]["mt_bench/T0"]["mismatches"] == 0
    tuning = json.loads((run_dir / "tune_tree" / "tune_tree.json").read_text())
    tuned, sampled = tuning["best"], tuning["sampling"]["best"]
    assert report["tree"] == {k: tuned[k] for k in ("total_tokens", "depth", "top_k")}  # evaluated with the tuned tree
    assert report["sampling_tree"] == {k: sampled[k] for k in ("total_tokens", "depth", "top_k")}  # ... and at T > 0
    regenerated = json.loads((tmp_path / "tiny-llama-regenerated" / "_manifest.json").read_text())
    assert regenerated["complete"] and regenerated["totals"]["rows"] > 0
    assert summary["promotion"]["promoted"] is True  # the first measured version becomes champion


def registry_client(tmp_path: Path):
    import mlflow

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # explicit: another test in this process may have set a registry URI
    return mlflow.tracking.MlflowClient(tracking_uri=store, registry_uri=store)


def check_registry(tmp_path: Path, run_dir: Path) -> None:
    """One version (the killed run registered none), champion, tagged with the evaluation's τ, tree and gate."""
    client = registry_client(tmp_path)
    versions = client.search_model_versions("name = 'tiny-llama-eagle3'")
    assert len(versions) == 1
    assert client.get_model_version_by_alias("tiny-llama-eagle3", "champion").version == versions[0].version
    tags = versions[0].tags  # the evaluation's tau, and which tree and run measured it
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    tree, measured = report["tree"], report["summary"]["results"]["mt_bench/T0"]["tau"]
    assert abs(float(tags["eval.mt_bench.T0.tau"]) - measured) < 1e-4  # the tag is the evaluation's figure
    assert tags["eval_run_id"]
    assert tags["eval_tree"] == f"{tree['total_tokens']}/{tree['depth']}/{tree['top_k']}"
    gate = json.loads(tags["eval.gate"])  # what promotion read: τ and violations from one write
    assert (
        gate["violations"] == 0
        and abs(gate["tau"]["eval.mt_bench.T0.tau"] - float(tags["eval.mt_bench.T0.tau"])) < 1e-4
    )
