"""benchmarks/gpu/run.sh and stage.py on the CPU: what the GPU machine lacks travels in checked parts.

The dry run stages a wheel and a ShareGPT subset, cuts them into parts, receives each part as its
own device call would, installs from them into a --target folder and runs the steps it is given;
a missing or damaged part is refused by name before anything is installed. The pipeline and decode
steps of a full dry run cost minutes of CPU (docs/scaling.md, "Running on a GPU"): here the steps
are install, tests (the gpu-marked ones, skipped without CUDA) and results."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import stage  # noqa: E402


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, griffin-probe 1.0, whose module says it was installed from parts."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "griffin_probe-1.0-py3-none-any.whl"
    files = {
        "griffin_probe/__init__.py": "FROM_PARTS = True\n",
        "griffin_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: griffin-probe\nVersion: 1.0\n",
        "griffin_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "griffin_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, "griffin_probe-1.0.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


@pytest.fixture
def staged(tmp_path):
    probe_wheel(tmp_path / "index")
    requirements = tmp_path / "wheels.txt"
    requirements.write_text("griffin-probe==1.0\n")
    manifest = stage.stage(tmp_path / "gpu", 0.004, requirements, tmp_path / "index", 5, "3.11")
    return tmp_path, manifest


def test_stage_splits_into_checked_parts(staged):
    tmp_path, manifest = staged
    parts = tmp_path / "gpu" / "parts"
    assert manifest["wheels"] == ["griffin_probe-1.0-py3-none-any.whl"]
    assert len(manifest["parts"]) > 2 and all(p["bytes"] <= 0.004 * 2**20 for p in manifest["parts"])
    assert sum(p["bytes"] for p in manifest["parts"]) == manifest["bytes"]
    assert json.loads((parts / "MANIFEST.json").read_text())["sha256"] == manifest["sha256"]


def test_install_refuses_a_missing_or_damaged_part(staged):
    tmp_path, manifest = staged
    parts, there = tmp_path / "gpu" / "parts", tmp_path / "there"
    stage.receive(parts, there)
    (there / manifest["parts"][1]["name"]).unlink()
    damaged = there / manifest["parts"][0]["name"]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit) as refused:
        stage.install(there, there / "site")
    message = str(refused.value)
    assert f"{manifest['parts'][1]['name']} missing" in message and f"{damaged.name} damaged" in message
    assert not (there / "site").exists()


def test_dry_run_receives_each_part_installs_and_runs_the_steps(tmp_path):
    probe_wheel(tmp_path / "index")
    (tmp_path / "wheels.txt").write_text("griffin-probe==1.0\n")
    out, stage_dir = tmp_path / "out", tmp_path / "stage"
    env = {
        **os.environ,
        "OUT": str(out),
        "STAGE": str(stage_dir),
        "GPU_DIR": str(tmp_path / "gpu"),
        "STEPS": "install tests results",
        "PY": sys.executable,
    }
    args = ["--requirements", str(tmp_path / "wheels.txt"), "--find-links", str(tmp_path / "index")]
    args += ["--conversations", "5", "--part-mib", "0.004"]
    done = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", "dry-run", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [("install", 0), ("tests", 0), ("results", 0)]
    assert (stage_dir / "site" / "griffin_probe" / "__init__.py").exists()
    assert json.loads((stage_dir / "bundle" / "data" / "sharegpt.json").read_text())[0]["conversations"]
    record = json.loads((out / "gpu.json").read_text())
    tests = record["tests"]
    assert tests["tests"] > 0 and tests["failures"] == tests["errors"] == 0, tests
    if not torch.cuda.is_available():  # without CUDA every gpu test skips; with it they run (and must pass)
        assert tests["skipped"] == tests["tests"], tests
    assert {g["measure"] for g in record["goals"]} >= {"griffin run through Ray on the GPU completes"}

    # a step that overruns its time limit is stopped, and results still runs
    overrun = {**env, "DRY": "1", "STEPS": "smoke", "LIMIT_SMOKE_S": "1"}
    subprocess.run(["bash", "benchmarks/gpu/run.sh", "all"], cwd=ROOT, env=overrun, capture_output=True, text=True)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [("smoke", 124), ("results", 0)]
    # under DEADLINE_S a step with no time left is not started; results still runs
    late = {**env, "DRY": "1", "STEPS": "smoke", "DEADLINE_S": "60"}
    subprocess.run(["bash", "benchmarks/gpu/run.sh", "all"], cwd=ROOT, env=late, capture_output=True, text=True)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s["seconds"]) for s in steps][0] == ("smoke", 124, 0) and steps[1]["rc"] == 0
