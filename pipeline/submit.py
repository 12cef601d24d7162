"""``griffin submit <stage> -c CONFIG --address http://HEAD:8265``: one stage as a Ray job.

The job runs ``python -m jobs.<stage> -c CONFIG [stage flags] [overrides]`` (the same ``griffin
<stage>`` command line, e.g. ``--stage 2`` for train or ``--promote`` for register) on the cluster with a runtime_env
whose working_dir is this repository (code, configs) plus whatever ``cluster.runtime_env`` adds
(e.g. ``env_vars``; the packages come with the cluster image, infra/image). Paths in the config
must be valid on the cluster: ``output_dir`` a shared-filesystem path, ``features.store`` that or an
object-store URI (see infra/README.md). The job's driver takes the run directory's lease (``pipeline.lock``).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.runtime import TRACKING_ENV

REPO = Path(__file__).resolve().parents[1]
STAGES = {
    "featurize": "featurize",
    "train": "train",
    "register": "register",
    "eval": "evaluate",
    "serve": "serve",
    "run": "run",
}
EXCLUDES = [".venv", ".git", "outputs", "**/__pycache__", "benchmarks/*.png", "*.egg-info"]


def job_entrypoint(
    stage: str, config_path: str, overrides: list[str], python: str | None = None, stage_flags: list[str] = ()
) -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {sorted(STAGES)}")
    config = Path(config_path).resolve()
    try:
        config_arg = str(config.relative_to(REPO))  # inside the working_dir that travels with the job
    except ValueError:
        raise ValueError(
            f"config {config_path} must live inside the repository ({REPO}) to travel with the job"
        ) from None
    parts = [python or sys.executable, "-m", f"jobs.{STAGES[stage]}", "-c", config_arg, *stage_flags, *overrides]
    return " ".join(shlex.quote(p) for p in parts)


def runtime_env(cfg: RunConfig) -> dict[str, Any]:
    env = {
        "working_dir": str(REPO),
        "excludes": EXCLUDES,
        "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "GRIFFIN_CACHE_DIR": os.environ.get("GRIFFIN_CACHE_DIR", "")},
    }
    # the job's driver loads the config there: the submitter's MLFLOW_* URIs still come first
    env["env_vars"].update({name: os.environ.get(name, "") for name in TRACKING_ENV})
    extra = dict(cfg.cluster.runtime_env)
    env["env_vars"] = {k: v for k, v in {**env["env_vars"], **extra.pop("env_vars", {})}.items() if v}
    return {**env, **extra}


def _submit_when_ready(submit: Any, wait_s: float = 120.0) -> str:
    """A freshly started head answers HTTP before its job agent is up ("No available agent to submit
    job"): retry that one error for ``wait_s``, fail on anything else."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return submit()
        except RuntimeError as error:
            if "No available agent" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def run_submit(
    cfg: RunConfig,
    stage: str,
    address: str,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    no_wait: bool | None = False,
    timeout: float | None = None,
    stage_flags: list[str] | None = None,
) -> dict[str, Any]:
    """Submit, then follow the logs until the job ends (unless ``no_wait``) and return its status.
    ``timeout`` bounds only the following: the job itself runs as long as it needs."""
    from ray.job_submission import JobSubmissionClient

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    client = JobSubmissionClient(address)
    if config_path is None:
        raise ValueError("griffin submit needs the config file path (-c) to send with the job")
    entrypoint = job_entrypoint(stage, config_path, overrides or [], cfg.cluster.python, stage_flags or [])
    job_id = _submit_when_ready(
        lambda: client.submit_job(
            entrypoint=entrypoint,
            runtime_env=runtime_env(cfg),
            entrypoint_num_gpus=cfg.cluster.driver_gpus or None,
            metadata={"griffin_stage": stage, "run_name": cfg.run_name},
        )
    )
    print(f"[submit] {stage} -> {address} as {job_id}: {entrypoint}", flush=True)
    if no_wait:
        print(f"[submit] follow it with: {attach_command(job_id, address)}", flush=True)
        return {"job_id": job_id, "status": str(client.get_job_status(job_id))}
    return follow(client, job_id, address, timeout)


def run_attach(job_id: str, address: str, timeout: float | None = None) -> dict[str, Any]:
    """``griffin submit --attach JOB_ID``: follow an existing job's logs (from their start) to its end."""
    from ray.job_submission import JobSubmissionClient

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    client = JobSubmissionClient(address)
    print(f"[submit] following {job_id} on {address} ({client.get_job_status(job_id)})", flush=True)
    return follow(client, job_id, address, timeout)


def attach_command(job_id: str, address: str) -> str:
    return f"griffin submit --attach {job_id} --address {address}"


def follow(client: Any, job_id: str, address: str, timeout: float | None) -> dict[str, Any]:
    """Print the job's logs until it ends and return its final status, or raise with its message.

    Stopping to follow (``timeout`` or Ctrl-C) never stops the job: a long training run outlives the
    terminal that submitted it, and the printed command picks it up again."""
    from ray.job_submission import JobStatus

    try:
        status = asyncio.run(asyncio.wait_for(_follow_to_end(client, job_id), timeout=timeout))
    except (asyncio.TimeoutError, KeyboardInterrupt) as reason:
        why = "Ctrl-C" if isinstance(reason, KeyboardInterrupt) else f"--timeout {timeout:g}s"
        status = client.get_job_status(job_id)
        print(
            f"\n[submit] stopped following {job_id} ({why}); the job keeps running ({status}).\n"
            f"[submit] re-attach: {attach_command(job_id, address)}\n"
            f"[submit] stop it:   ray job stop {job_id} --address {address}",
            flush=True,
        )
        return {"job_id": job_id, "status": str(status), "following": "detached", "exit_code": DETACHED_EXIT}
    if status != JobStatus.SUCCEEDED:
        raise RuntimeError(f"job {job_id} ended as {status}: {client.get_job_info(job_id).message}")
    return {"job_id": job_id, "status": str(status)}


# sysexits' EX_TEMPFAIL: not a success (`griffin submit a && griffin submit b` must not start b while a
# still runs) and not a failure either: the job's outcome is still to come
DETACHED_EXIT = 75


async def _follow_to_end(client: Any, job_id: str) -> Any:
    try:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)
    except RuntimeError as error:  # the log stream dropped (a head restart): the job may still run
        print(f"[submit] log stream of {job_id} lost ({error}); waiting for the job to end", flush=True)
    # the stream closes when the driver exits; the job's status lands a moment later
    status = await asyncio.to_thread(client.get_job_status, job_id)
    while not status.is_terminal():
        await asyncio.sleep(1.0)
        status = await asyncio.to_thread(client.get_job_status, job_id)
    return status
