"""One adapter over the HF causal LM families of griffin.families (one adapter, no forked modeling code).

It needs four things from the target and gets them from stock transformers, with no forked
``modeling_*.py``: a prefill/verify forward returning the post-norm last-layer features
(docs/method.md §1) and logits, a 4-D tree mask passed as ``attention_mask``, one per layer kind for windowed
layers (HF uses a 4-D mask as given), a preallocated KV cache plugged in as a ``Cache`` of our own layers, and the frozen
embedding / LM head.

Shape legend: T tokens, N tree nodes, D hidden, V vocab, S cached positions, Hk kv heads, Dh head dim.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache, CacheLayerMixin

from griffin.families import AttentionLayout, check_attention_implementation
from griffin.target_parts import HeadShaped

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 matmuls run natively here. A CPU without AMX / AVX512-BF16 (e.g. an AVX2-only
    one) emulates them: there a bf16 forward measured ~7x and a bf16-autocast training step ~30x
    slower than fp32, so "auto" picks fp32 on it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return (
        device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# The attention backends decoding runs with on CUDA: all but cuDNN's. cuDNN attention, PyTorch's first
# choice for bf16 on Hopper, builds an execution graph for each new input shape, and decoding changes the
# KV length every step. On an H200, a bf16 SmolLM2 step took 85 ms while the shapes were new and 22-25 ms
# once they repeated (benchmarks/gpu/gpu_dtype.md); the real bf16 decode ran at 0.38x its fp32 speed.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(device: str | torch.device) -> contextlib.AbstractContextManager:
    """Context for a decode on ``device``: SDPA without cuDNN's backend on CUDA (``DECODE_ATTENTION``),
    unchanged elsewhere. The backend flags are process-wide, so concurrent decodes on one GPU would
    race on them; a replica runs every decode in its one engine thread (griffin.engine, pipeline.serve)."""
    return sdpa_kernel(DECODE_ATTENTION) if torch.device(device).type == "cuda" else contextlib.nullcontext()


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name, or "auto": bf16 where the device runs it natively, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear: CPU builds with mkldnn, in fp32, or in bf16 on a CPU with bf16 support."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and fast_bf16(device))


# oneDNN's packed layout is chosen for a batch size (rows of the input). bf16 (AMX / AVX512-BF16):
# batch 1, the decode step's GEMV; tree verifies (M <= 64) measured well on it too. fp32 (measured on
# an AVX2-only CPU, benchmarks/decode/decode-fp32.md): a batch-16 layout is as fast as the batch-1 one at
# M = 1 and 1.3-1.9x faster at every M from 2 to 32, the rows of a tree verify.
LAYOUT_BATCH = {torch.bfloat16: 1, torch.float32: 16}


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is pre-packed into oneDNN's blocked layout, as the CPU
    freezing pass of ``torch.compile`` does. On plain row-major weights a bf16 GEMV at batch 1
    streams them ~1.6x slower (benchmarks/decode/decode.md), and an fp32 tree verify pays MKL's repacking
    of the weights on every call (benchmarks/decode/decode-fp32.md); decoding is those products.
    With ``keep_weight`` the plain ``weight`` stays, so that a tied embedding, ``head_weight`` and
    ``state_dict`` see the same tensor; without it the plain copy is released (``weight`` is None)
    and only the packed one takes memory."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = (linear.weight if keep_weight else None), linear.bias
        batch = LAYOUT_BATCH[linear.weight.dtype]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(module: nn.Module, keep_weight: Callable[[nn.Linear], bool] = lambda linear: True) -> int:
    """Swap every ``nn.Linear`` under ``module`` for a ``PackedLinear`` (inference only: the packed
    copy takes no gradient), keeping the plain weight where ``keep_weight(linear)``. Returns how
    many were swapped."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, keep_weight(child)))
                swapped += 1
    return swapped


def release_freed_memory() -> None:
    """Hand the heap pages that released weights leave behind back to the OS (glibc keeps freed
    blocks of a few MB in its heap; benchmarks/history.md: 100 MiB more of SmolLM2's released fp32
    weights leave the process this way). A no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PreallocatedLayer(CacheLayerMixin):
    """One layer's KV, allocated once at full capacity; entries [0, length) are valid.

    ``update`` writes in place and returns views, so decoding never reallocates; ``keep``
    compacts the accepted tree path after verification."""

    is_sliding = False
    keys: Tensor
    values: Tensor

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values = keys, values  # (1, Hk, S_max, Dk), (1, Hk, S_max, Dv)
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # buffers exist from the start

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"target KV cache overflow: need {end} > capacity {self.keys.shape[-2]}")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # (1, Hk, S, Dh) views

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class TargetCache(Cache):
    layers: list[PreallocatedLayer]  # type: ignore[assignment]  # only ours: every layer preallocated

    def __init__(self, layers: list[PreallocatedLayer]):
        super().__init__(layers=cast(list[Any], layers))  # transformers types the list invariantly

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].get_max_length()


def layer_features(out: Any, feature_layers: tuple[int, ...] | None) -> Tensor:
    """A backbone output -> the features a draft reads: the post-norm last layer (B, T, D), or the
    ``feature_layers`` hidden states concatenated in that order (B, T, k*D). The backbone must have
    been called with ``output_hidden_states=list(feature_layers)``."""
    if not feature_layers:
        return out.last_hidden_state
    device = out.last_hidden_state.device  # a target split over devices: each layer's states are on its own
    return torch.cat([out.hidden_states[i].to(device) for i in feature_layers], dim=-1)


def stop_token_ids(generation_config: Any, hf_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config, the model config and the tokenizer (e.g. both
    ``<|im_end|>`` and ``<|endoftext|>`` for Qwen2.5); never hard-coded per model."""
    ids: list[int] = []
    for source in (
        getattr(generation_config, "eos_token_id", None),
        hf_config.eos_token_id,
        getattr(tokenizer, "eos_token_id", None),
    ):
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


