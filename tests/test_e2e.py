"""End to end on the tiny target: `griffin run` through real Ray Data, Ray Train, MLflow and Ray Serve,
and an idempotent rerun (a run interrupted during training: test_e2e_resume.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
GRIFFIN = [sys.executable, "-m", "pipeline.cli"]


def griffin(*args, timeout=600, **kwargs):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [*GRIFFIN, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
    )


def overrides(tmp_path, name):
    return [f"output_dir={tmp_path}", f"run_name={name}", f"serve.port={free_port()}"]


@pytest.mark.timeout(900)
def test_griffin_run_tiny_end_to_end_and_idempotent_rerun(tmp_path):
    # every optional step too: the target's own answers as training data, the tree tuned here. The
    # EAGLE-3 variant, so that its target layers go through every stage (featurize's layers column,
    # training, the registry, Serve); the interrupt test (test_e2e_resume.py) runs GRIFFIN. One training
    # stage: each stage is a Ray Train run of its own, and a schedule's stages, each from the previous
    # best, are test_train.py's schedule run
    steps = [
        "draft.variant=eagle3",
        "data.source=regenerated",
        "regenerate.max_new_tokens=24",
        "decode.tune=true",
        "decode.tune_prompts=1",
        "decode.tune_max_new_tokens=8",
        "train.schedule=[{stage: 2, steps: 6, lr: 0.003}]",
    ]
    first = griffin("run", "-c", "jobs/configs/tiny.yaml", *overrides(tmp_path, "e2e"), *steps)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    for step in ("target", "regenerate", "featurize", "train", "register", "tune-tree", "evaluate", "promote"):
        assert f"] {step}" in out
    assert "| dataset / T | τ (GRIFFIN)" in out and "mt_bench/T0" in out
    # the console is a line per stage; Ray's, MLflow's and the workers' output goes to the log it names
    log = Path(out.splitlines()[0].split("logs in ")[1])
    assert "Traceback" not in out + first.stderr and "WARNING" not in out + first.stderr and first.stderr == ""
    # one closing line for the stage (its wall time at the end); a slow machine adds 2-minute heartbeats
    closing = [line for line in out.splitlines() if line.startswith("[train stage 2]") and re.search(r" in \S+$", line)]
    assert len(out.splitlines()) < 40 and len(closing) == 1 and log.stat().st_size > 0
    assert " row/s]" not in log.read_text()  # no Ray Data progress bars redrawn into the log
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "run_summary.json").read_text())
    for key in ("report", "best_draft"):
        assert Path(summary["locations"][key]).exists()
    manifest = json.loads((run_dir / "features" / "_manifest.json").read_text())
    assert manifest["complete"] is True and manifest["capture_key"]["feature_layers"] == [1, 2]
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["mode"] == "through_serve" and report["summary"]["results"]["mt_bench/T0"]["mismatches"] == 0
    tuned = json.loads((run_dir / "tune_tree" / "tune_tree.json").read_text())["best"]
    assert report["tree"] == {k: tuned[k] for k in ("total_tokens", "depth", "top_k")}  # evaluated with the tuned tree
    sampled = json.loads((run_dir / "tune_tree" / "tune_tree.json").read_text())["sampling"]["best"]
    assert report["sampling_tree"] == {k: sampled[k] for k in ("total_tokens", "depth", "top_k")}  # ... and at T > 0
    regenerated = json.loads((tmp_path / "tiny-llama-regenerated" / "_manifest.json").read_text())
    assert regenerated["complete"] and regenerated["totals"]["rows"] > 0
    assert summary["promotion"]["promoted"] is True  # the first measured version becomes champion

    import mlflow

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # explicit: another test in this process may have set a registry URI
    client = mlflow.tracking.MlflowClient(tracking_uri=store, registry_uri=store)
    versions = client.search_model_versions("name = 'tiny-llama-eagle3'")
    assert len(versions) == 1
    assert client.get_model_version_by_alias("tiny-llama-eagle3", "champion").version == versions[0].version
    tags = versions[0].tags  # the evaluation's tau, and which tree and run measured it
    tree = json.loads((run_dir / "eval" / "report.json").read_text())["tree"]
    measured = report["summary"]["results"]["mt_bench/T0"]["tau"]  # the tag is the evaluation's figure
    assert abs(float(tags["eval.mt_bench.T0.tau"]) - measured) < 1e-4
    assert tags["eval_run_id"]
    assert tags["eval_tree"] == f"{tree['total_tokens']}/{tree['depth']}/{tree['top_k']}"
    gate = json.loads(tags["eval.gate"])  # what promotion read: τ and violations from one write
    assert (
        gate["violations"] == 0
        and abs(gate["tau"]["eval.mt_bench.T0.tau"] - float(tags["eval.mt_bench.T0.tau"])) < 1e-4
    )

    second = griffin("run", "-c", "jobs/configs/tiny.yaml", *overrides(tmp_path, "e2e"), *steps)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "stage 2 already complete" in second.stdout, second.stdout
    assert "(already complete)" in second.stdout and "tune-tree for" in second.stdout
    assert "reused" in second.stdout and len(second.stdout.splitlines()) < 40  # a console a person can read
    assert len(client.search_model_versions("name = 'tiny-llama-eagle3'")) == 1
