"""Connecting to Ray and MLflow the same way from every stage.

Local default (docs/design.md): ``ray.init(address="local", num_cpus=...)``, with its own State API
server on 127.0.0.1 (``ensure_ray`` says why), unless
``cluster.address`` or ``RAY_ADDRESS`` names a cluster; token auth and usage stats off for the local
cluster. MLflow: the run's tracking URI (embedded sqlite by default) for tracking and registry.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pipeline.config import RunConfig

LOCAL_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def ensure_ray(cfg: RunConfig) -> None:
    """Connect to the configured cluster, or start a local Ray on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
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


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_mlflow(cfg: RunConfig):
    """Point MLflow at the run's tracking store (and registry); returns the mlflow module."""
    import mlflow

    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
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
