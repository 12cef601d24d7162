"""Draft directories: save, strict load, and export maps (docs/design.md §6).

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
    return _bind(cfg, load_file(weights), target, str(weights), dtype)


def _bind(cfg: DraftConfig, state: dict[str, torch.Tensor], target: Any, source: str,
          dtype: torch.dtype | None = None) -> GriffinDraft:
    """Build on meta, check keys and shapes strictly, then adopt the tensors."""
    with torch.device("meta"):
        draft = GriffinDraft(cfg, target.embed_weight, target.head_weight, state.get("d2t"))
    check_state_dict(draft, state, source)
    draft.load_state_dict(state, strict=True, assign=True)
    draft = draft.to(target.device)
    return draft.cast_parameters(dtype) if dtype is not None else draft


# ---- export layoutsthe name maps are data) ------------------------------------
# Each map is {our state-dict name: the layout's name}. Frozen target tensors are not ours to map:
# exports that need the embedding add it under the layout's own name.

LAYER_UPSTREAM_NAMES: dict[str, str] = {
    "layer.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "layer.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "layer.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "layer.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "layer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",  # RMSNorm_C
    "layer.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "layer.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "layer.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",  # 2H x I with TEH
}

# The official GRIFFIN draft (``cnets1``), docs/method.md §2.5.
GRIFFIN_UPSTREAM_NAMES: dict[str, str] = {
    "fusion.fc.weight": "fc.fc.weight",
    "fusion.fc.bias": "fc.fc.bias",
    "fusion.fc_norm.weight": "fc.post_attention_layernorm.weight",  # RMSNorm_A
    "fusion.expand_norm.weight": "fc.mlp.input_layernorm.weight",  # RMSNorm_B
    "fusion.up_proj.weight": "fc.mlp.up_proj.weight",
    "fusion.down_proj.weight": "fc.mlp.down_proj.weight",
    **LAYER_UPSTREAM_NAMES,
}

# The official EAGLE draft (``cnets``), which our EAGLE and HASS variants match.
EAGLE_UPSTREAM_NAMES: dict[str, str] = {
    "fusion.fc.weight": "fc.weight",
    "fusion.fc.bias": "fc.bias",
    **LAYER_UPSTREAM_NAMES,
}

# ``--to hf``: transformers' CausalLM convention (everything under ``model.``, the layer as
# ``model.layers.0``), with the GRIFFIN-only fusion weights under ``model.fusion``. ``d2t`` keeps
# absolute target ids (EAGLE-3 checkpoints store offsets ``d2t[i] - i`` instead).
HF_NAMES: dict[str, str] = {
    "fusion.fc.weight": "model.fc.weight",
    "fusion.fc.bias": "model.fc.bias",
    "fusion.fc_norm.weight": "model.fusion.fc_norm.weight",
    "fusion.expand_norm.weight": "model.fusion.expand_norm.weight",
    "fusion.up_proj.weight": "model.fusion.up_proj.weight",
    "fusion.down_proj.weight": "model.fusion.down_proj.weight",
    **{ours: f"model.{upstream}" for ours, upstream in LAYER_UPSTREAM_NAMES.items()},
    "d2t": "d2t",
}

UPSTREAM_EMBED, HF_EMBED = "embed_tokens.weight", "model.embed_tokens.weight"
UPSTREAM_WEIGHTS_NAME = "pytorch_model.bin"
EXPORT_LAYOUTS = ("griffin-upstream", "hf")


def _rename(state: dict[str, torch.Tensor], names: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise ValueError(f"{what}: no mapping for keys {unknown}; mapped names are {sorted(names)}")
    return {names[key]: tensor for key, tensor in state.items()}


def _inverse(names: dict[str, str]) -> dict[str, str]:
    return {theirs: ours for ours, theirs in names.items()}


def upstream_names(cfg: DraftConfig) -> dict[str, str]:
    """GRIFFIN's map with Token-Guided Fusion, EAGLE's (a plain fc) without."""
    return GRIFFIN_UPSTREAM_NAMES if cfg.token_guided_fusion else EAGLE_UPSTREAM_NAMES


def to_upstream(
    state: dict[str, torch.Tensor], cfg: DraftConfig, embed_weight: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Our state dict -> the official repository's, with the target embedding as ``embed_tokens.weight``."""
    if cfg.draft_vocab_size is not None:
        raise ValueError(
            f"this draft has a reduced vocabulary (draft_vocab_size={cfg.draft_vocab_size}, a d2t map) that the "
            "official GRIFFIN code cannot load; export it with --to hf instead"
        )
    return {**_rename(state, upstream_names(cfg), "to_upstream"), UPSTREAM_EMBED: embed_weight}


