"""Draft directories: save, strict load, and export maps (DESIGN.md "Checkpoints and export").

A draft directory holds ``config.json`` (HF LlamaConfig fields + ``architectures: ["GriffinDraft"]``
+ our ``DraftConfig`` + provenance) and ``model.safetensors`` with the trainable weights (and the
``d2t`` map of a reduced vocabulary) but never the frozen target embedding / LM head, which are
re-bound from the target on load.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def _atomic_write_json(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def save_draft(draft: GriffinDraft, path: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (trainable weights and d2t only)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{WEIGHTS_NAME}.")
    os.close(fd)
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, path / WEIGHTS_NAME)
    _atomic_write_json(path / CONFIG_NAME, draft_config_json(draft.cfg, provenance))
    return path


def read_draft_config(path: str | Path) -> tuple[DraftConfig, dict[str, Any]]:
    """The DraftConfig and the full config.json of a draft directory."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a draft directory needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    raw = json.loads(config_path.read_text())
    if "griffin" not in raw:
        raise ValueError(f"{config_path} has no 'griffin' section: not a draft saved by griffin.weights.save_draft")
    return DraftConfig(**raw["griffin"]), raw


def check_compatible(cfg: DraftConfig, target: Any) -> None:
    """Refuse a draft built for another target (width and vocabulary must match)."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target {target.vocab_size}")
    if problems:
        raise ValueError(f"draft does not fit target {target.name!r}: " + "; ".join(problems))


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict key and shape check with a message that lists every problem."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(state) & set(expected) if state[k].shape != expected[k].shape
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
    state = load_file(weights)
    with torch.device("meta"):
        draft = GriffinDraft(cfg, target.embed_weight, target.head_weight, state.get("d2t"))
    check_state_dict(draft, state, str(weights))
    draft.load_state_dict(state, strict=True, assign=True)
    draft = draft.to(target.device)
    return draft.to(dtype) if dtype is not None else draft
