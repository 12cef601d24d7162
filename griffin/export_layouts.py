"""The export layouts' weight names, as data (docs/design.md §6): each map is {our state-dict name: the
layout's name}. Frozen target tensors are not ours to map: exports that need the embedding add it under the
layout's own name (``griffin.export``)."""

from __future__ import annotations


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
    # the multi-layer variants (EAGLE-3, GRIFFIN-3): the feature fc, EAGLE-3's input norms, GRIFFIN-3's
    # feature norm, and the draft's own final norm and head
    "feature_fc.weight": "model.feature_fc.weight",
    "fusion.input_layernorm.weight": "model.input_layernorm.weight",
    "fusion.hidden_norm.weight": "model.hidden_norm.weight",
    "feature_norm.weight": "model.feature_norm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
}


# EAGLE-3's layout (docs/design.md §6): vLLM speculators' ``Eagle3DraftModel`` keeps the one layer
# as ``layers.0``, SpecForge's ``LlamaForCausalLMEagle3`` (what SGLang loads) as ``midlayer``.
def eagle3_names(layer_prefix: str) -> dict[str, str]:
    return {
        "feature_fc.weight": "fc.weight",
        "fusion.input_layernorm.weight": f"{layer_prefix}.input_layernorm.weight",  # the embedding's norm
        "fusion.hidden_norm.weight": f"{layer_prefix}.hidden_norm.weight",  # the fused features' norm
        **{ours: theirs.replace("layers.0", layer_prefix) for ours, theirs in LAYER_UPSTREAM_NAMES.items()},
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
