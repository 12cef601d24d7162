"""MLflow as its users expect, on real sqlite stores: the URIs' precedence (MLFLOW_* env, config, default),
parent and child runs, the feature store as a training input, metrics on the logged model, the worker's
logging recipe, and a registered model that generates text where only its own code and requirements are."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline import runtime
from pipeline.config import config_from_dict, load_config
from pipeline.registry import register as registry
from pipeline.resources.targets import load_target
from tests.pipeline.test_registry import greedy_texts, make_draft

TINY = "jobs/configs/tiny.yaml"
ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


@pytest.fixture(autouse=True)
def no_user_uris(monkeypatch):
    """Each test states the environment it means (an engineer's shell may export these)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def target():
    return load_target(load_config(TINY, ["output_dir=unused"]).target)


def versions(uri: str, name: str) -> list:
    return MlflowClient(tracking_uri=uri, registry_uri=uri).search_model_versions(f"name = '{name}'")


def test_uri_precedence(tmp_path, monkeypatch):
    """env > config > sqlite default, the registry following the tracking URI; a relative sqlite path is
    pinned on the driver, and a config sent to a worker keeps the driver's URIs whatever its env says."""
    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path / 'out'}"])
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}" == cfg.tracking.registry_uri
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path}", "tracking.tracking_uri=http://127.0.0.1:5999"])
    assert (cfg.tracking_uri, cfg.tracking.registry_uri) == ("http://127.0.0.1:5999",) * 2
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path}", "tracking.tracking_uri=http://127.0.0.1:5999"])
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'elsewhere.db'}" == cfg.tracking.registry_uri
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "sqlite:///registry.db")
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path}"])
    assert cfg.tracking.registry_uri == f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://another-node:5000")  # a worker's own environment
    on_worker = config_from_dict(cfg.resolved())
    assert on_worker.tracking_uri == f"sqlite:///{tmp_path / 'elsewhere.db'}"


