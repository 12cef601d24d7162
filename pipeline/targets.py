"""The tiny random target of the tests: ``build_tiny_target(fields, dtype)``.

A ``target.tiny`` section (``pipeline.resources.load_target``) builds a seeded random llama with a
byte-level ChatML tokenizer, so every process (featurize actors, train workers, serve replicas)
gets bit-identical weights without any file or download.
"""

from __future__ import annotations

from typing import Any

import torch

from griffin.target import TargetAdapter

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
