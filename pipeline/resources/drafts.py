"""The one draft resolver: ``resolve_draft(uri, cfg) -> Path`` and ``load_draft_uri(uri, target, cfg)`` for a
draft directory, a shipped ``drafts/...`` path, ``models:/<name>@<alias>``, ``models:/<name>/<version>``
or ``runs:/<run_id>/<path>``. Every form goes through ``check_lineage``: the draft must have been
trained for this target's files (or weights), tokenizer and chat template (``target_fingerprint``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from griffin.target import TargetAdapter
from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_draft as bind_draft, read_draft_config
from pipeline.config import RunConfig
from pipeline.resources.identity import FILES, WEIGHTS, TargetIdentity, fingerprint_problems, target_fingerprint

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
ARTIFACT_KEY = "draft"  # the draft directory's name inside a registered (logged) model
LINEAGE_KEYS = ("hidden_size", "vocab_size", "tokenizer_sha256", "chat_template_sha256")  # and the identity


def _local_draft_dir(text: str) -> Path | None:
    """A directory as given, or a shipped ``drafts/...`` path relative to the project's root."""
    for candidate in (Path(text).expanduser(), REPO / text):
        if candidate.is_dir():
            return candidate.resolve()
    return None


def resolve_draft(uri: str | Path, cfg: RunConfig) -> Path:
    """A local draft directory for a directory, a shipped ``drafts/...`` path, ``models:/<name>@<alias>``,
    ``models:/<name>/<version>``, ``runs:/<run_id>/<path>`` or any MLflow artifact URI. A registry
    download is kept (a fresh folder under ``<output_dir>/draft-cache/``): the caller copies or logs
    from it afterwards. To load a draft, ``loadable_draft`` removes its download once loaded."""
    local = _local_draft_dir(str(uri))
    if local is not None:
        return local
    return _download_registered(_registry_uri(uri), cfg, Path(tempfile.mkdtemp(**_cache_folder(uri, cfg))))


@contextlib.contextmanager
def loadable_draft(uri: str | Path, cfg: RunConfig) -> Iterator[Path]:
    """``resolve_draft`` for as long as the ``with`` block reads the draft: a registry download goes
    to a temporary folder removed on exit, loaded or not (every replica start and every evaluation
    downloads again, since aliases move, and the copies would otherwise fill the disk)."""
    local = _local_draft_dir(str(uri))
    if local is not None:
        yield local
        return
    text = _registry_uri(uri)
    with tempfile.TemporaryDirectory(**_cache_folder(uri, cfg)) as folder:
        yield _download_registered(text, cfg, Path(folder))


def _registry_uri(uri: str | Path) -> str:
    text = str(uri)
    if ":/" not in text:
        raise FileNotFoundError(
            f"draft {text!r} is neither a directory (or a shipped drafts/... path) nor a models:/ or runs:/ URI"
        )
    return text


def _cache_folder(uri: str | Path, cfg: RunConfig) -> dict[str, str]:
    """Where a download goes: a unique folder per resolution (aliases move, so an old download may be
    another version; replicas resolving at once never delete each other's), on the outputs' disk."""
    cache = Path(cfg.output_dir) / "draft-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return {"dir": str(cache), "prefix": hashlib.sha256(str(uri).encode()).hexdigest()[:16] + "-"}


def _download_registered(uri: str, cfg: RunConfig, destination: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.runtime import setup_mlflow

    setup_mlflow(cfg)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(destination)))
    except MlflowException as error:
        raise ValueError(f"cannot resolve draft {uri!r} in {cfg.tracking_uri}: {error.message}") from None
    candidate = local
    if (local / "MLmodel").is_file():  # a logged model: the draft is its artifact ``draft``
        flavor = mlflow.models.Model.load(str(local / "MLmodel")).flavors.get("python_function", {})
        candidate = local / flavor.get("artifacts", {}).get(ARTIFACT_KEY, {}).get("path", "")
    if (candidate / CONFIG_NAME).is_file() and (candidate / WEIGHTS_NAME).is_file():
        return candidate
    raise ValueError(f"{uri!r} resolved to {local}, which holds no draft directory (config.json + {WEIGHTS_NAME})")


