"""Batching through one replica: the same requests one at a time vs at once, through the endpoint.

SmolLM2-135M-Instruct with the shipped GRIFFIN draft, one decoder replica (``serve.num_cpus: 1``, as
on this 2-core machine), T=0 (or ``--temperature``, each question with its own seed), 64 tokens,
MT-Bench first turns, non-streaming with ``return_token_ids``. Interleaved over repetitions (medians):
- 4 requests one after another vs the same 4 at once (the acceptance: >= 2x tokens/s, outputs equal);
- 4 one after another drafting vs with ``"speculative": false`` (a lone request's speedup);
- 4 at once drafting (the replica's ``decode.policy``) vs 4 at once with ``"speculative": false``;
- 8 one after another vs 8 at once (the goal: >= 4x);
- 8 at once drafting (the replica's ``decode.policy``) vs 8 at once with ``"speculative": false``,
  every row plain: the same engine with speculation off (the goal: >= 1.0x).
Every output must equal its one-at-a-time output token for token, drafting or not: at T>0 too, since
a seeded request's tokens do not depend on its neighbours or on drafting (docs/method.md §5).

    python benchmarks/serve/batching_bench.py [--dtype float32] [--temperature 1] [--sampling-tree 4/1/3]
        [--policy TUNE_TREE_JSON] [--reps 2] [--name batching-....json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"


TEMPERATURE = 0.0  # --temperature


def complete(url: str, question: str, new: int, speculative: bool = True) -> list[int]:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": new,
        "temperature": TEMPERATURE,
        "seed": len(question),
        "return_token_ids": True,
        "speculative": speculative,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["speculative"]["token_ids"]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def one_by_one(url, questions, new, speculative=True):
    return [complete(url, q, new, speculative) for q in questions]


def at_once(url, questions, new, speculative=True):
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: complete(url, q, new, speculative), questions))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--policy", help="a tune_tree.json whose trees and policies the replica serves with (default: the config's)"
    )
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sampling-tree", help="decode.sampling_tree as total_tokens/depth/top_k (default: none)")
    parser.add_argument("--name", help="the result's file name here (default: from the dtype, T and sampling tree)")
    args = parser.parse_args()
    if args.policy and args.sampling_tree:
        parser.error("--policy serves the tuning's sampling tree: leave out --sampling-tree")
    global TEMPERATURE
    TEMPERATURE = args.temperature
    from pipeline.config import load_config
    from pipeline.evaluate.report import machine_identity
    from pipeline.resources.questions import load_questions
    from pipeline.serve.lifecycle import start_serve, stop_serve
    from pipeline.run import tuned_decode

    overrides = [
        f"target.dtype={args.dtype}",
        f"serve.draft_uri={DRAFT}",
        "serve.port=8011",
        "output_dir=/tmp/batching_bench",
    ]
    if args.sampling_tree:
        total, depth, top_k = args.sampling_tree.split("/")
        overrides += [f"decode.sampling_tree={{total_tokens: {total}, depth: {depth}, top_k: {top_k}}}"]
    cfg = load_config("jobs/configs/smollm2-quick.yaml", overrides)
    tuning = json.loads(Path(args.policy).read_text()) if args.policy else {}
    if tuning:  # its trees and policies, as griffin run applies them
        cfg = cfg.model_copy(update={"decode": tuned_decode(cfg.decode, tuning)})
    questions = [q["turns"][0] for q in load_questions("mt_bench", 8)]
    url = start_serve(cfg)
    try:
        at_once(url, questions[:2], 8)  # warm-up
        cases = {
            "4_one_by_one": lambda: one_by_one(url, questions[:4], args.new),
            "4_one_by_one_plain": lambda: one_by_one(url, questions[:4], args.new, speculative=False),
            "4_at_once": lambda: at_once(url, questions[:4], args.new),
            "4_at_once_plain": lambda: at_once(url, questions[:4], args.new, speculative=False),
            "8_one_by_one": lambda: one_by_one(url, questions, args.new),
            "8_at_once": lambda: at_once(url, questions, args.new),
            "8_at_once_plain": lambda: at_once(url, questions, args.new, speculative=False),
        }
        seconds, outputs = {name: [] for name in cases}, {}
        for rep in range(args.reps):
            names = list(cases)[rep % len(cases) :] + list(cases)[: rep % len(cases)]
            for name in names:
                spent, outputs[name] = timed(cases[name])
                seconds[name].append(spent)
    finally:
        stop_serve()
    assert (
        outputs["4_at_once"]
        == outputs["4_at_once_plain"]
        == outputs["4_one_by_one"]
        == outputs["8_one_by_one"][:4]
        == outputs["4_one_by_one_plain"]
    )
    assert outputs["8_at_once"] == outputs["8_one_by_one"] == outputs["8_at_once_plain"]
    tokens = {name: sum(len(ids) for ids in outputs[name]) for name in cases}
    rate = {name: tokens[name] / statistics.median(seconds[name]) for name in cases}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_identity(),
        "dtype": args.dtype,
        "temperature": args.temperature,
        "policy": cfg.speculation_policy.describe(),
        "sampling_policy": cfg.speculation_policy.describe_sampling(),
        "sampling_tree": cfg.decode.sampling_tree.label if cfg.decode.sampling_tree else None,
        "tuning": args.policy,  # the tune_tree.json applied, if any
        "new_tokens": args.new,
        "reps": args.reps,
        "tokens_per_s": rate,
        "seconds": seconds,
        "lone_speculative_vs_plain": rate["4_one_by_one"] / rate["4_one_by_one_plain"],
        "four_at_once_vs_one_by_one": rate["4_at_once"] / rate["4_one_by_one"],
        "four_policy_vs_plain": rate["4_at_once"] / rate["4_at_once_plain"],
        "eight_at_once_vs_one_by_one": rate["8_at_once"] / rate["8_one_by_one"],
        "eight_policy_vs_plain": rate["8_at_once"] / rate["8_at_once_plain"],
        "outputs_equal": True,
    }
    print(json.dumps(result, indent=2))
    suffix = ("" if args.dtype == "bfloat16" else "-fp32") + (f"-t{args.temperature:g}" if args.temperature else "")
    suffix += f"-sampling-{args.sampling_tree.replace('/', '-')}" if args.sampling_tree else ""
    (OUT / (args.name or f"batching{suffix}.json")).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