def test_register_into_the_env_store(tmp_path, monkeypatch, target):
    """MLFLOW_TRACKING_URI=sqlite:///elsewhere.db (relative) -> `griffin register` registers there, and
    setting up MLflow leaves the user's environment as it was."""
    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path / 'out'}", "registry.model_name=env-test"])
    make_draft(cfg, target, tmp_path / "d")
    argv = ["register", "-c", str(repo / TINY), f"output_dir={tmp_path / 'out'}", "registry.model_name=env-test"]
    assert main([*argv, "--checkpoint", str(tmp_path / "d")]) == 0
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///elsewhere.db"
    assert len(versions(f"sqlite:///{tmp_path / 'elsewhere.db'}", "env-test")) == 1
    assert not (tmp_path / "out" / "mlflow.db").exists()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    cfg = load_config(repo / TINY, [f"output_dir={tmp_path / 'out'}", "registry.model_name=env-test"])
    registry.register(cfg, tmp_path / "d")
    assert len(versions(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}", "env-test")) == 1  # config's default


def test_parent_run_children_and_model_metrics(tmp_path, target):
    """`griffin run`'s run is resumed by a rerun; stages started inside are its children, standalone
    stages are top-level; evaluation's metrics land on the registered draft's logged model."""
    from pipeline.evaluate.report import log_report

    cfg = load_config(TINY, [f"output_dir={tmp_path}", "registry.model_name=runs-test"])
    make_draft(cfg, target, tmp_path / "d")
    with runtime.pipeline_run(cfg) as parent:
        version = registry.register(cfg, tmp_path / "d")  # its training run is not in this store: a child run
        (tmp_path / "eval").mkdir()
        report = {"metrics": {"mt_bench/T0/tau/griffin": 2.5, "mt_bench/T0/tau/vanilla": 1.0}, "results": {}}
        eval_run = log_report(cfg, report, tmp_path / "eval", "models:/runs-test@candidate")
    client = MlflowClient()
    for run_id in (version["run_id"], eval_run):
        assert client.get_run(run_id).data.tags["mlflow.parentRunId"] == parent.info.run_id
    with runtime.pipeline_run(cfg) as again:
        assert again.info.run_id == parent.info.run_id
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    model = client.get_logged_model(version["model_id"])
    measured = {m.key: m.value for m in model.metrics}  # besides training's own (eval/sim_accept_len)
    assert measured["mt_bench/T0/tau"] == 2.5 and not any("vanilla" in key for key in measured)
    runtime.setup_mlflow(cfg)
    alone = log_report(cfg, report, tmp_path / "eval", None)
    assert "mlflow.parentRunId" not in client.get_run(alone).data.tags


def test_feature_store_is_a_training_input(tmp_path):
    """What the train driver logs: the store as a dataset with the manifest's digest."""
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    mlflow = runtime.setup_mlflow(cfg)
    sha = "ab" * 32
    with mlflow.start_run() as run:
        mlflow.log_input(runtime.feature_dataset(cfg.store_path, sha), context="training", tags={"sha256": sha})
    (logged,) = MlflowClient().get_run(run.info.run_id).inputs.dataset_inputs
    assert logged.dataset.digest == sha[:36] and json.loads(logged.dataset.source)["uri"] == cfg.store_path
    assert {t.key: t.value for t in logged.tags}["sha256"] == sha


def test_worker_logging_recipe(tmp_path, monkeypatch):
    """The training worker's own MLflow code (``pipeline.train.worker``), driven as ``train_worker`` drives
    it on each attempt, into the run the driver holds RUNNING: ``_rank0_tracking`` gives rank 0 a client
    on ``cfg.tracking_uri`` (not the worker's own default URI, pointed elsewhere here) and other ranks
    none; each ``_report_rank0`` lands every metric of its report at its step, and the step, loss and
    latest score reach the driver's ``StageChannel``; leaving ``_rank0_tracking`` flushes MLflow's
    async queue for that store (observed; the metrics are read back with no flush of the test's own);
    system metrics land as ``system/rank0/*``, a restarted attempt's after the first's (resume_logging);
    then the driver's ``_log_curves`` logs ``curves.png`` from those histories. Not here: the stage run's
    params, resolved config and dataset input, logged inline in ``driver._run_stage`` around a Ray Train
    ``fit()`` (tests/pipeline/test_train.py runs that)."""
    from types import SimpleNamespace

    from pipeline.train.driver import _log_curves
    from pipeline.train.channel import StageChannel
    from pipeline.train.worker import SCORE, _rank0_tracking, _report_rank0

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")  # the worker's 10 s, shortened
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    stage = cfg.train.schedule[0]  # 6 steps
    mlflow = runtime.setup_mlflow(cfg)
    flushes, flush = [], mlflow.flush_async_logging  # each flush runs, recording the store it flushes
    monkeypatch.setattr(mlflow, "flush_async_logging", lambda: (flushes.append(mlflow.get_tracking_uri()), flush())[1])
    progress = StageChannel()  # the driver's actor, called in-process: `.update.remote(...)` is its method
    reports = {step: {"train/loss": 1.0 / step, "train/tokens": 100.0 * step} for step in range(1, stage.steps + 1)}
    for step in (2, 4, 6):
        reports[step].update({SCORE: 1.0 + step / 10, "eval/acc_0": step / 10})
    elsewhere = tmp_path / "worker-default.db"  # where a worker's own environment would point MLflow
    with mlflow.start_run(run_name="tiny-stage1", log_system_metrics=False) as run:  # the driver's, RUNNING
        run_id = run.info.run_id
        channel = SimpleNamespace(update=SimpleNamespace(remote=progress.update))
        job = SimpleNamespace(mlflow_run_id=run_id, channel=channel, stage=stage)  # the StageJob fields it reads
        with _rank0_tracking(cfg, run_id, rank=1) as client:
            assert client is None  # other ranks log nothing
        for attempt in ((1, 2, 3, 4), (5, 6)):  # the second: a worker restarted from the step-4 checkpoint
            monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{elsewhere}")
            mlflow.set_tracking_uri(f"sqlite:///{elsewhere}")
            with _rank0_tracking(cfg, run_id, rank=0) as client:
                time.sleep(1.5)  # a few samples of system metrics
                for step in attempt:  # the last queued just before the loop returns
                    _report_rank0(job, client, step, reports[step], rate=1000.0, eta=1.0)
            assert flushes.pop() == cfg.tracking_uri and not flushes  # on the way out, the client's store
        reader = MlflowClient(cfg.tracking_uri)
        for key in ("train/loss", "train/tokens", SCORE, "eval/acc_0"):
            logged = {m.step: m.value for m in reader.get_metric_history(run_id, key)}
            assert logged == {step: report[key] for step, report in reports.items() if key in report}, key
        assert progress.latest() == {"step": 6, "loss": 1.0 / 6, "score": reports[6][SCORE]}
        assert reader.get_run(run_id).info.status == "RUNNING"
    assert not elsewhere.exists()
    cpu = [key for key in reader.get_run(run_id).data.metrics if key.startswith("system/rank0/cpu_utilization")]
    assert cpu, sorted(reader.get_run(run_id).data.metrics)
    steps = [m.step for m in reader.get_metric_history(run_id, cpu[0])]
    assert len(steps) >= 2 and len(set(steps)) == len(steps), steps  # the restart resumed, overwrote nothing
    assert not [key for key in reader.get_run(run_id).data.metrics if key.startswith("system/rank1")]
    _log_curves(mlflow, run_id, tmp_path)
    assert [a.path for a in reader.list_artifacts(run_id)] == ["curves.png"]


LOAD = """
import sys
# the venv's editable install would import a checkout whatever the model carries: drop its finders
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path[:] = [p for p in sys.path if "editable" not in p.lower()]
sys.path_importer_cache.clear()
import json, mlflow, pandas as pd
before = set(sys.modules)
model = mlflow.pyfunc.load_model("models:/{name}@candidate")
texts = model.predict(pd.DataFrame({{"prompt": ["hi", "2+2="]}}), params={{"max_new_tokens": 8, "temperature": 0.0}})
import pipeline, griffin
imported = sorted({{m.split(".")[0] for m in set(sys.modules) - before}})
print(json.dumps({{"texts": list(texts), "code": [pipeline.__file__, griffin.__file__], "imported": imported}}))
"""


def requirement_closure(requirements: list[str]) -> set[str]:
    """The distributions the model's requirements install, theirs included (as installed here)."""
    names, todo = set(), [r.split("==")[0] for r in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in names:
            continue
        names.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r]
    return names


def test_registered_model_generates_text_from_its_own_code(tmp_path, target):
    """`mlflow.pyfunc.load_model("models:/<name>@candidate").predict(...)` in a fresh interpreter outside the
    repository (isolated mode, no PYTHONPATH, the editable install's finder removed): the model's own
    griffin/pipeline copies are imported, it returns at T=0 one text per prompt, non-empty and equal to
    the text decoded in this process from the same draft and target (``greedy_texts``: the prompt as a
    user turn through the chat template, the target's greedy tokens, which speculative decoding
    reproduces, decoded as the server does), and every distribution it imported is one its logged
    requirements install."""
    cfg = load_config(TINY, [f"output_dir={tmp_path / 'out'}", "registry.model_name=pyfunc-test"])
    make_draft(cfg, target, tmp_path / "d")
    info = registry.register(cfg, tmp_path / "d")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": cfg.tracking_uri}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-I", "-c", LOAD.format(name="pyfunc-test")],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # one text per prompt, each the non-empty greedy text decoded here in-process from the same draft directory
    assert out["texts"] == greedy_texts(cfg, tmp_path / "d", ["hi", "2+2="], 8) and all(out["texts"]), out["texts"]
    repo = str(Path(__file__).resolve().parents[2])
    assert all(not path.startswith(repo) and "/code/" in path for path in out["code"]), out["code"]
    requirements = (
        Path(registry.mlflow.artifacts.download_artifacts(info["model_uri"])) / "requirements.txt"
    ).read_text()
    listed = [line for line in requirements.split() if "==" in line]
    assert {"torch", "transformers", "safetensors", "pydantic", "pyyaml"} <= {r.split("==")[0] for r in listed}
    installs = requirement_closure(listed)
    distributions = metadata.packages_distributions()
    # dill: torch imports it when it is installed (torch.utils._import_utils), and runs without it
    skip = set(sys.stdlib_module_names) | {"pipeline", "griffin", "dill"}
    missing = {
        module: distributions[module]
        for module in out["imported"]
        if module not in skip and module in distributions
        if not any(d.lower().replace("_", "-") in installs for d in distributions[module])
    }
    assert not missing, f"imported by the model but not in its requirements.txt: {missing}\n{requirements}"
