"""GRIFFIN draft model: Token-Guided Fusion -> one decoder layer -> Token-Enhanced Head (docs/method.md §2).

The EAGLE/HASS draft is the same module with both GRIFFIN parts switched off by ``DraftConfig``
(``token_guided_fusion=False``: a plain fc over [embedding; feature]; ``token_enhanced_head=False``:
the layer outputs one H-wide feature used both for the token head and as the next feature).
EAGLE-3 and GRIFFIN-3 (docs/method.md §2.6) add, by config too: several target layers reduced to
H by an fc (``feature_layers``), EAGLE-3's layer input [norm(e); norm(h)] (``decoder_input``) and a
trainable norm + LM head (``trainable_head``).

The frozen target embedding and LM head are bound as non-persistent buffers: they are never
saved with the draft and are re-bound from the target on load (docs/method.md §2.4).

Shape legend: B batch, T tokens, D hidden, I intermediate, V (draft) vocab, S cached keys,
Hq query heads, Hk key/value heads, Dh head dim, J training passes (streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.config import DraftConfig, Variant


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics as in HF LlamaRMSNorm: bf16 loses precision in the mean of squares
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, Dh); cos/sin: (T, Dh)
    return x * cos + rotate_half(x) * sin


@dataclass
class KVCache:
    """Preallocated single-layer draft KV cache; entries [0, length) are valid."""

    k: Tensor  # (B, Hk, S_max, Dh)
    v: Tensor  # (B, Hk, S_max, Dh)
    length: int = 0

    @classmethod
    def allocate(cls, cfg: DraftConfig, max_len: int, batch: int = 1, device=None, dtype=None) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hk, T, Dh) at [length, length + T) -> every valid entry's (B, Hk, S, Dh) views, no copy."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"draft KV cache overflow: need {end} > capacity {self.capacity}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        D, Dh = cfg.hidden_size, cfg.head_dim
        D_in = 2 * D if cfg.decoder_input == "concat" else D  # EAGLE-3's attention reads [e; h]
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, Dh
        self.q_proj = nn.Linear(D_in, self.n_heads * Dh, bias=False)
        self.k_proj = nn.Linear(D_in, self.n_kv_heads * Dh, bias=False)
        self.v_proj = nn.Linear(D_in, self.n_kv_heads * Dh, bias=False)
        self.o_proj = nn.Linear(self.n_heads * Dh, D, bias=False)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, Dh)

    def forward(
        self,
        x_q: Tensor,  # (B, Tq, D_in) query stream; D_in = D, or 2D for EAGLE-3's input
        x_kv: Tensor,  # (B, Tk, D_in) key/value streams (== x_q when decoding)
        rope_q: tuple[Tensor, Tensor],  # cos, sin: (Tq, Dh)
        rope_kv: tuple[Tensor, Tensor],  # cos, sin: (Tk, Dh)
        mask: Tensor,  # (Tq, S) or (B, 1, Tq, S) bool, True = attend
        cache: Any = None,  # a KVCache, or griffin.rows.RowCache (several requests, a length each)
    ) -> Tensor:
        q = apply_rope(self._heads(self.q_proj(x_q), self.n_heads), *rope_q)  # (B, Hq, Tq, Dh)
        k = apply_rope(self._heads(self.k_proj(x_kv), self.n_kv_heads), *rope_kv)  # (B, Hk, Tk, Dh)
        v = self._heads(self.v_proj(x_kv), self.n_kv_heads)  # (B, Hk, Tk, Dh)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hk, S, Dh)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads
        )  # (B, Hq, Tq, Dh)
        B, _, Tq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, Tq, -1))  # (B, Tq, D)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TokenGuidedFusion(nn.Module):
    """docs/method.md §2.1. h = fc([e; F]); c = h + Down(SiLU(Up([normB(normA(h)); normB(e)]))).

    The token embedding enters twice (in fc and as half of the Up input), and one RMSNorm (B)
    with one scale vector serves both halves, as the official code does. With
    ``token_guided_fusion=False`` only the fc remains: EAGLE's fusion."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.fc = nn.Linear(2 * D, D, bias=cfg.fc_bias)
        self.refine = cfg.token_guided_fusion
        if self.refine:
            self.fc_norm = RMSNorm(D, cfg.rms_norm_eps)  # RMSNorm_A
            self.expand_norm = RMSNorm(D, cfg.rms_norm_eps)  # RMSNorm_B, shared by both halves
            self.up_proj = nn.Linear(2 * D, I, bias=False)
            self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, embeds: Tensor, features: Tensor) -> Tensor:
        h = self.fc(torch.cat([embeds, features], dim=-1))  # (B, T, D); order (embedding, feature)
        if not self.refine:
            return h
        z = torch.cat([self.expand_norm(self.fc_norm(h)), self.expand_norm(embeds)], dim=-1)  # (B, T, 2D)
        return h + self.down_proj(F.silu(self.up_proj(z)))  # (B, T, D)


