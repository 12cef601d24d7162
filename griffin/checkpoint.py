"""Draft directories: save and strict load (docs/design.md §6); export formats live in ``griffin.export``.

A draft directory holds ``config.json`` (HF LlamaConfig fields + ``architectures: ["GriffinDraft"]``
+ our ``DraftConfig`` + provenance) and ``model.safetensors`` with the trainable weights (and the
``d2t`` map of a reduced vocabulary) but never the frozen target embedding / LM head, which are
re-bound from the target on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from griffin.config import DraftConfig
from griffin.model import GriffinDraft

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def draft_config_json(cfg: DraftConfig, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF LlamaConfig-shaped fields (what upstream loaders read) plus the exact DraftConfig."""
    return {
        "architectures": ["GriffinDraft"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.active_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "bias": cfg.fc_bias,
        "griffin": cfg.model_dump(),
        "provenance": provenance or {},
    }


def atomic_write(path: str | Path, write: Callable[[str], Any]) -> Path:
    """The one write-temp-then-rename: ``write(tmp)`` fills a temporary file beside ``path``, which then
    replaces ``path`` in one step, so a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a copied file from other users (a serving account)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def save_draft(draft: GriffinDraft, path: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (trainable weights and d2t only)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_json(path / CONFIG_NAME, draft_config_json(draft.cfg, provenance))
    return path


def read_draft_config(path: str | Path) -> tuple[DraftConfig, dict[str, Any]]:
    """The DraftConfig and the full config.json of a draft directory."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a draft directory needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    raw = json.loads(config_path.read_text())
    if "griffin" not in raw:
        raise ValueError(f"{config_path} has no 'griffin' section: not a draft saved by griffin.checkpoint.save_draft")
    return DraftConfig(**raw["griffin"]), raw


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The one weights hash of the project: sha256 over every tensor's name, shape and bytes, in
    name order. A target's state dict, a draft directory's file and a training checkpoint are all
    identified by it, independent of file metadata and of where the files live. Floating tensors
    are hashed as bf16, so the same weights loaded in bf16 or fp32 (the dtype depends on the
    machine) are the same weights, while any other model differs."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        canonical = tensor.detach().to(torch.bfloat16) if tensor.is_floating_point() else tensor.detach()
        digest.update(f"{name}:{tuple(tensor.shape)}:{canonical.dtype}".encode())
        digest.update(canonical.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_sha256(path: str | Path) -> str:
    """``tensors_sha256`` of a draft directory's weights file."""
    return tensors_sha256(load_file(Path(path) / WEIGHTS_NAME))


def check_compatible(cfg: DraftConfig, target: Any) -> None:
    """Refuse a draft built for another target (width and vocabulary must match)."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target {target.vocab_size}")
    layers = target.hf_config.get_text_config().num_hidden_layers
    if cfg.feature_layers and max(cfg.feature_layers) > layers:
        problems.append(f"feature_layers {list(cfg.feature_layers)} beyond the target's {layers} layers")
    if problems:
        raise ValueError(f"draft does not fit target {target.name!r}: " + "; ".join(problems))


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict key and shape check with a message that lists every problem."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    if missing or unexpected or shapes:
        raise ValueError(
            f"cannot load {source}: missing keys {missing}; unexpected keys {unexpected}; shape mismatches {shapes}"
        )


def load_draft(path: str | Path, target: Any, dtype: torch.dtype | None = None) -> GriffinDraft:
    """Load a draft directory and bind it to ``target``'s frozen embedding and LM head."""
    cfg, _ = read_draft_config(path)
    check_compatible(cfg, target)
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found")
    return bind_state(cfg, load_file(weights), target, str(weights), dtype)


def bind_state(
    cfg: DraftConfig, state: dict[str, torch.Tensor], target: Any, source: str, dtype: torch.dtype | None = None
) -> GriffinDraft:
    """Build on meta, check keys and shapes strictly, then adopt the tensors."""
    with torch.device("meta"):
        draft = GriffinDraft(cfg, target.embed_weight, target.head_weight, state.get("d2t"))
    check_state_dict(draft, state, source)
    draft.load_state_dict(state, strict=True, assign=True)
    draft = draft.to(target.device)
    return draft.cast_parameters(dtype) if dtype is not None else draft
