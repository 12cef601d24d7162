"""Which target a feature store or a draft belongs to, decided without loading the target.

``target_fingerprint(target)`` is what every store's capture key and every draft's provenance
records: the target's name, sizes, tokenizer and chat template hashes, and its identity, one of

- ``target_files_sha256`` (``griffin.target_files.files_sha256``): the digest of its config and
  weight files, for a target read from files. It needs no weights in memory and, for a hub target or a
  local one hashed before on this machine, reads nothing;
- ``target_weights_sha256`` (``griffin.checkpoint.tensors_sha256``): the hash of every tensor, for a
  target built in memory (``target.tiny``). Stores and drafts made before file fingerprints record
  this one for every target.

``target_identity(section)`` is the target as a driver needs it: config, tokenizer, sizes (meta
tensors) and fingerprint, with no weights. ``fingerprint_problems`` compares a record with a target:
by files digest when both have one; a record of the older kind is compared by weights hash, which
for an identity loads the whole target once (said in the log).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any


from griffin.target import TargetAdapter, stop_token_ids
from griffin.target_files import files_sha256
from griffin.target_parts import HeadShaped, meta_model
from pipeline.config import TargetSection

logger = logging.getLogger(__name__)

FILES, WEIGHTS = "target_files_sha256", "target_weights_sha256"
SIZES = ("hidden_size", "vocab_size")
LINEAGE_ONLY = ("target_revision",)  # recorded, never compared: stores made before revisions stay valid


class TargetIdentity(HeadShaped):
    """A target read from files, without its weights: config, tokenizer, generation config and a
    skeleton on the meta device (its embedding, head and layers have shapes and no memory)."""

    def __init__(self, section: TargetSection):
        from transformers import AutoTokenizer, GenerationConfig

        from griffin.assets import resolve_target_path

        self.section, self.name, self.revision = section, section.name, section.revision
        self.files = resolve_target_path(section.name, section.revision)
        self.hf_config, skeleton = meta_model(self.files, self.revision)  # refused here as loading would
        self.tokenizer = AutoTokenizer.from_pretrained(self.files, revision=self.revision)
        try:
            self.generation_config = GenerationConfig.from_pretrained(self.files, revision=self.revision)
        except OSError:  # no generation_config.json: the model config's ids only
            self.generation_config = None
        self.embed_weight = skeleton.get_input_embeddings().weight  # (V, D), meta
        self.head_weight = skeleton.get_output_embeddings().weight  # (V, D), meta
        self.backbone = skeleton.get_decoder()
        self._weights_sha256: str | None = None

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.generation_config, self.hf_config, self.tokenizer)

    @property
    def weights_sha256(self) -> str:
        """The older identity, for records made before file digests: the whole target loaded once, on
        a CPU of the cluster (a Ray task, when Ray is up) rather than on the driver, whose node (the head)
        may not have the memory."""
        if self._weights_sha256 is None:
            import ray

            logger.warning(
                "loading the whole target %s once to compare it with a record made before file digests",
                self.name,
            )
            section = self.section.model_dump()
            if ray.is_initialized():
                self._weights_sha256 = ray.get(ray.remote(num_cpus=1)(_loaded_weights_sha256).remote(section))
            else:
                self._weights_sha256 = _loaded_weights_sha256(section)
        return self._weights_sha256


def _loaded_weights_sha256(section: dict[str, Any]) -> str:
    from pipeline.resources.targets import load_target

    return load_target(TargetSection(**section), device="cpu").weights_sha256


def target_identity(section: TargetSection) -> TargetAdapter | TargetIdentity:
    """The target without its weights; a ``target.tiny`` one is built (in memory, it has no files)."""
    if section.tiny is not None:
        from pipeline.resources.targets import load_target

        return load_target(section, device="cpu")
    return TargetIdentity(section)


def _sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def target_fingerprint(target: TargetAdapter | TargetIdentity) -> dict[str, Any]:
    """The record (module docstring), computed once per target object, plus ``target_revision`` when
    the target came from a hub revision."""
    cached = getattr(target, "_fingerprint", None)
    if cached is not None:
        return cached
    tokenizer = target.tokenizer
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    files = getattr(target, "files", None)
    identity = {FILES: files_sha256(files, target.revision)} if files else {WEIGHTS: target.weights_sha256}
    target._fingerprint = {
        "target_id": target.name,
        **identity,
        "tokenizer_sha256": _sha256_text(repr(sorted(vocab.items()))),
        "chat_template_sha256": _sha256_text(getattr(tokenizer, "chat_template", None)),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "architecture": target.hf_config.model_type,
    }
    if getattr(target, "revision", None):
        target._fingerprint["target_revision"] = target.revision
    return target._fingerprint


def fingerprint_problems(
    recorded: dict[str, Any],
    actual: dict[str, Any],
    weights_sha256: Callable[[], str],
    keys: tuple[str, ...] | None = None,
    words: tuple[str, str] = ("recorded", "this target"),
) -> list[str]:
    """How ``recorded`` differs from ``actual`` (a ``target_fingerprint`` and whatever else both hold),
    each problem as "<key>: <words[0]> X, <words[1]> Y": every key of ``actual`` (or of ``keys``) but
    the identities and ``LINEAGE_ONLY`` by equality, then the identity: files digests when both have
    one, else the weights hash (``weights_sha256()``, called only then). Empty when they fit."""
    theirs, ours = words
    problems = [
        f"{key}: {theirs} {recorded.get(key)!r}, {ours} {value!r}"
        for key, value in actual.items()
        if key not in (FILES, WEIGHTS, *LINEAGE_ONLY) and (keys is None or key in keys) and recorded.get(key) != value
    ]
    if FILES not in actual and WEIGHTS not in actual:
        return problems  # not a target's key
    if any(recorded.get(key) != actual[key] for key in SIZES if key in actual):
        return problems  # another architecture: the hashes can only differ too
    if FILES in recorded and FILES in actual:
        key, value = FILES, actual[FILES]
    elif WEIGHTS in recorded:
        key, value = WEIGHTS, actual.get(WEIGHTS) or weights_sha256()
    elif FILES in recorded:
        return problems + [f"{FILES}: {theirs} for a target read from files, {ours} one built in memory"]
    else:
        return problems + [f"{FILES}: {theirs} none (no identity of the target recorded)"]
    if recorded[key] != value:
        problems.append(f"{key}: {theirs} {str(recorded[key])[:12]}…, {ours} {str(value)[:12]}…")
    return problems
