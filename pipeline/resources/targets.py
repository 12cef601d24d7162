"""The run's target: ``load_target(section)``, what a draft borrows of it (``load_target_parts``), its
feature layers, ``griffin assets``, and the tiny random target of the tests (its fingerprint:
``pipeline.resources.identity``).

A ``target.tiny`` section builds a seeded random llama with a byte-level ChatML tokenizer
(``build_tiny_target``), so every process (featurize actors, train workers, serve replicas) gets
bit-identical weights without any file or download.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from griffin.assets import ASSETS, default_cache_dir, prepare_asset, resolve_target_path
from griffin.static import compile_enabled
from griffin.target import TargetAdapter, resolve_dtype
from griffin.target_parts import PartsUnreadable, TargetParts, read_target_parts
from pipeline.config import RunConfig, TargetSection

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> Any:
    """A byte-level BPE-free tokenizer: 256 byte tokens + ChatML specials, with offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=TINY_SPECIALS[1:],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(fields: dict[str, Any], tokenizer: Any = None) -> Any:
    """The transformers config of a ``target.tiny`` section: its fields, ``model_type`` picking the family
    (llama by default); with the tiny ``tokenizer``, its vocabulary and special ids too."""
    from transformers import AutoConfig

    fields = {"tie_word_embeddings": False, **fields}
    model_type = fields.pop("model_type", "llama")
    if tokenizer is not None:
        fields.update(
            vocab_size=max(fields.get("vocab_size", 0), len(tokenizer)),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
    return AutoConfig.for_model(model_type, **fields)


def build_tiny_target(fields: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> TargetAdapter:
    """A seeded random target of ``tiny_config(fields)`` with the byte-level tokenizer; refused like any
    target of an unsupported family (griffin.families)."""
    from transformers import AutoModelForCausalLM

    from griffin.families import family_of

    tokenizer = tiny_tokenizer()
    config = tiny_config(fields, tokenizer)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # identical weights in every process that builds it
    model = AutoModelForCausalLM.from_config(config, attn_implementation=family_of(config).attn_implementation)
    torch.random.set_rng_state(generator_state)
    return TargetAdapter(model.to(dtype), tokenizer, name=f"tiny-{config.model_type}")


def load_target(
    section: TargetSection,
    decoding: bool = False,
    device: str | None = None,
    compile: str = "off",
    max_context: int | None = None,
) -> TargetAdapter:
    """The run's target; ``decoding=True`` (serve, eval, tune-tree) also applies ``section.prepack``
    and ``compile`` (``decode.compile``: griffin.static), and ``max_context`` (``decode.max_context``)
    caps each decode's context. ``device`` places it elsewhere than ``section.device``, in the dtype
    resolved for that one."""
    dtype = resolve_dtype(section.dtype, section.device)
    device = device or section.device
    if section.tiny is not None:
        if section.revision is not None or section.device_map is not None:
            raise ValueError(
                "target.revision and target.device_map apply to loaded weights; a tiny target is built in memory"
            )
        target = build_tiny_target(section.tiny, dtype)
        target.model.to(device)
    else:
        target = TargetAdapter.from_pretrained(
            section.name, dtype=dtype, device=device, revision=section.revision, device_map=section.device_map
        )
    if decoding:
        target.context_cap = max_context
    compiled = decoding and compile_enabled(compile, target.device)
    if compiled and len(devices := set(target.layer_devices)) > 1:
        raise ValueError(
            f"decode.compile={compile} with a target split over {len(devices)} devices "
            "(target.device_map): compiled decoding runs on one device; set decode.compile=off"
        )
    if compiled:
        target.compile_decoding()  # inductor packs the CPU weights itself (freezing): no prepack
    elif decoding and section.prepack:
        target.prepack()
    return target


def load_decoding_target(cfg: RunConfig) -> TargetAdapter:
    """The run's target as serve, eval, tune-tree and check-target decode with it: ``load_target``
    with the run's ``decode`` settings (compiled or not, the context cap, the prefill chunk)."""
    decode = cfg.decode
    target = load_target(cfg.target, decoding=True, compile=decode.compile, max_context=decode.max_context)
    target.prefill_chunk = decode.prefill_chunk
    return target


def load_target_parts(section: TargetSection, device: str = "cpu", layer: int | None = None) -> TargetParts:
    """What a draft borrows from the target (griffin.target_parts), in the dtype resolved for
    ``section.device``: read by name from the weight files, never the whole target; a tiny target is
    built (it has no files). A checkpoint whose names differ from the model's loads whole, said in the log."""
    dtype = resolve_dtype(section.dtype, section.device)
    if section.tiny is not None:
        return TargetParts.of(build_tiny_target(section.tiny, dtype), layer)
    path = resolve_target_path(section.name, section.revision)
    try:
        return read_target_parts(path, dtype, device, layer, section.revision)
    except PartsUnreadable as why:
        logger.warning("reading the whole target %s for its embedding and head: %s", section.name, why)
        target = load_target(section, device=device)
        return TargetParts.of(target, layer)


def draft_feature_layers(cfg: RunConfig, target: TargetAdapter) -> tuple[int, ...]:
    """The target hidden states the configured draft reads (``DraftConfig.feature_layers``); () for a
    draft that reads the final feature."""
    from griffin.config import DraftConfig

    draft = DraftConfig.from_target(target.hf_config, variant=cfg.draft.variant, **cfg.draft.overrides)
    return tuple(draft.feature_layers or ())


def feature_layers(cfg: RunConfig, target: TargetAdapter) -> tuple[int, ...]:
    """The target hidden states that featurize stores beside the final feature: ``features.layers``,
    or with "auto" the ones the configured draft reads."""
    if cfg.features.layers == "auto":
        layers = draft_feature_layers(cfg, target)
    else:
        layers = tuple(cfg.features.layers)
    count = target.hf_config.get_text_config().num_hidden_layers
    if len(set(layers)) != len(layers) or any(not 0 <= i <= count for i in layers):
        raise ValueError(
            f"features.layers {list(layers)}: need distinct hidden-state indices in 0..{count} for "
            f"this target ({count} layers; 0 = the embeddings, {count} = the last layer)"
        )
    return layers


def run_assets(cfg: RunConfig) -> dict[str, Any]:
    """Build (once) or find the target named by ``cfg.target.name``; a tiny target needs nothing."""
    name = cfg.target.name
    if cfg.target.tiny is not None:
        return {"target": name, "kind": "tiny (random, built in memory)", "path": None}
    start = time.perf_counter()
    if name in ASSETS and cfg.target.revision is None:
        path, kind = str(prepare_asset(name)), f"asset (cache {default_cache_dir()})"
    else:  # resolve_target_path refuses a revision for an asset or a directory
        path, kind = resolve_target_path(name, cfg.target.revision), "local directory or HF hub id"
    print(f"target {name}: {path}" + (f" at revision {cfg.target.revision}" if cfg.target.revision else ""))
    found = {"target": name, "kind": kind, "path": path, "seconds": round(time.perf_counter() - start, 2)}
    return {**found, "revision": cfg.target.revision} if cfg.target.revision else found
