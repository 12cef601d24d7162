"""How many decode rows fit a device: the KV cache a row needs at a context, against the memory left
once the target and the draft are loaded.

A row's cache is every target layer's keys and values over its context (``AttentionLayout.cache_shapes``:
heads x width per position, or a latent's width) plus the draft's one layer over twice that (its
catch-up). Llama-3.1-8B in bf16 holds 128 KiB a position: 17.2 GB a row at its 128k context, 1.07 GB at
8k. A replica checks ``max_batch`` rows at ``decode.max_context`` before it allocates anything.

Shape legend: rows R, heads H, capacity C, width W.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)
HEADROOM = 0.9  # of the free memory: activations, the allocator's slack and the logits live there too


def row_kv_bytes(target: Any, draft: Any, capacity: int) -> int:
    """One row's KV cache at ``capacity`` positions: the target's layers and the draft's (2x capacity)."""
    keys, values = target.layout.cache_shapes(target.hf_config, 1, capacity)  # (1, H, C, W) each
    per_layer = (math.prod(keys) + math.prod(values)) * target.dtype.itemsize
    total = per_layer * target.hf_config.num_hidden_layers
    if draft is not None:
        cfg = draft.cfg
        total += 2 * (2 * capacity) * cfg.num_key_value_heads * cfg.head_dim * draft.param_dtype.itemsize
    return total


def free_bytes(device: torch.device) -> int:
    """Memory the process can still take on ``device``: CUDA's free memory, else the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_rows_fit(target: Any, draft: Any, rows: int, context: int, slack: int, free: int | None = None) -> dict:
    """Refuse (ValueError naming the numbers and the settings that fit) when ``rows`` rows of ``context``
    positions (+ ``slack``: a tree's nodes) do not fit ``HEADROOM`` of the free memory; else the numbers."""
    free = free_bytes(target.device) if free is None else free
    per_row = row_kv_bytes(target, draft, context + slack)
    per_position = row_kv_bytes(target, draft, 1)
    numbers = {"rows": rows, "context": context, "row_bytes": per_row, "need": rows * per_row, "free": free}
    logger.info(
        "KV cache: %d rows x %.2f GB (decode.max_context %d) = %.2f GB of %.2f GB free on %s",
        rows, per_row / 1e9, context, rows * per_row / 1e9, free / 1e9, target.device,
    )  # fmt: skip
    if rows * per_row <= HEADROOM * free:
        return numbers
    room = HEADROOM * free
    fit_rows, fit_context = int(room // per_row), int(room / rows // per_position) - slack
    raise ValueError(
        f"serve.max_batch={rows} rows of decode.max_context={context} positions need {rows * per_row / 1e9:.1f} GB "
        f"of KV cache ({per_row / 1e9:.2f} GB a row) and {target.device} has {free / 1e9:.1f} GB free beside the "
        f"weights ({HEADROOM:.0%} usable): set serve.max_batch={max(fit_rows, 0)} at this context, or "
        f"decode.max_context={max(fit_context, 0)} at serve.max_batch={rows}"
    )
