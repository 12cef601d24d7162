"""Export formats of a draft directory: the name maps (data) and ``export_draft`` / ``load_export``
(docs/design.md §6). Layouts: griffin-upstream, hf, speculators and specforge (EAGLE-3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from griffin.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    bind_state,
    atomic_write,
    atomic_write_json,
    check_compatible,
    draft_config_json,
    read_draft_config,
)
from griffin.config import DraftConfig
from griffin.export_layouts import (
    EAGLE_UPSTREAM_NAMES,
    GRIFFIN_UPSTREAM_NAMES,
    HF_NAMES,
    eagle3_names,
)
from griffin.model import GriffinDraft

# EAGLE-3's layout (docs/design.md §6): vLLM speculators' ``Eagle3DraftModel`` keeps the one layer
# as ``layers.0``, SpecForge's ``LlamaForCausalLMEagle3`` (what SGLang loads) as ``midlayer``.
# Both store ``d2t`` as offsets (target id = draft id + d2t[draft id]) and ``t2d`` as a mask over
# the target vocabulary, so draft ids must ascend with target ids.
EAGLE3_LAYER_PREFIX = {"speculators": "layers.0", "specforge": "midlayer"}


# The speculators release whose loader the tests run against our export (tests/griffin/test_export_eagle3.py).
SPECULATORS_VERSION = "0.9.0"

UPSTREAM_EMBED, HF_EMBED = "embed_tokens.weight", "model.embed_tokens.weight"
UPSTREAM_WEIGHTS_NAME = "pytorch_model.bin"
EXPORT_LAYOUTS = ("griffin-upstream", "hf", "speculators", "specforge")


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


def ascending_vocab(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same draft with its reduced vocabulary in target-id order, as EAGLE-3's ``t2d`` mask
    implies: ``d2t`` sorted and the trainable head's rows permuted alike. Our own vocabularies are
    built sorted (``reduced_vocabulary``); a hand-made ``d2t`` may not be."""
    d2t = state.get("d2t")
    if d2t is None or bool((d2t[1:] > d2t[:-1]).all()):
        return state
    order = torch.argsort(d2t)
    return {**state, "d2t": d2t[order], "lm_head.weight": state["lm_head.weight"][order]}


def to_eagle3(
    state: dict[str, torch.Tensor], cfg: DraftConfig, embed_weight: torch.Tensor, layout: str
) -> dict[str, torch.Tensor]:
    """Our ``eagle3`` state dict -> speculators' or SpecForge's, with the target embedding as
    ``embed_tokens.weight`` and a reduced vocabulary as offset ``d2t`` + ``t2d`` mask."""
    eagle3 = cfg.decoder_input == "concat" and cfg.trainable_head and cfg.feature_layers and not cfg.token_enhanced_head
    if not eagle3:  # by structure, not name: an eagle3 variant with overridden parts is not EAGLE-3 either
        raise ValueError(
            f"--to {layout} writes EAGLE-3 drafts, and this one is {cfg.variant!r}: no EAGLE-3 loader runs its "
            "architecture. Export it with --to hf (or --to griffin-upstream for a full-vocabulary GRIFFIN draft)"
        )
    state = dict(ascending_vocab(state))
    d2t = state.pop("d2t", None)
    tensors = {
        **_rename(state, eagle3_names(EAGLE3_LAYER_PREFIX[layout]), f"to_{layout}"),
        UPSTREAM_EMBED: embed_weight,
    }
    if d2t is not None:
        tensors["d2t"] = d2t - torch.arange(d2t.numel())
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        tensors["t2d"] = t2d
    return tensors


