"""The target families decoding is tested on, and the refusal of every other one at load.

Speculative decoding is lossless only if a verify pass over a token tree computes, for every node, what
the target computes for that token after the node's own prefix. That holds for a family when every
layer's state is a per-position cache that can be cut back to the accepted path (keys and values, or the
compressed latent of latent attention), and when every layer's attention pattern can be written as a
mask over (prefix + tree). This module is the one place that says which
families meet that, how each one's layers attend (``AttentionLayout``), and why the others are refused.

Layer kinds: "full_attention" (every earlier position) and "sliding_attention" (the last ``window``
positions, the token itself included: transformers' ``q - kv < window``). A family reads its kinds
from its config in one of three ways (``Family.windows``):
- "layer_types": ``config.layer_types`` names each layer's kind, ``config.sliding_window`` the window;
- "all_layers": every layer is windowed when ``config.sliding_window`` is set (Mistral, Phi-3);
- "none": every layer attends fully.

Each family listed here runs the family matrix in tests/griffin/test_families.py (T=0 exactness against
HF greedy with windows smaller than the context, alone and batched, T>0 law, training, export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' config.model_type
    name: str  # what a user calls it
    windows: Literal["layer_types", "all_layers", "none"]
    sdpa: bool = True  # False: transformers has no SDPA path for it (softcapping, sinks): eager attention
    uses: str = ""  # what else it brings that decoding was tested with
    # what a layer caches per position: keys and values per KV head, or (latent attention) one compressed
    # latent and one shared RoPE key, the two widths differing
    cache: Literal["heads", "latent"] = "heads"

    @property
    def attn_implementation(self) -> str:
        """What the family loads with: SDPA, or eager attention where transformers has no SDPA path."""
        return "sdpa" if self.sdpa else "eager"


_MLA = "multi-head latent attention (the compressed KV latent is cached), MoE routing with shared experts"
FAMILIES = {
    f.model_type: f
    for f in [
        Family("llama", "Llama", "none", uses="RoPE scaling (llama3, yarn, linear)"),
        Family("granite", "Granite", "none", uses="embedding, residual, attention and logit multipliers"),
        Family("olmo2", "OLMo-2", "none", uses="QK norm, post-norm blocks"),
        Family("olmoe", "OLMoE", "none", uses="MoE routing, QK norm"),
        Family("gemma", "Gemma", "none", uses="scaled embeddings, GeGLU"),
        Family("mistral", "Mistral", "all_layers"),
        Family("mixtral", "Mixtral", "all_layers", uses="MoE routing"),
        Family("phi3", "Phi-3", "all_layers", uses="fused QKV and gate/up projections, partial RoPE scaling"),
        Family("starcoder2", "StarCoder2", "all_layers", uses="biases, LayerNorm, GELU MLP"),
        Family("qwen2", "Qwen2", "layer_types", uses="QKV biases"),
        Family("qwen2_moe", "Qwen2-MoE", "layer_types", uses="MoE routing with a shared expert"),
        Family("qwen3", "Qwen3", "layer_types", uses="QK norm"),
        Family("qwen3_moe", "Qwen3-MoE", "all_layers", uses="MoE routing, QK norm"),
        Family("smollm3", "SmolLM3", "layer_types", uses="layers without RoPE"),
        Family("gemma2", "Gemma-2", "layer_types", sdpa=False, uses="attention and final-logit softcapping"),
        Family("gemma3_text", "Gemma-3 (text)", "layer_types", uses="a local RoPE base on windowed layers, QK norm"),
        Family("cohere2", "Cohere2", "layer_types", uses="parallel blocks, logit scale, RoPE on windowed layers only"),
        Family("gpt_oss", "gpt-oss", "layer_types", sdpa=False, uses="attention sinks, MoE routing, YaRN RoPE"),
        Family("ministral", "Ministral", "layer_types"),
        Family("olmo3", "OLMo-3", "layer_types", uses="QK norm, post-norm blocks"),
        Family("exaone4", "EXAONE-4", "layer_types", uses="QK norm, layers without RoPE"),
        Family("phimoe", "Phi-3.5-MoE", "all_layers", uses="MoE routing"),
        Family("granitemoe", "Granite-MoE", "none", uses="MoE routing, Granite's multipliers"),
        Family("granitemoeshared", "Granite-MoE (shared experts)", "none", uses="MoE routing with a shared expert"),
        Family("olmo", "OLMo", "none", uses="non-parametric LayerNorm"),
        Family("cohere", "Cohere (Command-R)", "none", uses="parallel blocks, logit scale"),
        Family("glm", "GLM", "none", uses="partial RoPE"),
        Family("glm4", "GLM-4", "none", uses="partial RoPE, post-norms"),
        Family("stablelm", "StableLM", "none", uses="partial RoPE, LayerNorm"),
        Family("helium", "Helium", "none"),
        Family("seed_oss", "Seed-OSS", "none"),
        Family("hunyuan_v1_dense", "Hunyuan (dense)", "none", uses="QK norm"),
        Family("hunyuan_v1_moe", "Hunyuan (MoE)", "none", uses="QK norm, MoE routing"),
        Family("arcee", "Arcee (AFM)", "none", uses="ReLU² MLP"),
        Family("apertus", "Apertus", "none", uses="xIELU activation, QK norm"),
        Family("ernie4_5", "ERNIE-4.5", "none"),
        Family("ernie4_5_moe", "ERNIE-4.5-MoE", "none", uses="MoE routing"),
        Family("nemotron", "Nemotron", "none", uses="partial RoPE, LayerNorm1P"),
        Family("jetmoe", "JetMoE", "none", uses="mixture of attention heads, MoE routing"),
        Family("vaultgemma", "VaultGemma", "layer_types", sdpa=False, uses="softcapping"),
        Family("deepseek_v2", "DeepSeek-V2", "none", uses=_MLA, cache="latent"),
        Family("deepseek_v3", "DeepSeek-V3 / Kimi-K2", "none", uses=_MLA + ", group-limited routing", cache="latent"),
    ]
}

_RECURRENT = (
    "recurrent or linear-attention layers keep a running state that cannot be cut back to the accepted "
    "prefix after a rejected draft token, the way a KV cache can"
)
# Families known by name, with why each is refused; anything else unlisted is refused as untested.
REFUSED = {
    "deepseek_v32": "sparse attention: a learned indexer with its own cache picks the keys each token attends to",
    "llama4": "chunked attention, and attention temperature taken from cache positions rather than token positions",
    "llama4_text": "chunked attention, and attention temperature taken from cache positions rather than token positions",
    "gemma3": "the multimodal Gemma-3 model; load its text-only model (model_type gemma3_text)",
    "gemma3n": "KV caches shared across layers and per-layer input streams (AltUp)",
    **{
        t: _RECURRENT
        for t in (
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "lfm2",
            "lfm2_moe",
            "jamba",
            "bamba",
            "falcon_h1",
            "falcon_mamba",
            "mamba",
            "mamba2",
            "zamba",
            "zamba2",
            "nemotron_h",
            "granitemoehybrid",
            "recurrent_gemma",
            "rwkv",
            "minimax",
            "kimi_linear",
            "olmo_hybrid",
            "xlstm",
        )
    },
}


class UnsupportedTarget(ValueError):
    """A target this project cannot decode losslessly; the message names the family and says why."""


def supported_families() -> str:
    """The tested families, for messages: "Llama (llama), Mistral (mistral), ..."."""
    return ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())


def _refuse(model_type: str, why: str) -> UnsupportedTarget:
    return UnsupportedTarget(
        f"target family {model_type!r} is not supported: {why}. Speculative decoding would crash or silently "
        f"differ from the target's own output. Supported families: {supported_families()}"
    )


def family_of(hf_config: Any) -> Family:
    """The tested family of ``hf_config``, or ``UnsupportedTarget`` naming it and why it is refused."""
    model_type = getattr(hf_config, "model_type", None) or "unknown"
    if model_type in REFUSED:
        raise _refuse(model_type, REFUSED[model_type])
    if model_type not in FAMILIES:
        raise _refuse(model_type, "it is not among the families whose decoding is tested token for token")
    return FAMILIES[model_type]


@dataclass(frozen=True)
class AttentionLayout:
    """How a target's layers attend: the family, each layer's kind and the window of windowed layers."""

    family: Family
    layer_kinds: tuple[str, ...]  # one per layer: FULL or SLIDING
    window: int | None  # positions a windowed layer sees, itself included; None without windowed layers

    @classmethod
    def of(cls, hf_config: Any) -> "AttentionLayout":
        """The layout of a config, or ``UnsupportedTarget`` (family, layer kinds, chunked attention)."""
        family = family_of(hf_config)
        count = hf_config.num_hidden_layers
        window = getattr(hf_config, "sliding_window", None)
        if family.windows == "layer_types":
            kinds = tuple(getattr(hf_config, "layer_types", None) or [FULL] * count)
        elif family.windows == "all_layers" and window is not None:
            kinds = (SLIDING,) * count
        else:
            kinds = (FULL,) * count
        unknown = sorted(set(kinds) - {FULL, SLIDING})
        if unknown:
            raise _refuse(family.model_type, f"layer kinds {unknown} (only full and sliding-window attention are)")
        if getattr(hf_config, "attention_chunk_size", None):
            raise _refuse(family.model_type, "chunked attention")
        heads, kv_heads = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None)
        if family.cache == "latent" and kv_heads not in (None, heads):
            # transformers expands the latent to every query head, then repeats it again as for GQA
            raise _refuse(
                family.model_type,
                f"num_key_value_heads={kv_heads} with {heads} attention heads (latent attention expands to every "
                "head: set num_key_value_heads to num_attention_heads, as DeepSeek's own configs do)",
            )
        if SLIDING in kinds and not (isinstance(window, int) and window >= 1):
            raise _refuse(family.model_type, f"windowed layers with sliding_window={window!r}")
        return cls(family, kinds, window if SLIDING in kinds else None)

    def cache_shapes(self, hf_config: Any, rows: int, capacity: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's cached (keys, values) shapes, (rows, heads, capacity, width) each: per KV head, or
        for latent attention the compressed latent (width kv_lora_rank) and the shared RoPE key."""
        if self.family.cache == "latent":
            return (rows, 1, capacity, hf_config.kv_lora_rank), (rows, 1, capacity, hf_config.qk_rope_head_dim)
        heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        width = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return (rows, heads, capacity, width), (rows, heads, capacity, width)

    def describe(self, hf_config: Any) -> list[str]:
        """What the target uses, a line each, e.g. ["sliding window of 4096 tokens on 24 of 48 layers", ...]."""
        lines = []
        windowed = self.layer_kinds.count(SLIDING)
        if windowed:
            lines.append(f"sliding window of {self.window} tokens on {windowed} of {len(self.layer_kinds)} layers")
        else:
            lines.append(f"full attention on all {len(self.layer_kinds)} layers")
        rope = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "per layer kind"
        if rope_type != "default":
            lines.append(f"RoPE scaling: {rope_type}")
        experts = next(
            (getattr(hf_config, k) for k in ("num_local_experts", "num_experts") if hasattr(hf_config, k)), 0
        )
        if experts:
            lines.append(f"MoE routing: {experts} experts")
        caps = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(hf_config, k, None)]
        if caps:
            lines.append("softcapping: " + ", ".join(caps))
        if self.family.uses:
            lines.append(f"the family is tested with: {self.family.uses}")
        return lines

    def masks(self, mask: Tensor, positions: Tensor, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
        """The additive attention mask of each layer kind, from the full-attention one.

        mask (T, S) or (B, T, S) bool: what each new token sees (its prefix, and its own block written
        right after it: a tree's ancestors, or the causal block of a prefill); positions (T,) or (B, T):
        the new tokens' positions. A row's prefix is columns [0, start) at positions 0..start-1, and its
        block starts at ``start``, the block's smallest position. Returns (B, 1, T, S) float, or one per
        kind in a dict keyed by kind (transformers' per-layer-type masks) when the layers differ."""
        mask = mask if mask.ndim == 3 else mask[None]
        positions = positions if positions.ndim == 2 else positions[None]
        positions = positions.expand(mask.shape[0], -1)  # (B, T)
        kinds = {
            kind: mask if kind == FULL else mask & self._in_window(positions, mask.shape[-1])
            for kind in set(self.layer_kinds)
        }
        additive = {kind: _additive(seen, dtype) for kind, seen in kinds.items()}
        return next(iter(additive.values())) if len(additive) == 1 else additive

    def _in_window(self, positions: Tensor, width: int) -> Tensor:
        """positions (B, T) -> (B, T, W) bool: column w's position is at most window - 1 behind the token's."""
        starts = positions.amin(-1, keepdim=True)  # (B, 1) each row's prefix length
        cols = torch.arange(width, device=positions.device)  # (W,)
        inside = cols[None, :] - starts  # (B, W) index into the block, < 0 in the prefix
        block_positions = positions.gather(1, inside.clamp(0, positions.shape[1] - 1))  # (B, W)
        column_positions = torch.where(inside >= 0, block_positions, cols[None, :])  # (B, W)
        assert self.window is not None, "only a layout with windowed layers masks by window"
        return positions[:, :, None] - column_positions[:, None, :] < self.window  # (B, T, W)


def _additive(seen: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, T, S) bool -> (B, 1, T, S): 0 where seen, the dtype's lowest value elsewhere (sdpa and eager)."""
    out = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    out.masked_fill_(~seen, torch.finfo(dtype).min)
    return out[:, None]


ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # the ones that apply a 4-D additive mask as given


def check_attention_implementation(hf_config: Any) -> None:
    """A tree mask is a 4-D additive mask; flash and flex attention build their own causal pattern."""
    impl = getattr(hf_config, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise UnsupportedTarget(
            f"attention implementation {impl!r} ignores the tree mask a verify pass needs; load the target "
            f"with attn_implementation='sdpa' (or 'eager' where the family has no SDPA path)"
        )
