"""Decoding outside a server: requests through a pooled ``BatchEngine`` (evaluation, tune-tree,
check-target, ``griffin.decode``'s one-request functions and tests), its warm-up, and the verify
phase's cost as that engine runs it.

Compiled decoding keeps one engine per draft on the target: CUDA graphs are captured over the
engine's KV buffers, so a new engine per call would capture them again and hold its own buffers.

Shape legend: N tree nodes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from griffin.config import SamplingConfig
from griffin.results import GenerationResult, device_time
from griffin.engine import BatchEngine
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.model import GriffinDraft
from griffin.target import TargetAdapter
from griffin.tree import chain_tree


def generate_batch(
    target: TargetAdapter,
    draft: GriffinDraft | None,
    requests: list[DecodeRequest],
    policy: SpeculationPolicy,
    max_rows: int | None = None,
) -> list[GenerationResult]:
    """Decode ``requests`` together; results in request order."""
    with engine_for(target, draft, policy, max_rows or len(requests)) as engine:
        rows = [engine.submit(request) for request in requests]
        engine.run_until_idle()
    results = []
    for row in rows:
        if row.error is not None:
            raise row.error
        assert row.result is not None, "an idle engine has finished every row"
        results.append(row.result)
    return results


@contextlib.contextmanager
def engine_for(
    target: TargetAdapter, draft: GriffinDraft | None, policy: SpeculationPolicy, max_rows: int
) -> Iterator[BatchEngine]:
    """An idle engine for one offline decode. Compiled decoding keeps one engine per draft on the
    target and reuses it with the call's policy (an evaluation's every question, tune-tree's every
    candidate); it is replaced by a larger one when a call needs more rows or a wider tree. Eager
    decoding, or a pooled engine in use by another thread, gets a fresh one."""
    if target.compiled_forward is None:
        yield BatchEngine(target, draft, policy, max_rows)
        return
    pool = target.__dict__.setdefault("idle_engines", {})
    engine, lock = pool.setdefault(id(draft), (None, threading.Lock()))
    if not lock.acquire(blocking=False):
        yield BatchEngine(target, draft, policy, max_rows)
        return
    try:
        if engine is None or engine.max_rows < max_rows or engine.tree_slack < policy.tree_slack:
            pool[id(draft)] = (None, lock)  # the old buffers go before the new ones are allocated
            engine = None
            engine = BatchEngine(target, draft, policy, max_rows)
            pool[id(draft)] = (engine, lock)
        engine.policy = policy
        yield engine
    finally:
        lock.release()


def warm_up(target: TargetAdapter, draft: GriffinDraft | None, policy: SpeculationPolicy) -> None:
    """``BatchEngine.warm_up`` for the engine that ``generate_batch`` then decodes a lone request with."""
    with engine_for(target, draft, policy, 1) as engine:
        engine.warm_up([1])


def verify_cost(
    target: TargetAdapter,
    draft: GriffinDraft | None,
    policy: SpeculationPolicy,
    prompt: list[int],
    sizes: tuple[int, ...],
    repeats: int,
    depth: int,
) -> dict[int, list[float]]:
    """Seconds of a round's verify phase for trees of N nodes, ``repeats`` times each after one
    untimed repetition, sizes in rotating order: one row after ``prompt``, in the engine that decodes
    for ``draft`` with ``policy`` (compiled when the target is; its trees' slack must hold max(sizes)
    nodes), verifying N random tokens at T=0 (the batched target pass, the walk, the KV commit) in a
    tree at most ``depth`` deep (griffin.tree.chain_tree): the pass costs by N, the walk by depth."""
    assert policy.tree_slack >= max(sizes), f"a policy for trees of up to {policy.tree_slack} nodes, not {max(sizes)}"
    generator = torch.Generator().manual_seed(0)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    # each call keeps its root and what it accepts (random tokens: rarely anything), within the context
    room = min((repeats + 1) * len(sizes) * (depth + 1) + 2, target.max_context - len(prompt))
    with engine_for(target, draft, policy, 1) as engine:
        row = engine.submit(DecodeRequest(prompt, SamplingConfig(), room, stop_token_ids=[], speculative=False))
        while not engine.rows:  # the prefill (in chunks when long), then one plain round
            engine.step()
        try:
            for rep in range(repeats + 1):
                for n in sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]:
                    root = torch.tensor([row.root], device=target.device)
                    tokens = torch.randint(0, target.vocab_size, (n - 1,), generator=generator)
                    tree = chain_tree(root, tokens, depth)
                    start = device_time(target.device)
                    engine.verify_only([tree])
                    if rep:
                        seconds[n].append(device_time(target.device) - start)
        finally:
            engine.cancel(row)
            engine.step()  # the row leaves; its slot is zeroed
    return seconds