class ConcatInput(nn.Module):
    """EAGLE-3's layer input: the attention reads [input_norm(e); hidden_norm(h)] (B, T, 2D) and
    the residual stream is h itself (SpecForge's ``LlamaForCausalLMEagle3`` midlayer)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        return features, torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)


class DraftDecoderLayer(nn.Module):
    """One LLaMA layer without input norm (EAGLE convention); with TEH its MLP outputs 2D and the
    residual is duplicated, so the output splits into prediction P and regression R (§2.2)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        D = cfg.hidden_size
        self.two_heads = cfg.token_enhanced_head
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp = SwiGLU(D, cfg.intermediate_size, 2 * D if self.two_heads else D)

    def forward(
        self, residual: Tensor, x_q: Tensor, x_kv: Tensor, rope_q, rope_kv, mask: Tensor, cache=None
    ) -> tuple[Tensor, Tensor]:
        """residual (B, T, D); x_q (B, T, D_in) and x_kv (B, Tk, D_in) the attention's inputs (the
        residual itself for a fused input)."""
        a = residual + self.self_attn(x_q, x_kv, rope_q, rope_kv, mask, cache)  # (B, T, D)
        m = self.mlp(self.post_attention_layernorm(a))  # (B, T, 2D) or (B, T, D)
        if not self.two_heads:
            out = a + m
            return out, out
        out = torch.cat([a, a], dim=-1) + m  # (B, T, 2D)
        D = a.shape[-1]
        return out[..., :D], out[..., D:]  # P (prediction), R (regression)


def harmonized_mask(T: int, passes: int, device=None) -> Tensor:
    """Attention of pass j = ``passes`` over J streams of T columns each (docs/method.md §3.2).

    Query row r sees stream 0 (teacher features) at columns 0..r-j+1 and stream k >= 1 only at
    column r-j+1+k: the KV the draft holds after j-1 autoregressive steps at decode time.
    E.g. T=3, j=2: row 2 sees stream0 cols {0,1} and stream1 col {2}; row 0 sees stream1 col 0.
    Returns (T, J*T) bool, True = attend."""
    r = torch.arange(T, device=device)[:, None]  # (T, 1)
    c = torch.arange(T, device=device)[None, :]  # (1, T)
    blocks = [c <= r - passes + 1] + [c == r - passes + 1 + k for k in range(1, passes)]
    return torch.cat(blocks, dim=1)  # (T, J*T)


