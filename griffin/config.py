"""Typed configs for the GRIFFIN method (docs/method.md §2, §3.4, §4).

Every config is a frozen pydantic model with ``extra="forbid"``: an unknown key or a bad value
fails with a message naming the field. ``griffin/`` only takes these objects; reading YAML and
environment variables is ``pipeline/``'s job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Variant = Literal["griffin", "hass", "eagle", "eagle3", "griffin3"]
# variants that read several target layers and train by training-time test alone (no feature loss)
MULTI_LAYER_VARIANTS = ("eagle3", "griffin3")
DecoderInput = Literal["fused", "concat"]
LossWindow = Literal["draft", "reference"]  # griffin.losses.shift_batch


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftConfig(_Frozen):
    """Architecture of a draft model; saved next to its weights (``config.json``)."""

    variant: Variant = "griffin"
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    vocab_size: int = Field(gt=0, description="the target's vocabulary")
    draft_vocab_size: int | None = Field(
        default=None, gt=0, description="reduced draft vocabulary (EAGLE-3 style d2t map); None = full"
    )
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    token_guided_fusion: bool = Field(default=True, description="TGF (§2.1); False = EAGLE's fc")
    token_enhanced_head: bool = Field(default=True, description="TEH (§2.2); False = one H output")
    fc_bias: bool = True
    feature_layers: tuple[int, ...] | None = Field(
        default=None,
        description="target hidden states read as the draft's input, as indices into HF's "
        "hidden_states (0 = the embeddings, i = the output of layer i), concatenated and reduced to H by an "
        "fc (EAGLE-3's low/mid/high fusion); None = the final post-norm feature",
    )
    decoder_input: DecoderInput = Field(
        default="fused",
        description="'fused': the layer reads one H-wide fusion of embedding and feature "
        "(EAGLE / GRIFFIN); 'concat': its attention reads [norm(embedding); norm(feature)], 2H wide, and the "
        "feature is the residual (EAGLE-3)",
    )
    trainable_head: bool = Field(
        default=False,
        description="a final norm and an LM head of the draft's own over the draft vocabulary, "
        "initialised from the target's rows (EAGLE-3); False = the target's frozen head",
    )

    @model_validator(mode="after")
    def _check(self) -> "DraftConfig":
        if self.feature_layers is not None and (
            not self.feature_layers
            or min(self.feature_layers) < 0
            or len(set(self.feature_layers)) != len(self.feature_layers)
        ):
            raise ValueError(f"feature_layers={self.feature_layers} must be distinct hidden-state indices >= 0")
        if self.decoder_input == "concat" and self.token_guided_fusion:
            raise ValueError(
                "decoder_input='concat' (EAGLE-3's layer input) has no fusion for TGF to refine; "
                "use decoder_input='fused' with token_guided_fusion"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size={self.vocab_size}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def active_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def input_feature_size(self) -> int:
        """Width of the target features the draft reads: k x H for k feature layers, else H."""
        return self.hidden_size * (len(self.feature_layers) if self.feature_layers else 1)

    @classmethod
    def from_target(cls, hf_config: Any, variant: Variant = "griffin", **overrides: Any) -> "DraftConfig":
        """The faithful draft for a target (docs/method.md §2.5): width, heads, RoPE and eps copied;
        full MHA as GRIFFIN's draft configs use; EAGLE/HASS drafts have neither TGF nor TEH. EAGLE-3
        reads layers 2, L/2 and L-3 through EAGLE-3's concatenated layer input and a trainable
        head; GRIFFIN-3 reads the same layers through TGF and TEH, with the trainable head (§2.6)."""
        text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        rope = getattr(text_cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        fields: dict[str, Any] = dict(
            variant=variant,
            hidden_size=text_cfg.hidden_size,
            intermediate_size=text_cfg.intermediate_size,
            num_attention_heads=text_cfg.num_attention_heads,
            num_key_value_heads=text_cfg.num_attention_heads,
            vocab_size=text_cfg.vocab_size,
            rms_norm_eps=getattr(text_cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta or getattr(text_cfg, "rope_theta", None) or 10000.0),
            max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 2048),
            token_guided_fusion=variant in ("griffin", "griffin3"),
            token_enhanced_head=variant in ("griffin", "griffin3"),
        )
        if variant in MULTI_LAYER_VARIANTS:
            fields.update(
                feature_layers=default_feature_layers(text_cfg.num_hidden_layers),
                trainable_head=True,
                decoder_input="concat" if variant == "eagle3" else "fused",
            )
        fields.update(overrides)
        return cls(**fields)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers, 2, L/2 and L-3 (hidden_states indices), kept inside
    [1, L]; e.g. 30 layers -> (2, 15, 27); a 2-layer test target -> (1, 2)."""
    return tuple(sorted({min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3)}))


