"""tune-tree's second half: the speculation policy of a serving replica, measured per batch size.

At batch 1 a draft round pays when tau / (draft + verify) beats one decode step. With B rows, one
round verifies B trees in one pass: on a GPU that is nearly free (memory-bound), on a CPU it is
B x N tokens of compute, while B plain rows cost barely more than one. So the best tree shrinks with
the batch, down to "none" (vLLM turns speculation off above a batch size for the same reason).

For each batch size B of ``decode.tune_batches`` we decode B calibration prompts at once through
the engine (griffin.engine) with each option, interleaved over repetitions: plain decoding, and a
few candidate trees from the batch-1 search (its best, and the best of each smaller size). The
option with the most decode tokens/s (prefills left out: they are the same for every option) is the
policy's entry for B (a tree only when it beats plain rows by ``PLAIN_MARGIN``). Real decodes, not
a model: tau, drafting, verify and the engine's own work are all in the figure.
"""

from __future__ import annotations

from statistics import median
from typing import Any


from griffin.config import SamplingConfig, TreeConfig
from griffin.results import device_time
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.offline import generate_batch

GREEDY = SamplingConfig()
CANDIDATES = 4  # trees measured per batch size besides plain decoding
# A tree is picked over plain rows only when it decodes this much faster: the measurement leaves out
# what serving adds to a drafting round (prefills between rounds, the catch-up after plain ones) and
# repeats once, so a tie goes to plain rows. Seen: at batch 4, T=1, 84.1 vs 83.8 tokens/s here, and
# 0.85x plain rows through the endpoint (benchmarks/serve/batching-fp32-t1-sampling-4-1-8-tree-at-4.json).
PLAIN_MARGIN = 1.05


def candidate_trees(ranked: list[dict[str, Any]]) -> list[TreeConfig]:
    """The batch-1 best tree and the best tree of each smaller total_tokens, at most ``CANDIDATES``."""
    best = ranked[0]
    picked: dict[int, TreeConfig] = {}
    for c in ranked:
        if c["total_tokens"] <= best["total_tokens"] and c["total_tokens"] not in picked:
            picked[c["total_tokens"]] = TreeConfig(total_tokens=c["total_tokens"], depth=c["depth"], top_k=c["top_k"])
    return list(picked.values())[:CANDIDATES]


def decode_tokens_per_s(
    target: Any,
    draft: Any,
    prompts: list[list[int]],
    tree: TreeConfig | None,
    max_new: int,
    sampling: SamplingConfig = GREEDY,
) -> float:
    """Decode tokens/s of ``prompts`` decoded together with ``tree`` (None: plain) at ``sampling`` (row i
    seeded i), prefills left out."""
    requests = [DecodeRequest(p, sampling, max_new, i, stop_token_ids=[]) for i, p in enumerate(prompts)]
    start = device_time(target.device)
    results = generate_batch(target, draft, requests, SpeculationPolicy({1: tree}, {1: tree}))
    elapsed = device_time(target.device) - start - sum(r.stats.prefill_time for r in results)
    return sum(len(r.tokens) - 1 for r in results) / elapsed  # the first token of each is the prefill's


def measure_policy(
    target: Any,
    draft: Any,
    prompts: list[list[int]],
    trees: list[TreeConfig],
    batches: list[int],
    max_new: int,
    reps: int = 2,
    sampling: SamplingConfig = GREEDY,
) -> tuple[dict[int, TreeConfig | None], list[dict[str, Any]]]:
    """The best option per batch size at ``sampling``, and every measurement: rows of {batch, tree,
    tokens_per_s}. The engine picks its own autograd mode: compiled steps cannot run under
    ``inference_mode``."""
    options: list[TreeConfig | None] = [None, *trees]
    policy: dict[int, TreeConfig | None] = {}
    curve: list[dict[str, Any]] = []
    for batch in sorted(set(batches) | {1}):
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        samples: list[list[float]] = [[] for _ in options]
        for rep in range(reps + 1):  # repetition 0 warms up (oneDNN primitives for the new shapes)
            for i in list(range(len(options)))[rep % len(options) :] + list(range(len(options)))[: rep % len(options)]:
                speed = decode_tokens_per_s(target, draft, batch_prompts, options[i], max_new, sampling)
                if rep:
                    samples[i].append(speed)
        speeds = [median(s) for s in samples]
        for option, speed in zip(options, speeds):
            curve.append({"batch": batch, "tree": _label(option), "tokens_per_s": speed})
        policy[batch] = pick(options, speeds)
    return policy, curve


def pick(options: list[TreeConfig | None], speeds: list[float]) -> TreeConfig | None:
    """The fastest option, unless it is a tree within ``PLAIN_MARGIN`` of plain rows (``options[0]``)."""
    fastest = max(range(len(options)), key=speeds.__getitem__)
    return options[fastest] if speeds[fastest] > PLAIN_MARGIN * speeds[0] else None


def _label(tree: TreeConfig | None) -> str:
    return "plain" if tree is None else tree.label


def policy_json(policy: dict[int, TreeConfig | None]) -> dict[str, Any]:
    """{"1": {"total_tokens": ..}, "4": null}: the form decode.policy takes in YAML and JSON."""
    return {str(batch): (tree.model_dump() if tree else None) for batch, tree in policy.items()}


def policy_table(curve: list[dict[str, Any]], policy: dict[str, Any]) -> list[str]:
    """Markdown: decode tokens/s per batch size (rows) and option (columns), the policy's pick in bold."""
    labels = list(dict.fromkeys(row["tree"] for row in curve))
    batches = sorted({row["batch"] for row in curve})
    lines = ["| batch | " + " | ".join(labels) + " | policy |", "| ---: |" + " ---: |" * (len(labels) + 1)]
    for batch in batches:
        picked = _label(TreeConfig(**policy[str(batch)]) if policy[str(batch)] else None)
        cells = []
        for label in labels:
            speed = next(r["tokens_per_s"] for r in curve if r["batch"] == batch and r["tree"] == label)
            cells.append(f"**{speed:.1f}**" if label == picked else f"{speed:.1f}")
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {picked} |")
    return lines
