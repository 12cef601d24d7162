"""Loading the run's target (real or tiny) and fingerprinting it for lineage checks.

``load_target(cfg.target)`` is what every stage calls. A ``tiny`` section builds a seeded random
llama with a byte-level ChatML tokenizer, so every process (featurize actors, train workers, serve
replicas) gets bit-identical weights without any file or download.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from griffin.target import TargetAdapter, resolve_dtype
from pipeline.config import TargetSection

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
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        additional_special_tokens=TINY_SPECIALS[1:],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_target(fields: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> TargetAdapter:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    vocab = max(fields.get("vocab_size", 0), len(tokenizer))
    config = LlamaConfig(**{**fields, "vocab_size": vocab}, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # identical weights in every process that builds it
    model = LlamaForCausalLM(config).to(dtype)
    torch.random.set_rng_state(generator_state)
    return TargetAdapter(model, tokenizer, name="tiny-llama")


def load_target(section: TargetSection, decoding: bool = False) -> TargetAdapter:
    """The run's target; ``decoding=True`` (serve, eval) also applies ``section.prepack``."""
    dtype = resolve_dtype(section.dtype)
    if section.tiny is not None:
        target = build_tiny_target(section.tiny, dtype)
        target.model.to(section.device)
    else:
        target = TargetAdapter.from_pretrained(section.name, dtype=dtype, device=section.device)
    if decoding and section.prepack:
        target.prepack()
    return target


def _sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def _weights_hash(target: TargetAdapter) -> str:
    """sha256 over every tensor's name, shape, dtype and raw bytes (~0.5 s for a 135M model)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(target.model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def target_fingerprint(target: TargetAdapter) -> dict[str, Any]:
    """What a feature store and a draft must agree on with the target they are used with."""
    cached = getattr(target, "_fingerprint", None)
    if cached is not None:
        return cached
    tokenizer = target.tokenizer
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    target._fingerprint = {
        "target_id": target.name,
        "target_weights_sha256": _weights_hash(target),
        "tokenizer_sha256": _sha256_text(repr(sorted(vocab.items()))),
        "chat_template_sha256": _sha256_text(getattr(tokenizer, "chat_template", None)),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "architecture": target.hf_config.model_type,
    }
    return target._fingerprint