def lineage_problems(recorded: dict[str, Any], target: TargetAdapter | TargetIdentity) -> list[str]:
    """How a draft's recorded target differs from ``target`` (empty when it fits): sizes, tokenizer,
    chat template and identity (``pipeline.resources.identity``); the path or name it was loaded by
    may differ."""
    actual = target_fingerprint(target)
    return fingerprint_problems(recorded, actual, lambda: target.weights_sha256, LINEAGE_KEYS)


def check_lineage(draft_dir: str | Path, target: TargetAdapter | TargetIdentity, source: str | None = None) -> None:
    """Refuse to pair a draft with a target other than the one it was trained for: hidden size,
    vocabulary, weights, tokenizer and chat template must all match what the draft recorded."""
    _, raw = read_draft_config(draft_dir)
    recorded = (raw.get("provenance") or {}).get("target")
    where = source or str(draft_dir)
    if (
        not isinstance(recorded, dict)
        or any(key not in recorded for key in LINEAGE_KEYS)
        or not (FILES in recorded or WEIGHTS in recorded)
    ):
        raise ValueError(
            f"draft {where} records no target fingerprint (provenance.target in its config.json), so "
            "its pairing with a target cannot be checked; save it with pipeline.resources.drafts.save_draft_with_lineage "
            "or train it with `griffin train`"
        )
    problems = lineage_problems(recorded, target)
    if problems:
        raise ValueError(
            f"draft {where} was trained for target {recorded.get('target_id', '?')!r} and does not fit target "
            f"{target.name!r}: {'; '.join(problems)}. Pair it with its own target or train a new draft."
        )


def load_draft_uri(uri: str | Path, target: TargetAdapter, cfg: RunConfig, dtype: torch.dtype | None = None) -> Any:
    """Resolve, check the lineage, load bound to ``target``. Decoding processes (a pre-packed target)
    get the draft in the target's dtype, pre-packed too; ``dtype`` overrides (training: fp32)."""
    with loadable_draft(uri, cfg) as draft_dir:  # the weights are in memory once bound
        return load_draft_dir(draft_dir, target, str(uri), dtype)


def load_draft_dir(draft_dir: str | Path, target: TargetAdapter, source: str, dtype: torch.dtype | None = None) -> Any:
    """A draft directory at hand (``source`` names it in errors): lineage checked, bound to ``target``,
    in the target's dtype unless ``dtype`` says otherwise, pre-packed for a pre-packed target."""
    check_lineage(draft_dir, target, source)
    draft = bind_draft(draft_dir, target, dtype=dtype or target.dtype)
    if target.packed:
        draft.prepack()
    return draft


def save_draft_with_lineage(
    draft: Any, path: str | Path, target: TargetAdapter, provenance: dict[str, Any] | None = None
) -> Path:
    """``griffin.checkpoint.save_draft`` with the target's fingerprint recorded, so it loads through
    ``load_draft_uri`` (tests, tools and exports that make drafts outside ``griffin train``)."""
    from griffin.checkpoint import save_draft as write_draft

    return write_draft(draft, path, {**(provenance or {}), "target": target_fingerprint(target)})


def candidate_uri(cfg: RunConfig) -> str:
    """The draft that evaluation and tune-tree take when none is named: the run's registered candidate."""
    return f"models:/{cfg.model_name}@candidate"


def draft_for_run(cfg: RunConfig, target: TargetAdapter, draft: Any = None) -> tuple[Any, str | None]:
    """(model, uri): a model already in memory (uri None), a URI or directory, or the run's candidate."""
    if draft is not None and not isinstance(draft, (str, Path)):
        return draft, None
    uri = canonical_draft_uri(draft if draft is not None else candidate_uri(cfg))
    return load_draft_uri(uri, target, cfg), uri


def canonical_draft_uri(draft: str | Path) -> str:
    """A draft's URI as reports record it: a local directory resolved to its absolute path."""
    local = _local_draft_dir(str(draft))
    return str(local) if local is not None else str(draft)