class GriffinDraft(nn.Module):
    # buffers (register_buffer) and optional submodules, typed for readers and the type checker
    embed_weight: Tensor
    head_weight: Tensor
    inv_freq: Tensor
    d2t: Tensor | None
    feature_fc: nn.Linear
    feature_norm: RMSNorm
    norm: RMSNorm
    lm_head: nn.Linear

    def __init__(self, cfg: DraftConfig, embed_weight: Tensor, head_weight: Tensor, d2t: Tensor | None = None):
        """``embed_weight`` (V_target, D) and ``head_weight`` (V_target, D) are the target's frozen
        tensors; ``d2t`` (V_draft,) lists the target ids of a reduced draft vocabulary."""
        super().__init__()
        if (d2t is None) != (cfg.draft_vocab_size is None):
            raise ValueError("pass d2t exactly when DraftConfig.draft_vocab_size is set")
        if d2t is not None and d2t.numel() != cfg.draft_vocab_size:
            raise ValueError(f"d2t has {d2t.numel()} ids but draft_vocab_size={cfg.draft_vocab_size}")
        self.cfg = cfg
        D = cfg.hidden_size
        if cfg.feature_layers:  # k target layers (B, T, k*D) -> (B, T, D); no bias, as EAGLE-3's fc
            self.feature_fc = nn.Linear(cfg.input_feature_size, D, bias=False)
        self.fusion = ConcatInput(cfg) if cfg.decoder_input == "concat" else TokenGuidedFusion(cfg)
        if cfg.feature_layers and cfg.decoder_input == "fused":
            # GRIFFIN-3: a norm on every feature entering TGF, as EAGLE-3's hidden_norm. Middle layers
            # carry massive activations (SmolLM2: |x| up to 24,960 at layers 15 and 27, RMS ~35),
            # which the post-norm final feature GRIFFIN was built for never has
            self.feature_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layer = DraftDecoderLayer(cfg)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        head = head_weight.detach() if d2t is None else head_weight.detach()[d2t.to(head_weight.device)]
        # (V, D), V = draft vocab: the target's frozen rows (its distribution, the teacher's)
        self.register_buffer("head_weight", head, persistent=False)
        if cfg.trainable_head:  # EAGLE-3: the draft's own norm + head, starting from the target's rows
            self.norm = RMSNorm(D, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(D, head.shape[0], bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(head)
        if d2t is not None:
            self.register_buffer("d2t", d2t.to(torch.long))  # saved: draft id -> target id
        else:
            self.d2t = None
        # explicit device: stays real when the module is built under torch.device("meta") for loading
        exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=head_weight.device) / cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta**exponent
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def for_target(cls, target: Any, variant: Variant = "griffin", d2t: Tensor | None = None, **overrides: Any):
        """A freshly initialised draft bound to ``target``'s frozen embedding and LM head."""
        if d2t is not None:
            overrides.setdefault("draft_vocab_size", int(d2t.numel()))
        cfg = DraftConfig.from_target(target.hf_config, variant=variant, **overrides)
        draft = cls(cfg, target.embed_weight, target.head_weight, d2t)
        final_norm: Any = getattr(target.backbone, "norm", None)
        if cfg.trainable_head and isinstance(getattr(final_norm, "weight", None), Tensor):
            with torch.no_grad():  # with the target's rows, the head starts as the target's own
                draft.norm.weight.copy_(final_norm.weight)
        return draft.to(target.device)

    @torch.no_grad()
    def start_from_target_layer(self, layer: nn.Module) -> None:
        """Copy a target decoder layer (LLaMA / Qwen2 names) into the draft's: attention, post-attention
        norm and MLP. Grouped K/V heads are repeated to the draft's heads, which computes the same
        attention. The draft layer has no input norm (EAGLE's convention), so the target's input-norm
        scale is folded into Q/K/V: on an RMS-normalised input the draft computes the target layer.
        With TEH the down projection fills both halves, so P and R start equal. Not carried: Q/K/V
        biases (Qwen2's; the draft's projections have none)."""
        if self.cfg.decoder_input == "concat":
            raise ValueError(
                "draft.init_layer: EAGLE-3's attention reads [e; h] (2H wide); a target layer's "
                "reads H, so it cannot start from one. Drop draft.init_layer for this variant"
            )
        theirs: Any = layer  # a transformers decoder layer: its submodules by name
        ours, Dh = self.layer, self.cfg.head_dim
        group = self.cfg.num_attention_heads // (theirs.self_attn.k_proj.weight.shape[0] // Dh)  # Hq / Hk
        scale = theirs.input_layernorm.weight  # (D,): W @ (g * x) = (W * g) @ x
        pairs = [
            (ours.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight * scale),
            (ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight),
            (ours.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight),
            (ours.mlp.gate_proj.weight, theirs.mlp.gate_proj.weight),
            (ours.mlp.up_proj.weight, theirs.mlp.up_proj.weight),
        ]
        for name in ("k_proj", "v_proj"):  # (Hk*Dh, D) -> (Hq*Dh, D): each KV head once per query head
            weight = getattr(theirs.self_attn, name).weight * scale
            heads = weight.view(-1, Dh, weight.shape[-1])  # (Hk, Dh, D); query head h reads KV head h // group
            repeated = heads.repeat_interleave(group, dim=0).reshape(-1, weight.shape[-1])  # (Hq*Dh, D)
            pairs.append((getattr(ours.self_attn, name).weight, repeated))
        down = theirs.mlp.down_proj.weight  # (D, I)
        pairs.append((ours.mlp.down_proj.weight, torch.cat([down, down]) if ours.two_heads else down))
        for mine, source in pairs:
            if mine.shape != source.shape:
                raise ValueError(
                    f"draft.init_layer: the target layer's {tuple(source.shape)} does not fit the "
                    f"draft's {tuple(mine.shape)} (draft.overrides change its shape?)"
                )
            mine.copy_(source.to(mine.dtype))

    def cast_parameters(self, dtype: torch.dtype) -> "GriffinDraft":
        """Cast the trainable weights only. ``module.to(dtype)`` would also cast the frozen target
        embedding/head (a full copy for fp32 training) and the fp32 RoPE frequencies (bf16 RoPE
        angles drift from the ones used in training)."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        return self

    # ---- pieces -------------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return self.layer.self_attn.q_proj.weight.dtype

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (T,) -> cos, sin (T, Dh); per-row positions (B, T) -> (B, 1, T, Dh), over the heads."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., T, Dh/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, Dh)
        if positions.ndim == 2:
            emb = emb[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, tokens: Tensor) -> Tensor:
        with torch.no_grad():
            return F.embedding(tokens, self.embed_weight)  # (B, T, D)

    def logits(self, prediction: Tensor) -> Tensor:
        """Token logits over the draft vocabulary from the prediction feature P: (..., D) -> (..., V)."""
        if self.cfg.trainable_head:
            return self.lm_head(self.norm(prediction.to(self.param_dtype)))
        return self.target_logits(prediction)

    def target_logits(self, features: Tensor) -> Tensor:
        """The target's frozen head over the draft vocabulary: (..., D) -> (..., V). For a target
        feature it is the target's own distribution (the teacher)."""
        features = features.to(self.head_weight.dtype)
        packed = self.__dict__.get("packed_head")
        return packed(features) if packed is not None else features @ self.head_weight.T

    def fuse_target(self, features: Tensor) -> Tensor:
        """Target features as the draft reads them: k layers (..., k*D) through the fc to (..., D);
        the final feature (..., D) as it is."""
        return self.feature_fc(features.to(self.param_dtype)) if self.cfg.feature_layers else features

    def next_stream(self, inputs: Tensor, regression: Tensor) -> Tensor:
        """The next harmonized pass's input stream: the draft's own regressed features R (B, T, D),
        one position later, with the target's first feature in front (fused to D)."""
        return torch.cat([self.fuse_target(inputs[:, :1]).to(inputs.dtype), regression[:, :-1].to(inputs.dtype)], dim=1)

    def _layer_inputs(self, embeds: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """(residual (B, T, D), attention input (B, T, D_in)) of one stream."""
        if self.cfg.decoder_input == "concat":
            return self.fusion(embeds, features)
        if self.cfg.feature_layers:
            features = self.feature_norm(features)
        fused = self.fusion(embeds, features)
        return fused, fused

    def prepack(self) -> bool:
        """Pre-pack the linears and the head for CPU drafting, fp32 or native bf16 (griffin.target.PackedLinear);
        inference only. The packed head is a plain attribute: it is not part of the state_dict."""
        from griffin.target import PackedLinear, prepack_linears, prepack_supported

        if not (
            prepack_supported(self.head_weight.device, self.head_weight.dtype)
            and prepack_supported(self.head_weight.device, self.param_dtype)
        ):
            return False
        prepack_linears(self)
        if self.cfg.trainable_head:
            return True  # its own head is a Linear, now packed; the frozen rows only score the teacher
        head = nn.Linear(self.head_weight.shape[1], self.head_weight.shape[0], bias=False)
        head.weight = nn.Parameter(self.head_weight, requires_grad=False)
        self.__dict__["packed_head"] = PackedLinear(head)
        return True

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def to_draft_ids(self, target_ids: Tensor) -> Tensor:
        """Target ids -> draft ids; -1 where the token is outside a reduced draft vocabulary."""
        if self.d2t is None:
            return target_ids
        t2d = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        t2d[self.d2t] = torch.arange(self.d2t.numel(), device=target_ids.device)
        return t2d[target_ids]

    # ---- training: harmonized multi-stream forward ------------------------------------
    def forward(
        self, streams: list[Tensor], tokens: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Pass j = len(streams) of token-alignable training.

        streams[0]: (B, T, D_f) the target's features (D_f = k*D for k feature layers); streams[k >= 1]:
        (B, T, D) the draft's regressed features (``next_stream``); tokens: (B, T)
        ground-truth next tokens y_t = x_{t+1}, shared by every stream; attention_mask: (B, T)
        1 for real tokens. Queries come from the last stream. Returns P, R: (B, T, D)."""
        J, (B, T) = len(streams), tokens.shape  # noqa: F841 (B names the shape)
        streams = [self.fuse_target(streams[0].to(self.param_dtype))] + [s.to(self.param_dtype) for s in streams[1:]]
        embeds = self.embed(tokens).to(self.param_dtype)  # (B, T, D)
        inputs = [self._layer_inputs(embeds, s) for s in streams]  # J x ((B, T, D), (B, T, D_in))
        x_kv = inputs[0][1] if J == 1 else torch.cat([x for _, x in inputs], dim=1)  # (B, J*T, D_in)
        pos = torch.arange(T, device=tokens.device)
        rope_q = self.rope(pos, x_kv.dtype)
        rope_kv = self.rope(pos.repeat(J), x_kv.dtype)
        mask = harmonized_mask(T, J, tokens.device)  # (T, J*T)
        if attention_mask is not None:
            keys_valid = attention_mask.bool().repeat(1, J)  # (B, J*T)
            mask = mask[None, None] & keys_valid[:, None, None, :]  # (B, 1, T, J*T)
            # a padded query row may see no key at all; let it see its own column (it is unused)
            own = torch.zeros(T, J * T, dtype=torch.bool, device=tokens.device)
            own[:, (J - 1) * T :] = torch.eye(T, dtype=torch.bool, device=tokens.device)
            mask = mask | own
        return self.layer(*inputs[-1], x_kv, rope_q, rope_kv, mask)

    # ---- decoding: one cached step ----------------------------------------------------
    def compile_decoding(self) -> None:
        """Compile ``step`` for decoding (griffin.static): ``step_compiled`` runs the graph, captured
        once per process. Kept out of the module's state (not a submodule)."""
        from griffin.static import compile_step

        if self.__dict__.get("compiled_step") is None:
            self.__dict__["compiled_step"] = compile_step(self.step, self.head_weight.device)

    def step_compiled(self, *args: Any) -> tuple[Tensor, Tensor]:
        """``step`` through its compiled graph (``compile_decoding``; a static-shape step of a
        griffin.rows.RowCache, under ``torch.no_grad``)."""
        from griffin.static import step_begin

        step_begin(self.head_weight.device)
        # expanded views (stride 0: a level's shared positions) would each be a new graph
        return self.__dict__["compiled_step"](*(a.contiguous() if isinstance(a, Tensor) else a for a in args))

    def step(
        self, features: Tensor, tokens: Tensor, positions: Tensor, cache: KVCache, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """features (B, T, D): the target's (through ``fuse_target``) or the draft's own R; tokens
        (B, T), positions (T,) or per row (B, T), mask (T, S) or per row (B, 1, T, S) bool over the
        cached entries + the new ones. Appends T entries (per row) to ``cache``; returns P, R: (B, T, D)."""
        residual, x = self._layer_inputs(self.embed(tokens).to(self.param_dtype), features.to(self.param_dtype))
        rope = self.rope(positions, x.dtype)
        return self.layer(residual, x, x, rope, rope, mask, cache)


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