def from_eagle3(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A speculators or SpecForge EAGLE-3 state dict -> (our state dict, the embedding it carried)."""
    tensors = dict(tensors)
    embed = tensors.pop(UPSTREAM_EMBED, None)
    tensors.pop("t2d", None)
    offsets = tensors.pop("d2t", None)
    layout = "specforge" if any(k.startswith("midlayer.") for k in tensors) else "speculators"
    state = _rename(tensors, _inverse(eagle3_names(EAGLE3_LAYER_PREFIX[layout])), f"from_{layout}")
    if offsets is not None:
        state["d2t"] = offsets + torch.arange(offsets.numel())
    return state, embed


def _eagle3_layer_config(cfg: DraftConfig, dtype: torch.dtype) -> dict[str, Any]:
    """EAGLE-3's decoder layer as transformers ``LlamaConfig`` fields (the target's vocabulary)."""
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **_dtype_fields(dtype),
    }


def _dtype_fields(dtype: torch.dtype) -> dict[str, str]:
    name = str(dtype).removeprefix("torch.")
    return {"dtype": name, "torch_dtype": name}  # transformers 5 reads dtype, 4.x (older vLLM) torch_dtype


def eagle3_config(
    cfg: DraftConfig, layout: str, dtype: torch.dtype, verifier: dict[str, Any], provenance: dict[str, Any]
) -> dict[str, Any]:
    """``config.json`` of an EAGLE-3 export, plus our ``griffin`` section for a bit-exact reload.

    - speculators: ``Eagle3SpeculatorConfig`` (what vLLM reads): the layer config nested, the target
      layers as ``eagle_aux_hidden_state_layer_ids`` (HF hidden_states indices, as vLLM numbers
      them), and ``speculators_config.verifier`` = ``verifier`` (``name_or_path``, ``architectures``).
    - specforge: the flat ``LlamaForCausalLMEagle3`` config, the layers under ``eagle_config`` in
      SpecForge's and SGLang's numbering, by decoder-layer output (``specforge_layer_ids``)."""
    layers, ours = (
        list(cfg.feature_layers or ()),
        {"griffin": cfg.model_dump(), "provenance": provenance, "layout": layout},
    )
    layer = _eagle3_layer_config(cfg, dtype)
    if layout == "specforge":
        return {
            **layer,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.active_vocab_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": specforge_layer_ids(layers),
                "use_aux_hidden_state": True,
            },
            **ours,
        }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        **_dtype_fields(dtype),
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.active_vocab_size,
        "eagle_aux_hidden_state_layer_ids": layers,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        },
        **ours,
    }


def specforge_layer_ids(hidden_state_ids: list[int]) -> list[int]:
    """HF ``hidden_states`` indices -> SpecForge's / SGLang's target layer ids. HF index i is the
    output of decoder layer i (0 = the embeddings); SpecForge numbers decoder layers from 0 and
    names a layer by its output, and SGLang captures id + 1 (the input of the next layer). E.g. a
    30-layer target's (2, 15, 27) is SpecForge's default [1, 14, 26] (1, L/2-1, L-4)."""
    if min(hidden_state_ids, default=1) < 1:
        raise ValueError("SpecForge cannot name hidden_states[0] (the embeddings) as a target layer")
    return [i - 1 for i in hidden_state_ids]


def eagle3_draft_config(raw: dict[str, Any]) -> DraftConfig:
    """The DraftConfig of an EAGLE-3 directory: ours when we wrote it, else read from the
    speculators or SpecForge config of a draft trained elsewhere."""
    if "griffin" in raw:
        return DraftConfig(**raw["griffin"])
    layer = raw.get("transformer_layer_config") or raw
    unsupported = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
    if layer.get("num_hidden_layers", 1) != 1:
        unsupported.append(f"num_hidden_layers={layer['num_hidden_layers']}")
    if layer.get("head_dim") not in (None, layer["hidden_size"] // layer["num_attention_heads"]):
        unsupported.append(f"head_dim={layer['head_dim']}")
    if unsupported:
        raise ValueError(f"this EAGLE-3 draft uses {unsupported}, which the draft here does not implement")
    # speculators (vLLM) name HF hidden_states indices at the top level; SpecForge names layer outputs
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    specforge_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids and specforge_ids:
        ids = [i + 1 for i in specforge_ids]
    if not ids:
        raise ValueError(
            "config.json names no target layers: add eagle_aux_hidden_state_layer_ids (speculators: "
            "HF hidden_states indices, e.g. [2, L/2, L-3] for an L-layer target; SpecForge: under "
            "eagle_config, decoder-layer outputs, e.g. [1, L/2-1, L-4])"
        )
    rope = layer.get("rope_parameters") or {}
    vocab, draft_vocab = layer["vocab_size"], raw.get("draft_vocab_size")
    return DraftConfig(
        variant="eagle3",
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        vocab_size=vocab,
        draft_vocab_size=None if draft_vocab in (None, vocab) else draft_vocab,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        token_guided_fusion=False,
        token_enhanced_head=False,
        feature_layers=tuple(ids),
        decoder_input="concat",
        trainable_head=True,
    )


def _is_eagle3(raw: dict[str, Any]) -> bool:
    return raw.get("speculators_model_type") == "eagle3" or "LlamaForCausalLMEagle3" in (raw.get("architectures") or [])


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
    """(DraftConfig, our state dict, embedding or None) of a directory in any export layout."""
    path = Path(path)
    if (path / UPSTREAM_WEIGHTS_NAME).is_file():
        raw = json.loads((path / CONFIG_NAME).read_text())
        upstream = torch.load(path / UPSTREAM_WEIGHTS_NAME, map_location="cpu", weights_only=True)
        state, embed = from_upstream(upstream)
        return upstream_draft_config(raw, upstream), state, embed
    raw = json.loads((path / CONFIG_NAME).read_text()) if (path / CONFIG_NAME).is_file() else {}
    if _is_eagle3(raw):
        state, embed = from_eagle3(load_file(path / WEIGHTS_NAME))
        return eagle3_draft_config(raw), state, embed
    cfg, raw = read_draft_config(path)
    if raw.get("layout") != "hf":
        raise ValueError(
            f"{path} is not a griffin-upstream ({UPSTREAM_WEIGHTS_NAME}), hf, speculators or specforge export"
        )
    state, embed = from_hf(load_file(path / WEIGHTS_NAME))
    return cfg, state, embed


def load_export(path: str | Path, target: Any, dtype: torch.dtype | None = None) -> GriffinDraft:
    """Load an exported directory (either layout, including official GRIFFIN/EAGLE checkpoints)."""
    cfg, state, embed = read_export(path)
    check_compatible(cfg, target)
    if embed is not None and embed.shape != target.embed_weight.shape:
        raise ValueError(f"{path}: embed_tokens {tuple(embed.shape)} != target's {tuple(target.embed_weight.shape)}")
    return bind_state(cfg, state, target, str(path), dtype)


def _export_config(cfg: DraftConfig, provenance: dict[str, Any], layout: str, dtype: torch.dtype) -> dict[str, Any]:
    config = {**draft_config_json(cfg, provenance), "layout": layout}
    if layout == "griffin-upstream":  # what the official EConfig / LlamaConfig loader reads
        config.update(
            architectures=["LlamaForCausalLM"], tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch.")
        )
    return config


def export_draft(path: str | Path, out: str | Path, layout: str, target: Any, verifier: str | None = None) -> Path:
    """Write draft directory ``path`` in ``layout`` under ``out``, then reload it and check that every
    tensor (and the embedding) comes back bit-exactly.

    - ``griffin-upstream``: ``config.json`` (LlamaConfig fields + ``bias``) and ``pytorch_model.bin``
      (a plain tensor dict, ``GRIFFIN_UPSTREAM_NAMES`` or ``EAGLE_UPSTREAM_NAMES`` + ``embed_tokens.weight``).
    - ``hf``: ``config.json`` (+ ``layout: hf``) and ``model.safetensors`` with ``HF_NAMES`` +
      ``model.embed_tokens.weight``; keeps a reduced vocabulary's ``d2t``.
    - ``speculators`` / ``specforge`` (``eagle3`` drafts only): ``config.json`` (``eagle3_config``) and
      ``model.safetensors`` with ``eagle3_names``. ``verifier`` is the target as the consumer should
      load it (an HF id or a path; default: where this target was loaded from)."""
    if layout not in EXPORT_LAYOUTS:
        raise ValueError(f"unknown export layout {layout!r}; choose one of {EXPORT_LAYOUTS}")
    cfg, raw = read_draft_config(path)
    check_compatible(cfg, target)
    state = load_file(Path(path) / WEIGHTS_NAME)
    embed = target.embed_weight.detach().cpu().contiguous()
    provenance = raw.get("provenance") or {}
    weights_name = UPSTREAM_WEIGHTS_NAME if layout == "griffin-upstream" else WEIGHTS_NAME
    if layout == "griffin-upstream":
        tensors, config = to_upstream(state, cfg, embed), _export_config(cfg, provenance, layout, embed.dtype)
    elif layout == "hf":
        tensors, config = to_hf(state, embed), _export_config(cfg, provenance, layout, embed.dtype)
    else:
        tensors = to_eagle3(state, cfg, embed, layout)
        state = ascending_vocab(state)  # what the export holds, draft ids in target-id order
        hf_config = target.hf_config.get_text_config()
        verifier_config = {
            "name_or_path": verifier or getattr(hf_config, "_name_or_path", None) or None,
            "architectures": list(getattr(target.hf_config, "architectures", None) or [type(target.model).__name__]),
        }
        config = eagle3_config(cfg, layout, tensors["fc.weight"].dtype, verifier_config, provenance)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "griffin-upstream":
        atomic_write(out / weights_name, lambda tmp: torch.save(tensors, tmp))
    else:
        atomic_write(
            out / weights_name,
            lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"}),
        )
    atomic_write_json(out / CONFIG_NAME, config)
    _check_export(out, cfg, state, embed)
    load_export(out, target)  # and it binds to the target strictly
    return out


def _check_export(out: Path, cfg: DraftConfig, state: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    cfg_back, state_back, embed_back = read_export(out)
    problems = [] if cfg_back == cfg else [f"config {cfg_back} != {cfg}"]
    if set(state_back) != set(state):
        problems.append(f"keys differ: {sorted(set(state) ^ set(state_back))}")
    problems += [
        f"{key} differs"
        for key in sorted(set(state) & set(state_back))
        if state[key].dtype != state_back[key].dtype or not torch.equal(state[key], state_back[key])
    ]
    if embed_back is None or not torch.equal(embed_back, embed):
        problems.append("embed_tokens differs from the target's")
    if problems:
        raise RuntimeError(f"export {out} does not reload bit-exactly: " + "; ".join(problems))
