"""Compiled decoding: the decode steps as ``torch.compile`` graphs over fixed shapes (``decode.compile``).

On a GPU a small target's decode step is bound by Python and kernel launches, not by the GPU (an
H200 spent ~2.5 ms of a ~30 ms SmolLM2 step computing). Three steps repeat every round, and each
becomes a compiled function with no Python work that scales with the KV length:
- the target's verify of the rows' trees (N nodes per row), which is also plain decoding's
  one-token step (N = 1): ``TargetAdapter.forward(..., compiled=True)``;
- the draft's step over rows (a tree level: K nodes per row; a catch-up: the committed pairs).

What keeps their shapes fixed:
- a catch-up of the committed pairs is padded to a power of two (``length_bucket``);
- the KV caches are preallocated (griffin.rows) and a forward attends over a *bucket* of columns,
  the next power of two >= the rows' longest end (at least ``MIN_BUCKET``), not the exact width:
  columns past a row's end are zeros and masked (griffin.rows' invariant), so the output is the same
  and one graph serves every length in the bucket;
- every write goes through per-row column indices (a tensor), never a Python slice;
- masks are always explicit, so transformers never builds one from Python-side lengths.

On CUDA the functions are captured as CUDA graphs (``mode="reduce-overhead"``; the KV buffers are
marked static, so the in-place cache writes are part of the graph); each (rows, nodes, bucket) shape
is recorded once per process. On CPU they run under inductor. Compiled graphs need ``torch.no_grad``,
not ``torch.inference_mode`` (inductor cannot trace through inference tensors' version counters):
``decode_mode`` picks the right one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

CompileSetting = Literal["auto", "on", "off"]
MIN_BUCKET = 64  # the smallest attended width: short prompts share one graph


def compile_enabled(setting: CompileSetting, device: str | torch.device) -> bool:
    """``decode.compile``: "auto" is on for CUDA and off elsewhere (on CPU it is opt-in: measure it)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"decode.compile must be 'auto', 'on' or 'off', got {setting!r}")
    return setting == "on" or (setting == "auto" and torch.device(device).type == "cuda")


def width_bucket(width: int, capacity: int) -> int:
    """The attended width for a forward whose longest row ends at ``width``: the next power of two
    >= width (at least MIN_BUCKET), capped at the cache's capacity. E.g. 70 -> 128, 10 -> 64."""
    bucket = max(MIN_BUCKET, 1 << (width - 1).bit_length())
    return max(width, min(bucket, capacity))


def length_bucket(length: int) -> int:
    """A compiled catch-up's padded length: the next power of two >= length (griffin.engine pads the
    draft's catch-up of the committed pairs to it), so catch-ups take log2(context) shapes, not one
    per length. E.g. 3 -> 4, 4 -> 4, 5 -> 8."""
    return 1 << (length - 1).bit_length()


def compile_step(fn: Any, device: torch.device) -> Any:
    """``fn`` compiled for decoding on ``device``, with dynamic shapes from the start: one graph
    serves every row count, node count and bucket, except that sizes 1 are specialised (a lone row,
    plain decoding's one node), so a step compiles at most four times per process. On CUDA each
    concrete shape is still recorded as its own CUDA graph, which costs a forward, not a compile."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    if device.type == "cuda":
        return torch.compile(fn, mode="reduce-overhead", dynamic=True)
    # on CPU, freezing makes the weights constants that inductor pre-packs for oneDNN, as
    # griffin.target.PackedLinear does for eager decoding (whose packed op inductor cannot lower)
    return torch.compile(fn, dynamic=True, options={"freezing": True})


def mark_static(tensors: list[torch.Tensor]) -> None:
    """Tell CUDA-graph capture that these buffers (the KV caches) keep their address across calls,
    so a graph may write them in place; a no-op off CUDA. Unguarded: another engine's buffers (an
    evaluation's vanilla and speculative engines) reuse the compiled graph and record their own
    CUDA graph, rather than compiling it again."""
    for tensor in tensors:
        if tensor.is_cuda:
            torch._dynamo.mark_static_address(tensor, guard=False)


def step_begin(device: torch.device) -> None:
    """Before each compiled call on CUDA: the previous call's outputs have been consumed, so its
    CUDA-graph output buffers may be reused."""
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


def graph_counts(device: torch.device) -> dict[str, int]:
    """CUDA graphs recorded so far by this thread (a graph tree per thread and device) and the
    compiles that fell back from CUDA graphs ("skipping cudagraphs"); zeros off CUDA. After warm-up a
    request should record none: a new one is a shape that the buckets did not cover."""
    from torch._dynamo.utils import counters

    skipped = int(counters["inductor"]["cudagraph_skips"])
    if device.type != "cuda":
        return {"recorded": 0, "skipped": skipped}
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    nodes = [node for roots in (manager.roots.values() if manager else ()) for node in roots]
    recorded = 0
    while nodes:  # every node of the tree is one recorded graph
        node = nodes.pop()
        recorded += 1
        nodes += [child for children in node.children.values() for child in children]
    return {"recorded": recorded, "skipped": skipped}


def decode_mode(compiled: bool) -> contextlib.AbstractContextManager:
    """The autograd mode a decode runs in: ``no_grad`` around compiled steps, else ``inference_mode``."""
    return torch.no_grad() if compiled else torch.inference_mode()