def from_upstream(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """An official GRIFFIN or EAGLE state dict -> (our state dict, the embedding it carried)."""
    state = dict(state)
    embed = state.pop(UPSTREAM_EMBED, None)
    names = GRIFFIN_UPSTREAM_NAMES if "fc.fc.weight" in state else EAGLE_UPSTREAM_NAMES
    return _rename(state, _inverse(names), "from_upstream"), embed


def to_hf(state: dict[str, torch.Tensor], embed_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**_rename(state, HF_NAMES, "to_hf"), HF_EMBED: embed_weight}


def from_hf(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    state = dict(state)
    embed = state.pop(HF_EMBED, None)
    return _rename(state, _inverse(HF_NAMES), "from_hf"), embed


def upstream_draft_config(raw: dict[str, Any], state: dict[str, torch.Tensor]) -> DraftConfig:
    """The DraftConfig of an upstream checkpoint: ours when we wrote it, else inferred from the
    official ``config.json`` and the weights (TGF from ``fc.fc.*``, TEH from the 2H-wide down_proj)."""
    if "griffin" in raw:
        return DraftConfig(**raw["griffin"])
    fusion = "fc.fc.weight" in state
    hidden = raw["hidden_size"]
    return DraftConfig(
        variant="griffin" if fusion else "eagle",
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta") or 10000.0,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        token_guided_fusion=fusion,
        token_enhanced_head=state["layers.0.mlp.down_proj.weight"].shape[0] == 2 * hidden,
        fc_bias=raw.get("bias", True),  # the official loader's default when the key is absent
    )


def read_export(path: str | Path) -> tuple[DraftConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """(DraftConfig, our state dict, embedding or None) of an upstream-layout or hf-layout directory."""
    path = Path(path)
    if (path / UPSTREAM_WEIGHTS_NAME).is_file():
        raw = json.loads((path / CONFIG_NAME).read_text())
        upstream = torch.load(path / UPSTREAM_WEIGHTS_NAME, map_location="cpu", weights_only=True)
        state, embed = from_upstream(upstream)
        return upstream_draft_config(raw, upstream), state, embed
    cfg, raw = read_draft_config(path)
    if raw.get("layout") != "hf":
        raise ValueError(f"{path} is neither a griffin-upstream ({UPSTREAM_WEIGHTS_NAME}) nor an hf export")
    state, embed = from_hf(load_file(path / WEIGHTS_NAME))
    return cfg, state, embed


def load_export(path: str | Path, target: Any, dtype: torch.dtype | None = None) -> GriffinDraft:
    """Load an exported directory (either layout, including official GRIFFIN/EAGLE checkpoints)."""
    cfg, state, embed = read_export(path)
    check_compatible(cfg, target)
    if embed is not None and embed.shape != target.embed_weight.shape:
        raise ValueError(f"{path}: embed_tokens {tuple(embed.shape)} != target's {tuple(target.embed_weight.shape)}")
    return _bind(cfg, state, target, str(path), dtype)


def _export_config(cfg: DraftConfig, provenance: dict[str, Any], layout: str, dtype: torch.dtype) -> dict[str, Any]:
    config = {**draft_config_json(cfg, provenance), "layout": layout}
    if layout == "griffin-upstream":  # what the official EConfig / LlamaConfig loader reads
        config.update(architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                      torch_dtype=str(dtype).removeprefix("torch."))
    return config


def export_draft(path: str | Path, out: str | Path, layout: str, target: Any) -> Path:
    """Write draft directory ``path`` in ``layout`` under ``out``, then reload it and check that every
    tensor (and the embedding) comes back bit-exactly.

    - ``griffin-upstream``: ``config.json`` (LlamaConfig fields + ``bias``) and ``pytorch_model.bin``
      (a plain tensor dict, ``GRIFFIN_UPSTREAM_NAMES`` or ``EAGLE_UPSTREAM_NAMES`` + ``embed_tokens.weight``).
    - ``hf``: ``config.json`` (+ ``layout: hf``) and ``model.safetensors`` with ``HF_NAMES`` +
      ``model.embed_tokens.weight``; keeps a reduced vocabulary's ``d2t``."""
    if layout not in EXPORT_LAYOUTS:
        raise ValueError(f"unknown export layout {layout!r}; choose one of {EXPORT_LAYOUTS}")
    cfg, raw = read_draft_config(path)
    check_compatible(cfg, target)
    state = load_file(Path(path) / WEIGHTS_NAME)
    embed = target.embed_weight.detach().cpu().contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "griffin-upstream":
        tensors, weights_name = to_upstream(state, cfg, embed), UPSTREAM_WEIGHTS_NAME
    else:
        tensors, weights_name = to_hf(state, embed), WEIGHTS_NAME
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{weights_name}.")
    os.close(fd)
    if layout == "griffin-upstream":
        torch.save(tensors, tmp)
    else:
        save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, out / weights_name)
    _atomic_write_json(out / CONFIG_NAME, _export_config(cfg, raw.get("provenance") or {}, layout, embed.dtype))
    _check_export(out, cfg, state, embed)
    load_export(out, target)  # and it binds to the target strictly
    return out


def _check_export(out: Path, cfg: DraftConfig, state: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    cfg_back, state_back, embed_back = read_export(out)
    problems = [] if cfg_back == cfg else [f"config {cfg_back} != {cfg}"]
    if set(state_back) != set(state):
        problems.append(f"keys differ: {sorted(set(state) ^ set(state_back))}")
    problems += [
        f"{key} differs" for key in sorted(set(state) & set(state_back))
        if state[key].dtype != state_back[key].dtype or not torch.equal(state[key], state_back[key])
    ]
    if embed_back is None or not torch.equal(embed_back, embed):
        problems.append("embed_tokens differs from the target's")
    if problems:
        raise RuntimeError(f"export {out} does not reload bit-exactly: " + "; ".join(problems))
