"""The MLflow model registry stage: register a draft with lineage, gate promotion on τ, load by URI.

``register(cfg, checkpoint)`` logs the draft directory as an MLflow 3 logged model inside its training
run when that run is in this tracking store, else inside a new registration run (a child of ``griffin
run``'s run when one is active); registers it as ``cfg.model_name`` with lineage tags and points alias
``candidate`` at it. The logged model is a pyfunc that generates text (``pipeline/serve/pyfunc.py``,
logged as models-from-code with this repository's ``griffin`` and ``pipeline`` as ``code_paths`` and
the packages they import, pinned, as its requirements); its artifact ``draft`` is the draft directory,
unchanged, which is what ``pipeline.resources.drafts`` resolves. ``promote(cfg, version, tau,
benchmark)`` records τ and moves alias ``champion`` only when τ beats the champion's τ on the same
benchmark.

Idempotency: a version is identified by ``weights_sha256`` (a hash of the draft's tensors).
Registering a checkpoint whose weights are already registered under this name creates nothing:
it returns the existing version (``created: False``) and points ``candidate`` at it again. So
``register -> eval -> register --promote`` is safe, and one set of weights is one version.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_draft_config, weights_sha256
from pipeline.config import RunConfig
from pipeline.runtime import setup_mlflow
from pipeline.resources.drafts import ARTIFACT_KEY, check_lineage, resolve_draft
from pipeline.resources.identity import target_identity

CANDIDATE, CHAMPION = "candidate", "champion"
LOGGED_MODEL_NAME = "draft"
VIOLATIONS_TAG = "eval.violations"  # model-version tag: T=0 divergences beyond a bf16 near-tie
# The promotion gate's inputs from one evaluation, τ per dataset and temperature with the violations,
# as one JSON tag: one tag write is atomic, a batch of tags is not, and an evaluation that died between
# writing τ and writing its violations once let `register --promote` pass a draft that had diverged
GATE_TAG = "eval.gate"
TARGET_TAGS = (
    "target_id",
    "target_files_sha256",  # drafts trained since file fingerprints (pipeline.resources.identity)
    "target_weights_sha256",  # drafts trained before, and drafts of a target built in memory
    "tokenizer_sha256",
    "chat_template_sha256",
    "hidden_size",
    "vocab_size",
    "architecture",
    "target_revision",  # only for a target loaded at a hub revision
)


def default_checkpoint(cfg: RunConfig) -> Path:
    """The draft that ``register`` and ``export`` take when none is named: training's best."""
    return cfg.run_dir / "train" / "best"


REPO = Path(__file__).resolve().parents[2]
# models-from-code: a file MLflow stores and runs, not an import (serve sits above the registry)
PYFUNC_CODE = REPO / "pipeline" / "serve" / "pyfunc.py"
CODE_PATHS = (REPO / "griffin", REPO / "pipeline")
# what griffin/ and pipeline/ import on the pyfunc's path, by distribution name (sentencepiece: the
# tokenizers of some targets; gguf, accelerate: targets built from assets), pinned to this
# environment's versions when a model is logged; ray is not among them
MODEL_REQUIREMENTS = (
    "mlflow",
    "torch",
    "transformers",
    "tokenizers",
    "sentencepiece",
    "safetensors",
    "pydantic",
    "pyyaml",
    "fastapi",
    "numpy",
    "pandas",
    "gguf",
    "accelerate",
)
PREDICT_PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}


def model_requirements() -> list[str]:
    """``MODEL_REQUIREMENTS`` pinned to the installed versions (a local build tag such as ``+cpu`` left
    out: the pin must resolve on a package index)."""
    from importlib.metadata import version

    from packaging.version import Version

    return [f"{name}=={Version(version(name)).public}" for name in MODEL_REQUIREMENTS]