class TreeConfig(_Frozen):
    """EAGLE-2 dynamic tree budget (docs/method.md §4): ``total_tokens`` verified per target pass
    (root included), ``depth`` draft levels, ``top_k`` children per expanded node."""

    total_tokens: int = Field(default=60, ge=1)
    depth: int = Field(default=6, ge=1)
    top_k: int = Field(default=10, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "TreeConfig":
        pool = self.top_k + (self.depth - 1) * self.top_k**2
        if self.total_tokens - 1 > pool:
            raise ValueError(
                f"total_tokens={self.total_tokens} needs {self.total_tokens - 1} draft nodes but depth="
                f"{self.depth}, top_k={self.top_k} only propose {pool}; lower total_tokens or raise depth/top_k"
            )
        return self

    @property
    def label(self) -> str:
        """The tree as total_tokens/depth/top_k, e.g. 60/6/10 (tables, logs)."""
        return f"{self.total_tokens}/{self.depth}/{self.top_k}"


class SamplingConfig(_Frozen):
    """Target sampling. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TrainConfig(_Frozen):
    """Token-alignable training hyper-parameters (docs/method.md §3), the YAML's ``train.method``.
    Defaults are the official recipe. What changes from stage to stage (passes, learning rate, which
    losses and masks apply) is a ``StagePlan``, derived from the schedule and the variant."""

    align_top_k: int = Field(default=3, ge=1, description="k of the token-alignment mask")
    mask_shift: Literal["reference", "decode"] = "reference"
    loss_window: LossWindow = Field(
        default="draft",
        description="supervised pairs: 'draft' = the ones a decode "
        "drafts (from a reply's first token); 'reference' = EAGLE's unshifted mask",
    )
    value_weight: float = 1.0
    token_weight: float = 0.1
    topk_weight: float = 0.5
    topk_loss_k: int = Field(default=10, ge=1)
    noise_scale: float = Field(default=0.2, ge=0.0, description="uniform input-feature noise x 512/L")
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_steps: int = Field(default=2000, ge=0)
    total_steps: int | None = Field(default=None, ge=1, description="LR decay length; None = each stage's steps")
    grad_clip_value: float = Field(default=0.5, gt=0.0)
    grad_accum: int = Field(default=1, ge=1)
    ttt_backprop: Literal["auto", "full", "per_pass"] = Field(
        default="auto",
        description="'full': a later pass reads the earlier passes' R with its graph and one "
        "backward runs over the summed pass losses (EAGLE-3's training-time test); 'per_pass': R is detached and "
        "each pass backpropagates alone (the official GRIFFIN/HASS code); 'auto': full exactly for variants "
        "without a feature loss (eagle3, griffin3), whose R is otherwise trained by nothing",
    )
    token_loss: Literal["kl", "lk", "lk_hybrid"] = Field(
        default="kl",
        description="each pass's token term: 'kl' forward KL to the target (as cross-entropy); "
        "'lk' -log of the expected acceptance rate a = mean_t sum_x min(p_t(x), q_t(x)); 'lk_hybrid' "
        "w*KL + (1-w)*(1-a), w = lk_kl_scale*exp(-lk_kl_decay*a) (LK losses, arXiv 2602.23881)",
    )
    lk_kl_scale: float = Field(default=1.0, ge=0.0, le=1.0)
    lk_kl_decay: float = Field(default=1.0, ge=0.0)
    pass_weight_decay: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="pass j's loss is weighted decay^(j-1): 1.0 weighs every pass alike, EAGLE-3 uses 0.8",
    )
    skip_out_of_vocab: bool = Field(
        default=False,
        description="drop positions whose target argmax lies outside "
        "a reduced draft vocabulary from every loss (EAGLE-3's rule)",
    )

    def full_backprop(self, plan: "StagePlan") -> bool:
        """Whether later passes backpropagate into earlier ones (``ttt_backprop``)."""
        return self.ttt_backprop == "full" or (self.ttt_backprop == "auto" and not plan.feature_loss)


DEFAULT_LR = {1: 5e-5}  # the official recipe: 5e-5 for stage 1, 3e-5 for every later stage
LATER_STAGE_LR = 3e-5


class StagePlan(_Frozen):
    """What one training stage runs per step. Stage j runs j harmonized passes (for EAGLE-3 and
    GRIFFIN-3: j unrolled training-time-test steps); stages >= 2 add HASS's top-k loss to every pass
    (not EAGLE-3's); GRIFFIN and GRIFFIN-3 mask unaligned positions; EAGLE-3 and GRIFFIN-3 have no
    feature-regression loss (their token loss, forward KL to the target, stands alone)."""

    passes: int = Field(ge=1)
    lr: float = Field(gt=0.0)
    total_steps: int = Field(ge=1, description="the linear LR decay's length")
    topk_loss: bool
    alignment_mask: bool
    feature_loss: bool = True

    @classmethod
    def for_stage(
        cls, stage: int, variant: Variant, steps: int, lr: float | None = None, total_steps: int | None = None
    ) -> "StagePlan":
        return cls(
            passes=stage,
            lr=lr or DEFAULT_LR.get(stage, LATER_STAGE_LR),
            total_steps=total_steps or steps,
            topk_loss=stage >= 2 and variant != "eagle3",
            alignment_mask=variant in ("griffin", "griffin3"),
            feature_loss=variant not in MULTI_LAYER_VARIANTS,
        )
