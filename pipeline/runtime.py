"""Connecting to Ray and MLflow the same way from every stage.

Local default (docs/design.md): ``ray.init(address="local", num_cpus=...)``, with its own State API
server on 127.0.0.1 (``ensure_ray`` says why), unless
``cluster.address`` or ``RAY_ADDRESS`` names a cluster; token auth and usage stats off for the local
cluster. MLflow: the tracking and registry URIs that ``resolve_tracking`` decides (the ``MLFLOW_*``
environment variables, then the config, then an embedded sqlite store in the output directory),
``griffin run``'s parent run (``pipeline_run``) and the feature store as a dataset (``feature_dataset``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pipeline.config imports resolve_tracking from here
    from pipeline.config import RunConfig

# Set in every driver unless the user set them. Ray Data's progress bars are redrawn many times a
# second by each split coordinator and forwarded to the driver's log, where they are hundreds of lines
# of carriage returns: the console has its own line per stage (RAY_DATA_DISABLE_PROGRESS_BARS=0 keeps them).
LOCAL_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
TRACKING_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


def ensure_ray(cfg: RunConfig) -> None:
    """Connect to the configured cluster, or start a local Ray on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    address = cluster_address(cfg)
    # a `ray job submit` driver already runs inside the job's runtime_env; passing one again conflicts
    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    runtime_env = None if in_job else (dict(cfg.cluster.runtime_env) or None)
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    # The local cluster's own State API server, on a port chosen here and named to all its workers.
    # Ray Train's placement-group cleaner asks the State API whether the training controller still
    # lives. Without an address it resolves one through `ray start`'s address file, i.e. any other Ray
    # cluster on this machine, is told "no such actor" and removes this run's placement group
    # mid-training (seen: a training beside the test suite's `ray start` nodes). Without an API
    # server at all it logged a failed query every second.
    port = free_port()
    env_vars = {**(runtime_env or {}).get("env_vars", {}), "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    ray.init(
        address="local",
        num_cpus=cfg.cluster.num_cpus,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        runtime_env={**(runtime_env or {}), "env_vars": env_vars},
        log_to_driver=True,
    )


def cluster_address(cfg: RunConfig) -> str | None:
    """The Ray cluster to join: ``cluster.address``, else ``$RAY_ADDRESS`` (a submitted job's); None: a
    local Ray, which cannot grow."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS")


def resource_shortfall(needs: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """The resources of ``needs`` (CPU, GPU, ...) the Ray cluster holds less of than needed right now:
    kind -> (needed, held). Empty when everything fits."""
    import ray

    have = ray.cluster_resources()
    return {kind: (need, have.get(kind, 0.0)) for kind, need in needs.items() if need > have.get(kind, 0.0)}


def describe_shortfall(short: Mapping[str, tuple[float, float]], holder: str) -> str:
    """``resource_shortfall``'s answer in words: "7 CPU needed, the cluster has 6; ..."."""
    return "; ".join(f"{need:g} {kind} needed, {holder} has {held:g}" for kind, (need, held) in short.items())


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _absolute_sqlite(uri: str) -> str:
    """``sqlite:///relative.db`` is relative to where the command runs: pinned to an absolute path here,
    on the driver, since workers and replicas run elsewhere."""
    path = uri.removeprefix("sqlite:///")
    if not uri.startswith("sqlite:///") or path.startswith("/") or not path:
        return uri
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def resolve_tracking(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The one place MLflow's URIs are decided: ``MLFLOW_TRACKING_URI`` (``environ``, default the process's
    environment), else ``tracking.tracking_uri``, else ``sqlite:///<output_dir>/mlflow.db``; the registry:
    ``MLFLOW_REGISTRY_URI``, else ``tracking.registry_uri``, else the tracking URI. Returns ``data`` with
    both filled in, so ``cfg.resolved()`` carries them to every process."""
    environ = os.environ if environ is None else environ
    tracking = data.get("tracking") or {}
    if not isinstance(tracking, dict):  # config_from_dict names the bad section
        return data
    default = f"sqlite:///{Path(data.get('output_dir', 'outputs')).resolve() / 'mlflow.db'}"
    uri = _absolute_sqlite(environ.get("MLFLOW_TRACKING_URI") or tracking.get("tracking_uri") or default)
    registry = environ.get("MLFLOW_REGISTRY_URI") or tracking.get("registry_uri") or uri
    return {**data, "tracking": {**tracking, "tracking_uri": uri, "registry_uri": _absolute_sqlite(registry)}}


def setup_mlflow(cfg: RunConfig):
    """Point MLflow at the run's tracking store and registry (``resolve_tracking``); returns the mlflow module."""
    import mlflow

    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    user_env = {name: os.environ.get(name) for name in TRACKING_ENV}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(cfg.tracking.registry_uri or uri)
    # MLflow exports what it was set to into this process's environment; but that environment is the
    # user's word, read first by load_config, so a later config in this process (tests, a Serve app
    # built from a file) must not inherit this config's URIs as if the user had set them
    for name, value in user_env.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    artifact_root = (Path(cfg.output_dir).resolve() / "mlartifacts").as_uri()
    if mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
        try:
            mlflow.create_experiment(
                cfg.tracking.experiment, artifact_location=artifact_root if uri.startswith("sqlite") else None
            )
        except Exception as error:  # another process created it first
            if "already exists" not in str(error):
                raise
    mlflow.set_experiment(cfg.tracking.experiment)
    return mlflow


def recorded_run(mlflow: Any, run_id_file: Path) -> str | None:
    """The run id in ``run_id_file`` when this tracking store holds that run (not deleted), else None."""
    if not run_id_file.is_file():
        return None
    run_id = run_id_file.read_text().strip()
    try:
        return run_id if mlflow.MlflowClient().get_run(run_id).info.lifecycle_stage == "active" else None
    except mlflow.exceptions.MlflowException:  # recorded in another tracking store
        return None


@contextmanager
def pipeline_run(cfg: RunConfig) -> Iterator[Any]:
    """``griffin run``'s parent MLflow run, active while the stages run: each stage's run starts nested
    (``mlflow.start_run(nested=True)``), so it is this run's child; without it (``griffin train``
    alone) a stage's run is top-level. A rerun on the same run directory resumes the same parent
    (its id is kept in ``<run_dir>/mlflow_run_id``)."""
    mlflow = setup_mlflow(cfg)
    run_id_file = cfg.run_dir / "mlflow_run_id"
    run_id = recorded_run(mlflow, run_id_file)
    tags = {"griffin.stage": "run", "griffin.run_dir": str(cfg.run_dir)}
    where = {"run_id": run_id} if run_id else {"run_name": cfg.run_name, "tags": tags}
    with mlflow.start_run(**where, log_system_metrics=False) as run:  # stages' work runs elsewhere
        if run_id is None:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            from pipeline.files import atomic_write_text  # here: pipeline.config imports this module, keep it light

            atomic_write_text(run_id_file, run.info.run_id)
            mlflow.log_dict(cfg.resolved(), "resolved_config.json")
        try:
            yield run
        finally:
            mlflow.flush_async_logging()  # a run ends with everything it logged in the store


def feature_dataset(source: str, digest: str, name: str | None = None) -> Any:
    """The features a training run read as an MLflow dataset (``mlflow.log_input``): the store (or, for
    online features, the conversations they were computed from) and the digest of its manifest, so a
    training run names exactly the features it read."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    return MetaDataset(resolve_dataset_source(source), name=name or Path(source).name, digest=digest[:36])