def pyfunc_signature() -> Any:
    """Input: a ``prompt`` string column; output: one string per prompt; ``params``: ``PREDICT_PARAMS``."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    kinds = {int: "long", float: "double"}
    params = ParamSchema([ParamSpec(name, kinds[type(value)], value) for name, value in PREDICT_PARAMS.items()])
    return ModelSignature(Schema([ColSpec("string", "prompt")]), Schema([ColSpec("string")]), params)


def pyfunc_config(cfg: RunConfig) -> dict[str, Any]:
    """What ``pipeline/serve/pyfunc.py`` loads with: the target the draft's lineage was checked against,
    the trees (``decode.tree``, and ``decode.sampling_tree`` for T > 0), the context cap
    (``decode.max_context``: a decode's KV is sized to it, never to a 128k target's whole context), the
    default ``params``; ``device`` (None: the target section's) and ``max_context`` may be overridden at load."""
    sampling_tree = cfg.decode.sampling_tree
    return {
        "target": cfg.target.model_dump(mode="json"),
        "tree": cfg.decode.tree.model_dump(mode="json"),
        "sampling_tree": sampling_tree.model_dump(mode="json") if sampling_tree else None,
        "max_context": cfg.decode.max_context,
        "params": PREDICT_PARAMS,
        "device": None,
    }


class DraftPyfunc(mlflow.pyfunc.PythonModel):
    """What versions registered before the text-generating pyfunc pickled (their ``predict`` returns the
    draft's ``"config"``, ``"provenance"`` or ``"draft_dir"`` as JSON): kept so that they still load.
    New versions log ``pipeline/serve/pyfunc.py``."""

    def load_context(self, context) -> None:
        self.draft_dir = Path(context.artifacts[ARTIFACT_KEY])
        draft_cfg, raw = read_draft_config(self.draft_dir)
        self.fields = {
            "config": draft_cfg.model_dump(),
            "provenance": raw.get("provenance") or {},
            "draft_dir": str(self.draft_dir),
        }

    def predict(self, context, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        unknown = [name for name in model_input if name not in self.fields]
        if unknown:
            raise ValueError(f"unknown fields {unknown}; ask for any of {sorted(self.fields)}")
        return [json.dumps(self.fields[name], sort_keys=True, default=str) for name in model_input]


def lineage_tags(draft_dir: Path, sha: str) -> dict[str, str]:
    """Model-version tags from the draft's config: target, tokenizer, features, variant, stage..."""
    draft_cfg, raw = read_draft_config(draft_dir)
    provenance = raw.get("provenance") or {}
    target = provenance.get("target") or {}
    tags = {f"target.{key}": target[key] for key in TARGET_TAGS if key in target}
    tags.update(
        weights_sha256=sha,
        variant=draft_cfg.variant,
        draft_vocab_size=draft_cfg.active_vocab_size,
        stage=provenance.get("stage", "unknown"),
        checkpoint=str(draft_dir.resolve()),
    )
    tags.update({key: provenance[key] for key in ("feature_manifest_sha256", "train_run_id") if provenance.get(key)})
    tags.update({f"metric.{name}": value for name, value in (provenance.get("metrics") or {}).items()})
    if provenance.get("resolved_config") is not None:
        tags["resolved_config"] = json.dumps(provenance["resolved_config"], sort_keys=True, default=str)
        if revision := (provenance["resolved_config"].get("data") or {}).get("revision"):
            tags["data.revision"] = revision  # the hub dataset's commit, beside target.target_revision
    return {key: str(value) for key, value in tags.items()}


def _run_exists(client: MlflowClient, run_id: str | None) -> bool:
    try:
        return bool(run_id) and client.get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:  # trained against another tracking store
        return False


@contextmanager
def _run_for(client: MlflowClient, cfg: RunConfig, train_run_id: str | None):
    """The training run when this store has it (so the model shows under it), else a new run."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id == train_run_id:
        yield active
        return
    if _run_exists(client, train_run_id):
        where = {"run_id": train_run_id}
    else:
        tags = {"griffin.stage": "register", "train_run_id": train_run_id or "unknown"}
        where = {"run_name": f"register-{cfg.run_name}", "tags": tags}
    with mlflow.start_run(nested=active is not None, **where) as run:
        yield run


def _version_info(version, created: bool) -> dict[str, Any]:
    return {
        "name": version.name,
        "version": int(version.version),
        "created": created,
        "model_uri": f"models:/{version.name}/{version.version}",
        "source": version.source,
        "run_id": version.run_id,
        "model_id": version.model_id or (version.source or "").removeprefix("models:/"),
        "aliases": list(version.aliases),
        "tags": dict(version.tags),
    }


def register(cfg: RunConfig, checkpoint: str | Path | None = None) -> dict[str, Any]:
    """Register a draft directory (default: ``default_checkpoint(cfg)``) as ``cfg.model_name``,
    alias ``candidate``. Idempotent on the weights' sha256 (see the module docstring). The draft
    (any form ``pipeline.resources`` resolves) must have been trained for the run's target."""
    draft_dir = resolve_draft(checkpoint, cfg) if checkpoint else default_checkpoint(cfg)
    _, raw = read_draft_config(draft_dir)  # fails clearly when it is not a draft directory
    check_lineage(draft_dir, target_identity(cfg.target), str(checkpoint or draft_dir))  # no weights read
    sha = weights_sha256(draft_dir)
    setup_mlflow(cfg)
    client, name = MlflowClient(), cfg.model_name
    found = client.search_model_versions(f"name = '{name}' and tags.weights_sha256 = '{sha}'")
    if found:
        client.set_registered_model_alias(name, CANDIDATE, found[0].version)
        return _version_info(client.get_model_version(name, found[0].version), created=False)
    tags = lineage_tags(draft_dir, sha)
    provenance = raw.get("provenance") or {}
    with _run_for(client, cfg, provenance.get("train_run_id")), tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / ARTIFACT_KEY  # only the draft: a training checkpoint may hold optimizer state too
        staged.mkdir()
        for file in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copy2(draft_dir / file, staged / file)
        info = mlflow.pyfunc.log_model(
            name=LOGGED_MODEL_NAME,
            python_model=str(PYFUNC_CODE),
            artifacts={ARTIFACT_KEY: str(staged)},
            code_paths=[str(path) for path in CODE_PATHS],
            model_config=pyfunc_config(cfg),
            signature=pyfunc_signature(),
            pip_requirements=model_requirements(),
            tags={"weights_sha256": sha},
        )
        numeric = {k: float(v) for k, v in (provenance.get("metrics") or {}).items() if isinstance(v, (int, float))}
        if numeric:
            mlflow.log_metrics(numeric, model_id=info.model_id)
    version = mlflow.register_model(info.model_uri, name, tags=tags)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    return _version_info(client.get_model_version(name, version.version), created=True)


def tau_tag(benchmark: str) -> str:
    """The version tag that holds τ measured on ``benchmark`` (evaluation may set it directly)."""
    return f"tau.{benchmark}"


def recorded_tau(tags: dict[str, str], benchmark: str) -> float | None:
    """τ already on a version: our ``tau.<benchmark>`` tag, else ``griffin eval``'s own tags
    (``eval.<dataset>.T<temp>.tau``): ``benchmark`` may name the temperature (``mt_bench/T1``),
    otherwise the greedy T=0 measurement counts."""
    dotted = benchmark.replace("/", ".")
    for key in (tau_tag(benchmark), f"eval.{dotted}.tau", f"eval.{dotted}.T0.tau"):
        if key in tags:
            return float(tags[key])
    return None


def record_evaluation(
    client: MlflowClient, name: str, version: str, taus: dict[str, float], violations: int, **about: str
) -> None:
    """What one evaluation measured, onto a version: the gate record (``GATE_TAG``) first, in one write,
    then the same figures as loose tags for people and the MLflow UI (``eval.<dataset>.T<t>.tau``,
    ``eval.violations``, ``about``: the run and tree). ``taus`` is keyed by those loose tag names.
    Promotion reads only the gate record, so a crash anywhere here leaves it whole or absent."""
    record = {"tau": {key: float(value) for key, value in taus.items()}, "violations": int(violations), **about}
    client.set_model_version_tag(name, version, GATE_TAG, json.dumps(record, sort_keys=True))
    for key, value in {**{k: f"{v:.4f}" for k, v in taus.items()}, VIOLATIONS_TAG: str(violations), **about}.items():
        client.set_model_version_tag(name, version, key, value)


def measured(tags: dict[str, str], benchmark: str, tau: float | None = None) -> tuple[float | None, int, str | None]:
    """(τ, T=0 violations, why there is no τ) for a candidate's promotion. τ and violations come from
    the same evaluation's gate record; a τ passed in (or recorded by an earlier ``promote(..., tau)``)
    is the caller's word and meets the latest violations count. Loose ``eval.*`` τ without a gate
    record are half an evaluation's writes: never promoted on."""
    record = json.loads(tags[GATE_TAG]) if GATE_TAG in tags else None
    violations = int(record["violations"]) if record else int(tags.get(VIOLATIONS_TAG, "0"))
    if tau is not None:
        return float(tau), violations, None
    if record and (tau := recorded_tau(record["tau"], benchmark)) is not None:
        return tau, violations, None
    if tau_tag(benchmark) in tags:
        return float(tags[tau_tag(benchmark)]), violations, None
    if record is None and recorded_tau(tags, benchmark) is not None:
        return (
            None,
            violations,
            (
                f"its evaluation τ on {benchmark!r} has no gate record ({GATE_TAG}, τ with the T=0 violations): "
                "that evaluation stopped before it finished recording; rerun `griffin eval`, then promote"
            ),
        )
    return None, violations, f"no measured τ on {benchmark!r}: run `griffin eval`, then promote"


def promote(cfg: RunConfig, version: int | str, tau: float | None = None, benchmark: str | None = None) -> dict:
    """Record τ (acceptance length, docs/design.md §8) of ``version`` on ``benchmark`` as tag
    ``tau.<benchmark>`` and move ``champion`` to it only if τ beats the champion's τ there (the first
    version measured becomes champion). ``tau=None`` uses the τ already recorded on the version.
    Returns ``promoted`` and, in words, the ``reason``."""
    benchmark = benchmark or cfg.registry.benchmark
    key, result = tau_tag(benchmark), {"promoted": False, "version": int(version), "benchmark": benchmark}
    setup_mlflow(cfg)
    client, name = MlflowClient(), cfg.model_name
    candidate = client.get_model_version(name, str(version))
    tau, violations, missing = measured(candidate.tags, benchmark, tau)
    if tau is None:
        return {**result, "tau": None, "reason": f"version {version}: {missing}"}
    if not (math.isfinite(tau) and tau >= 1.0):
        raise ValueError(f"tau={tau} is not an acceptance length (tokens per target pass, always >= 1)")
    client.set_model_version_tag(name, str(version), key, repr(tau))
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:  # no champion yet
        champion = None
    refusal = _refusal(candidate, champion, tau, benchmark, violations)
    if refusal:
        return {**result, "tau": tau, "reason": refusal}
    client.set_registered_model_alias(name, CHAMPION, str(version))
    reason = (
        "no champion yet"
        if champion is None
        else "already champion; τ updated"
        if str(champion.version) == str(candidate.version)
        else f"τ {tau:.4f} beats champion v{champion.version}'s {recorded_tau(champion.tags, benchmark):.4f}"
    )
    return {**result, "promoted": True, "tau": tau, "reason": reason}


def _refusal(candidate, champion, tau: float, benchmark: str, violations: int) -> str | None:
    """Why ``candidate`` may not replace ``champion`` (None: it may)."""
    if violations:
        return (
            f"version {candidate.version} decoded {violations} T=0 generations that differ "
            f"from vanilla beyond a bf16 near-tie (eval run {candidate.tags.get('eval_run_id')}): a lossless "
            "decoder never does; see the evaluation report's divergences before promoting anything"
        )
    if champion is None or str(champion.version) == str(candidate.version):
        return None
    best = recorded_tau(champion.tags, benchmark)
    if best is None:
        return (
            f"champion v{champion.version} has no τ on {benchmark!r} to compare with; record it first with "
            f"promote(cfg, {champion.version}, tau, {benchmark!r})"
        )
    if problem := _other_target(candidate.tags, champion.tags):
        return f"champion v{champion.version} drafts for another target ({problem})"
    if tau <= best:
        return f"τ {tau:.4f} does not beat champion v{champion.version}'s {best:.4f} on {benchmark!r}"
    return None


def _other_target(ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    """How two versions' recorded targets differ: by the identity both record (files digest, else
    weights hash); a champion recorded by the other kind (before file digests) by what both record of
    tokenizer, template and sizes."""
    for key in ("target.target_files_sha256", "target.target_weights_sha256"):
        if ours.get(key) and theirs.get(key):
            return None if ours[key] == theirs[key] else f"{key} {theirs[key][:12]}, not {ours[key][:12]}"
    keys = ("target.tokenizer_sha256", "target.chat_template_sha256", "target.hidden_size", "target.vocab_size")
    return next((f"{k} {theirs.get(k)}, not {ours.get(k)}" for k in keys if ours.get(k) != theirs.get(k)), None)


def run_register(cfg: RunConfig, checkpoint: str | None = None, promote: bool = False) -> dict[str, Any]:
    """``griffin register [--checkpoint DIR] [--promote]``; promotion uses the τ that evaluation
    recorded on the version (tag ``tau.<cfg.registry.benchmark>``)."""
    result = register(cfg, checkpoint)
    if promote:
        result["promotion"] = promote_version(cfg, result["version"])
    return result


promote_version = promote  # run_register's ``promote`` flag shadows the function's name


def run_mlflow_ui(cfg: RunConfig, launch: bool = True, port: int = 5000) -> dict[str, Any]:
    """``griffin mlflow-ui``: browse the run's store on 127.0.0.1 (a server URI serves its own UI)."""
    if cfg.tracking_uri.startswith(("http://", "https://")):
        print(f"open {cfg.tracking_uri} in a browser: the tracking server serves the UI")
        return {"url": cfg.tracking_uri}
    command = ["mlflow", "ui", "--backend-store-uri", cfg.tracking_uri, "--host", "127.0.0.1", "--port", str(port)]
    print(f"browse with:  {shlex.join(command)}  then open http://127.0.0.1:{port}", flush=True)
    if launch:  # blocks until Ctrl-C; the UI needs no job-runner processes
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        subprocess.run([sys.executable, "-m", *command], env=env, check=False)
    return {"command": command}