class TargetAdapter(HeadShaped):
    """The frozen target: prefill, tree verification, KV compaction, embedding and LM head."""

    def __init__(
        self,
        hf_model: Any,
        tokenizer: Any = None,
        name: str | None = None,
        revision: str | None = None,
        files: str | None = None,
    ):
        self.model = hf_model.eval()
        self.backbone = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        self.hf_config = hf_model.config
        # refused here, not mid-decode: a family that cannot decode losslessly, or flash/flex attention
        self.layout = AttentionLayout.of(self.hf_config)
        check_attention_implementation(self.hf_config)
        self.tokenizer = tokenizer
        self.name = name or getattr(self.hf_config, "_name_or_path", "") or "target"
        self.revision = revision  # the hub revision it was loaded at (lineage); None: the default or not the hub
        self.files = files  # the directory or hub id its weights came from (griffin.target_files); None: built
        self.context_cap: int | None = None  # decode.max_context (see max_context)
        self.prefill_chunk: int | None = None  # decode.prefill_chunk: prompt tokens an engine step prefills
        self.packed = False  # see prepack()
        self.compiled_forward: Callable | None = None  # see compile_decoding()
        self._weights_sha256: str | None = None
        for p in self.model.parameters():
            p.requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        device: str = "cpu",
        revision: str | None = None,
        device_map: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> "TargetAdapter":
        """Load from a local directory, an asset name (see ``griffin.assets``) or an HF hub id; ``revision``
        (a branch, tag or commit of the hub id) reaches both the weights and the tokenizer. The family is
        checked from the config before any weight is read (griffin.families). ``device_map`` (e.g. "auto")
        spreads a target too large for one device over the devices this process sees, layer by layer
        (transformers' ``device_map``; ``device`` is then unused): each layer's KV cache lives beside it."""
        from griffin.assets import resolve_target_path

        path = resolve_target_path(str(path_or_name), revision)
        family = AttentionLayout.of(AutoConfig.from_pretrained(path, revision=revision)).family
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype, device),
            attn_implementation=kwargs.pop("attn_implementation", family.attn_implementation),
            revision=revision,
            device_map=device_map,
            **kwargs,
        )
        model = model if device_map is not None else model.to(device)  # type: ignore[arg-type]  # a device is one
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        return cls(model, tokenizer, name=str(path_or_name), revision=revision, files=path)

    def prepack(self) -> bool:
        """Pre-pack the target's linear layers for CPU decoding, fp32 or native bf16 (``PackedLinear``); a
        no-op elsewhere. Returns whether it packed. Inference only: call it in decoding processes.
        The plain weights are released, all but the LM head's (drafts read its rows, and a tied head
        is the embedding), so a decoding process holds one copy of the target: the weights hash is
        taken first, for the lineage checks."""
        if not prepack_supported(self.device, self.dtype):
            return False
        _ = self.weights_sha256
        head = self.model.get_output_embeddings()
        prepack_linears(self.model, keep_weight=lambda linear: linear is head)
        self.lm_head = self.model.get_output_embeddings()
        self.packed = True
        release_freed_memory()
        return True

    @property
    def weights_sha256(self) -> str:
        """sha256 over every weight tensor of the target as loaded (computed once)."""
        if self._weights_sha256 is None:
            from griffin.checkpoint import tensors_sha256

            self._weights_sha256 = tensors_sha256(self.model.state_dict())
        return self._weights_sha256

    # ---- facts about the target --------------------------------------------------------
    @property
    def layer_devices(self) -> list[torch.device]:
        """Each decoder layer's device: one device, or a target split by ``device_map``."""
        layers = getattr(self.backbone, "layers", None)
        if layers is None or len(layers) != self.hf_config.num_hidden_layers:
            return [self.device] * self.hf_config.num_hidden_layers
        devices = [next(iter(layer.parameters()), self.head_weight).device for layer in layers]
        if any(d.type == "meta" for d in devices):
            raise ValueError(
                "layers offloaded to disk or host memory (device_map) cannot hold a KV cache: give them a device"
            )
        return devices

    @property
    def embed_weight(self) -> Tensor:
        return self.model.get_input_embeddings().weight  # (V, D)

    @property
    def head_weight(self) -> Tensor:  # type: ignore[override]  # read-only here; HeadShaped's parts set it
        return self.lm_head.weight  # (V, D); the embedding itself when tied

    @property
    def max_context(self) -> int:
        """Positions a decode may reach (prompt + new tokens): the target's ``max_position_embeddings``,
        or ``context_cap`` (``decode.max_context``) when smaller. Each row's KV cache is sized by it."""
        positions = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        return positions if self.context_cap is None else min(positions, self.context_cap)

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(getattr(self.model, "generation_config", None), self.hf_config, self.tokenizer)

    # ---- cache -------------------------------------------------------------------------
    def new_cache(self, capacity: int) -> TargetCache:
        """A one-sequence KV cache for plain forwards (a prompt's features, a reference's logits).
        Decoding verifies through the engine's row cache (``new_row_cache``), the one KV path that
        serves."""
        keys, values = self.layout.cache_shapes(self.hf_config, 1, capacity)
        layers = [
            PreallocatedLayer(
                torch.empty(keys, dtype=self.dtype, device=device), torch.empty(values, dtype=self.dtype, device=device)
            )
            for device in self.layer_devices
        ]
        return TargetCache(layers)

    def new_row_cache(self, rows: int, capacity: int) -> Any:
        """A KV cache of ``rows`` request slots, a length each (griffin.rows; the batching engine's)."""
        from griffin.rows import RowCache

        shapes = [self.layout.cache_shapes(self.hf_config, rows, capacity)] * self.hf_config.num_hidden_layers
        return RowCache(shapes, self.dtype, self.layer_devices)

    # ---- forward passes ----------------------------------------------------------------
    def compile_decoding(self) -> None:
        """Compile the decode step (griffin.static): ``forward(..., compiled=True)`` then runs the
        compiled graph, captured once per process (a CUDA graph on CUDA)."""
        from griffin.static import compile_step

        if any(isinstance(module, PackedLinear) for module in self.model.modules()):
            raise ValueError("a pre-packed target cannot be compiled: load it with prepack off (inductor packs it)")
        if self.compiled_forward is None:
            self.compiled_forward = compile_step(self._forward, self.device)

    def forward(
        self,
        tokens: Tensor,  # (B, T); B > 1 with a griffin.rows.RowCache only
        cache: Cache,
        positions: Tensor | None = None,  # (T,) or per row (B, T) absolute positions; default: contiguous
        mask: Tensor | None = None,  # (T, S) or per row (B, T, S) bool over cache + new tokens; default: causal
        all_logits: bool = True,
        feature_layers: tuple[int, ...] | None = None,
        compiled: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Runs the target on ``tokens`` after the cached prefix; appends their KV.
        Returns features and logits (B, T, V) (or (B, 1, V) for the last). Features: the post-norm
        last layer (B, T, D), or with ``feature_layers`` those hidden states (HF indices: 0 = the
        embeddings, i = after layer i) concatenated, (1, T, k*D), what a multi-layer draft reads.
        ``compiled``: through the compiled step (``compile_decoding``; a static-shape forward of a
        griffin.rows.RowCache with an explicit mask, under ``torch.no_grad``)."""
        if compiled:
            from griffin.static import step_begin

            step_begin(self.device)
            assert self.compiled_forward is not None, "compile_decoding() first"
            return self.compiled_forward(tokens, cache, positions, mask, all_logits, feature_layers)
        # a caller already without autograd keeps its mode: a compiled engine runs under no_grad, and
        # inference tensors from here would be inputs its compiled steps cannot take
        with torch.inference_mode() if torch.is_grad_enabled() else contextlib.nullcontext():
            return self._forward(tokens, cache, positions, mask, all_logits, feature_layers)

    def _forward(
        self,
        tokens: Tensor,
        cache: Cache,
        positions: Tensor | None,
        mask: Tensor | None,
        all_logits: bool,
        feature_layers: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor]:
        if positions is None:  # a single row: positions follow its TargetCache
            assert isinstance(cache, TargetCache), "a griffin.rows.RowCache needs explicit positions"
            positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=self.device)
        # additive (B, 1, T, S) masks, windowed per layer kind (None: transformers builds its own)
        attn = None if mask is None else self.layout.masks(mask, positions, self.dtype)
        out = self.backbone(
            input_ids=tokens,
            position_ids=positions if positions.ndim == 2 else positions[None],
            attention_mask=attn,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=list(feature_layers or []) or None,
        )
        last = out.last_hidden_state  # (B, T, D), after the final norm
        logits = self.lm_head(last if all_logits else last[:, -1:])  # (B, T|1, V)
        # a target split over devices hands the draft its features on the head's device (a no-op on one)
        return layer_features(out, feature_layers).to(self.device), logits.float().to(self.device)
