"""The KV cache a decode row needs, the check a replica makes before allocating it, and the context cap."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from griffin.capacity import check_rows_fit, row_kv_bytes
from griffin.target import TargetAdapter
from pipeline.config import load_config
from pipeline.resources.targets import load_decoding_target, load_target

GB = 1e9


@pytest.fixture(scope="module")
def llama8b():
    """Llama-3.1-8B's shapes (128k context) on the meta device, bf16: no memory, no weights."""
    config = AutoConfig.for_model(
        "llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    return TargetAdapter(model)


def test_a_row_of_llama8b_holds_128_kib_a_position(llama8b):
    assert row_kv_bytes(llama8b, None, 1) == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    assert row_kv_bytes(llama8b, None, 131072) / GB == pytest.approx(17.18, abs=0.01)


def test_a_replica_that_cannot_hold_its_rows_is_refused_naming_what_fits(llama8b):
    """16 rows at the whole 128k context need 275 GB of KV: refused on an 80 GB device with 64 GB left,
    naming the rows that fit at that context and the context that fits 16 rows; the default cap (8k)
    fits."""
    free = int(64 * GB)
    with pytest.raises(ValueError) as refused:
        check_rows_fit(llama8b, None, 16, 131072, 0, free=free)
    message = str(refused.value)
    assert "serve.max_batch=16 rows of decode.max_context=131072 positions need 274.9 GB" in message
    assert (
        "serve.max_batch=3 at this context" in message and "decode.max_context=27465 at serve.max_batch=16" in message
    )
    fits = check_rows_fit(llama8b, None, 16, 8192, 0, free=free)
    assert fits["need"] / GB == pytest.approx(17.18, abs=0.01)
    check_rows_fit(llama8b, None, 16, 27465, 0, free=free)  # what the message proposed does fit


def test_decode_max_context_caps_a_decoding_target():
    cfg = load_config("jobs/configs/tiny.yaml")
    positions = cfg.target.tiny.get("max_position_embeddings", 512)
    assert load_target(cfg.target, decoding=True, max_context=64).max_context == 64
    assert load_target(cfg.target, decoding=True, max_context=10**6).max_context == positions
    assert load_target(cfg.target, decoding=True, max_context=None).max_context == positions
    assert load_config("jobs/configs/tiny.yaml").decode.max_context == 8192


def test_a_runs_decode_settings_reach_its_decoding_target():
    """serve, eval, tune-tree and check-target load through load_decoding_target: the context cap
    and the prefill chunk (2048 by default; null: a prompt at once) come from the run's decode section."""
    chunked = load_decoding_target(
        load_config("jobs/configs/tiny.yaml", ["decode.max_context=64", "decode.prefill_chunk=16"])
    )
    assert (chunked.max_context, chunked.prefill_chunk) == (64, 16)
    assert load_decoding_target(load_config("jobs/configs/tiny.yaml")).prefill_chunk == 2048
    assert (
        load_decoding_target(load_config("jobs/configs/tiny.yaml", ["decode.prefill_chunk=null"])).prefill_chunk is None
    )
