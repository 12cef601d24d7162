"""``griffin tune-tree``: the draft-tree budget that maximises expected tokens/s on this hardware.

EAGLE-2's ``total_token=-1`` picks the tree size from the target's measured speed. We measure both
halves of the trade-off, in one process:

- the target's verify cost curve: a round's verify phase in the engine that serves (compiled when
  compiled: one batched verify pass of N tree tokens after a fixed prefix, the T=0 walk and the KV
  commit, the walk no deeper than the deepest tree searched; griffin.offline.verify_cost) for every
  N of the grid, interleaved over repetitions
  (medians): the hardware fact that makes wide trees expensive on a CPU (compute-bound) and nearly
  free on a GPU (bandwidth-bound);
- per candidate tree (total_tokens, depth, top_k): tau at T=0 and the median drafting seconds of a
  round, over every calibration prompt, replayed with the draft alone from each prompt's greedy
  continuation (``griffin.replay``: the rounds the decoder would run, at a fifth to a tenth of
  their cost; replayed and decoded drafting times agree, benchmarks/history.md).

Expected tokens/s = tau / (median draft seconds + the curve at total_tokens); prefill is the same
for every candidate and left out. Vanilla tokens/s comes from the decodes that made the
continuations. Every candidate is timed against the same curve, so two trees of one size differ only
by what differs between them: tau and drafting. A coordinate search starts at the evaluation tree (``eval.tree`` or
``decode.tree``) and sweeps total_tokens, depth and top_k ``decode.tune_sweeps`` times (default
twice). The calibration prompts are the *last* questions of ``eval.datasets``; the evaluation takes
the first ones, so it never scores the tree on the prompts that picked it.

A second search, from a shallow 4/1/3, picks ``decode.sampling_tree`` at T=1: the same replay on each
prompt's seeded T=1 continuation, which a seeded speculative decode commits exactly (draws keyed by
position, griffin.verify), so τ at T=1 is measured, not estimated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate
from griffin.results import acceptance_length
from griffin.policy import SpeculationPolicy
from griffin.offline import verify_cost
from griffin.replay import GREEDY, DecodeReference, decode_reference, replay_decode
from pipeline import console
from pipeline.config import RunConfig
from pipeline.evaluate.batch_policy import candidate_trees, measure_policy, policy_json, policy_table
from pipeline.files import atomic_write_text, finished, reuse_key

logger = logging.getLogger(__name__)
TOTAL_TOKENS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEPTHS = (2, 3, 4, 5, 6, 8)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)
POLICY_MAX_NEW = 32  # tokens per prompt when measuring the policy (a batch of 8 x 5 options x 2 repetitions)
CURVE_PREFIX = 256  # committed tokens before the verified tree (a mid-conversation context)
SAMPLING = SamplingConfig(temperature=1.0)  # decode.sampling_tree is tuned at the API's default temperature
SAMPLING_START = TreeConfig(total_tokens=4, depth=1, top_k=3)  # a wide, shallow start: T=1 accepts little
# the engine's KV slack for every tree of the search: one engine (compiled: one capture) serves them all
SEARCH_POLICY = SpeculationPolicy({1: TreeConfig(total_tokens=max(TOTAL_TOKENS), depth=max(DEPTHS), top_k=max(TOP_KS))})


@dataclass(frozen=True)
class Candidate:
    total_tokens: int
    depth: int
    top_k: int
    tau: float
    draft_ms: float  # median per round
    verify_ms: float  # the verify cost curve at total_tokens: target forward + acceptance + KV compaction
    tokens_per_s: float  # expected: tau / (draft + verify)

    @property
    def tree(self) -> TreeConfig:
        return TreeConfig(total_tokens=self.total_tokens, depth=self.depth, top_k=self.top_k)


def verify_cost_curve(target: Any, draft: Any, sizes: tuple[int, ...], repeats: int = 7) -> dict[int, float]:
    """Median ms of a round's verify phase for N tree tokens, after a fixed random prefix, in the
    engine that decodes for ``draft``, sized for every tree of the search."""
    prefix = torch.randint(0, target.vocab_size, (CURVE_PREFIX,), generator=torch.Generator().manual_seed(0))
    seconds = verify_cost(target, draft, SEARCH_POLICY, prefix.tolist(), sizes, repeats, max(DEPTHS))
    return {n: 1e3 * median(values) for n, values in seconds.items()}


def measure_tree(
    draft: Any, references: list[DecodeReference], tree: TreeConfig, verify_ms_by_tokens: dict[int, float]
) -> Candidate:
    """tau and the median drafting time of a round, replayed over every reference; the verify phase
    from the cost curve."""
    replays = [replay_decode(draft, reference, tree) for reference in references]
    tau = acceptance_length([a for replay in replays for a in replay.accepted_per_round])
    draft_s = median(s for replay in replays for s in replay.draft_seconds)
    verify_s = verify_ms_by_tokens[tree.total_tokens] / 1e3
    return Candidate(
        tree.total_tokens, tree.depth, tree.top_k, tau, 1e3 * draft_s, 1e3 * verify_s, tau / (draft_s + verify_s)
    )


def coordinate_search(
    score: Callable[[TreeConfig], Candidate],
    start: TreeConfig,
    sweeps: int = 2,
    grids: dict[str, tuple[int, ...]] | None = None,
) -> tuple[Candidate, list[Candidate]]:
    """Sweep each budget field over its grid, keep the best, repeat. Trees whose depth x top_k
    cannot propose total_tokens - 1 nodes are skipped (TreeConfig refuses them)."""
    grids = grids or {"total_tokens": TOTAL_TOKENS, "depth": DEPTHS, "top_k": TOP_KS}
    seen: dict[tuple[int, int, int], Candidate] = {}
    best = start
    for _ in range(sweeps):
        for name, grid in grids.items():
            for value in grid:
                try:
                    tree = TreeConfig(**{**best.model_dump(), name: value})
                except ValueError:
                    continue
                key = (tree.total_tokens, tree.depth, tree.top_k)
                if key not in seen:
                    seen[key] = score(tree)
                    logger.info("tune-tree: %s", seen[key])
            best = max(seen.values(), key=lambda c: c.tokens_per_s).tree
    ranked = sorted(seen.values(), key=lambda c: -c.tokens_per_s)
    return ranked[0], ranked


def calibration_prompts(cfg: RunConfig, tokenizer: Any, count: int) -> list[torch.Tensor]:
    """First turns of the last ``count`` questions, spread over ``eval.datasets``."""
    from pipeline.resources.questions import load_questions
    from pipeline.data.chat import render_chat

    per_dataset = max(1, -(-count // len(cfg.eval.datasets)))
    prompts = []
    for name in cfg.eval.datasets:
        for question in load_questions(name)[-per_dataset:]:
            prompts.append(torch.tensor([render_chat(tokenizer, [{"role": "user", "content": question["turns"][0]}])]))
    return prompts[:count]


def tune_settings(cfg: RunConfig, draft_uri: str, prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """What a tuning's answer depends on: the draft, the target and its dtype, the calibration, the
    search and the machine (a verify that is cheap on one CPU or GPU is dear on another)."""
    from pipeline.evaluate.report import machine_identity

    return {
        "draft": draft_uri,
        "target": cfg.target.model_dump(mode="json"),
        "datasets": list(cfg.eval.datasets),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "sweeps": cfg.decode.tune_sweeps,
        "batches": sorted(set(cfg.decode.tune_batches) | {1}),
        "start": cfg.eval_tree.model_dump(),
        "sampling": {
            "temperature": SAMPLING.temperature,
            "start": (cfg.decode.sampling_tree or SAMPLING_START).model_dump(),
            "policy_over": "ranked",  # its policy measures the search's candidate trees (it measured the best alone)
        },
        "machine": machine_identity(),
    }


def reusable_tuning(cfg: RunConfig, draft_uri: str) -> dict[str, Any] | None:
    """The finished ``tune_tree.json`` of this run when it tuned exactly what a new tuning with the
    config's defaults would (same draft, settings and machine), else None."""
    from pipeline.resources.drafts import canonical_draft_uri

    wanted = tune_settings(cfg, canonical_draft_uri(draft_uri), cfg.decode.tune_prompts, cfg.decode.tune_max_new_tokens)
    return finished(cfg.run_dir / "tune_tree" / "tune_tree.json", reuse_key(wanted))


def run_tune_tree(
    cfg: RunConfig, draft: str | None = None, prompts: int | None = None, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """``griffin tune-tree``: measure, search, write ``<run_dir>/tune_tree/`` and print the overrides.
    Calibration defaults to ``decode.tune_prompts`` x ``decode.tune_max_new_tokens``."""
    from pipeline.resources.drafts import draft_for_run
    from pipeline.resources.targets import load_decoding_target

    prompts, max_new_tokens = prompts or cfg.decode.tune_prompts, max_new_tokens or cfg.decode.tune_max_new_tokens
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    target = load_decoding_target(cfg)
    draft_model, draft_uri = draft_for_run(cfg, target, draft)
    calibration = [ids.to(target.device) for ids in calibration_prompts(cfg, target.tokenizer, prompts)]
    curve = verify_cost_curve(target, draft_model, (1, *TOTAL_TOKENS))
    logger.info("tune-tree: verify cost curve (ms by tree tokens): %s", {n: round(ms, 1) for n, ms in curve.items()})
    speculative_generate(target, draft_model, calibration[0], cfg.eval_tree, GREEDY, 8)  # warm-up
    sweeps = cfg.decode.tune_sweeps
    best, ranked, vanilla = search(
        target, draft_model, calibration, max_new_tokens, curve, GREEDY, cfg.eval_tree, sweeps
    )
    # the sampling tree: replayed on seeded T=1 continuations, which a seeded speculative decode reproduces
    start = cfg.decode.sampling_tree or SAMPLING_START
    sampling_best, sampling_ranked, sampling_vanilla = search(
        target, draft_model, calibration, max_new_tokens, curve, SAMPLING, start, sweeps
    )
    policy, policy_curve = serving_policy(cfg, target, draft_model, calibration, ranked, best, max_new_tokens)
    # the sampling rounds' policy, from the T=1 search's trees, measured at T=1
    sampling_policy, sampling_curve = serving_policy(
        cfg, target, draft_model, calibration, sampling_ranked, sampling_best, max_new_tokens, SAMPLING
    )
    settings = tune_settings(cfg, draft_uri, prompts, max_new_tokens)
    result = {
        "key": reuse_key(settings),  # what a later run compares to reuse this tuning (``reusable_tuning``)
        "settings": settings,
        "target": target.name,
        "prepacked": target.packed,
        "verify_ms_by_tokens": curve,
        "vanilla_tokens_per_s": vanilla,
        "best": asdict(best),
        "expected_speedup": best.tokens_per_s / vanilla,
        "candidates": [asdict(c) for c in ranked],
        "policy": policy_json(policy),  # decode.policy: the tree per batch size of a serving replica
        "policy_curve": policy_curve,
        "sampling": {
            "temperature": SAMPLING.temperature,
            "best": asdict(sampling_best),
            "vanilla_tokens_per_s": sampling_vanilla,
            "expected_speedup": sampling_best.tokens_per_s / sampling_vanilla,
            "candidates": [asdict(c) for c in sampling_ranked],
            "policy": policy_json(sampling_policy),  # decode.sampling_policy
            "policy_curve": sampling_curve,
        },  # fmt: skip
        "overrides": [
            f"decode.{field}.{name}={getattr(tree, name)}"
            for field, tree in (("tree", best), ("sampling_tree", sampling_best))
            for name in ("total_tokens", "depth", "top_k")
        ],  # fmt: skip
    }
    out = cfg.run_dir / "tune_tree"
    write_tune_report(out, result)
    _say_result(result, out)
    return {
        "best": asdict(best),
        "tree": best.tree.model_dump(),
        "sampling": result["sampling"],
        "policy": result["policy"],
        "expected_speedup": round(result["expected_speedup"], 3),
        "report": str(out),
    }


def _say_result(result: dict[str, Any], out: Path) -> None:
    """Log and print the tuning's answer and the overrides that apply it."""
    best, vanilla, sampling = result["best"], result["vanilla_tokens_per_s"], result["sampling"]
    sampled = sampling["best"]
    label, sampled_label = (
        TreeConfig(**{k: tree[k] for k in TreeConfig.model_fields}).label for tree in (best, sampled)
    )
    logger.info(
        "tune-tree: best %s, expected %.2fx vanilla (%.1f tokens/s)", label, result["expected_speedup"], vanilla
    )
    print(
        f"best tree: total_tokens={best['total_tokens']} depth={best['depth']} top_k={best['top_k']}: tau "
        f"{best['tau']:.2f}, expected {best['tokens_per_s']:.1f} tokens/s = {result['expected_speedup']:.2f}x vanilla "
        f"({vanilla:.1f} tokens/s)\nat T={sampling['temperature']:g}: "
        f"{sampled_label}, tau {sampled['tau']:.2f}, expected "
        f"{sampling['expected_speedup']:.2f}x vanilla\nuse: {' '.join(result['overrides'])}\n"
        f"report: {out / 'tune_tree.md'}"
    )
    if result["expected_speedup"] < 1.0:
        print(
            "warning: no tree budget beats vanilla decoding with this draft on this machine: the draft's "
            "acceptance is too low for the cost of a draft + verify round here; train it longer or serve without it"
        )


def search(
    target: Any,
    draft: Any,
    calibration: list[torch.Tensor],
    max_new_tokens: int,
    curve: dict[int, float],
    sampling: SamplingConfig,
    start: TreeConfig,
    sweeps: int,
) -> tuple[Candidate, list[Candidate], float]:
    """The coordinate search from ``start``, every tree replayed on the calibration prompts'
    continuations at ``sampling`` (prompt i with seed i): the best, every candidate ranked, and
    vanilla tokens/s from the decodes that made the continuations."""
    references = [
        decode_reference(target, ids, max_new_tokens, max(DEPTHS), draft.cfg.feature_layers, sampling=sampling, seed=i)
        for i, ids in enumerate(calibration)
    ]  # (the lookahead covers the deepest tree of the search)
    vanilla = 1.0 / median(reference.vanilla_step_seconds for reference in references)
    label = "tune-tree" if sampling.greedy else f"tune-tree T={sampling.temperature:g}"
    progress = console.Progress(label, sweeps * (len(TOTAL_TOKENS) + len(DEPTHS) + len(TOP_KS)), "trees (at most)")

    def score(tree: TreeConfig) -> Candidate:
        candidate = measure_tree(draft, references, tree, curve)
        progress.update(progress.done + 1, f"last τ {candidate.tau:.2f}")
        return candidate

    best, ranked = coordinate_search(score, start, sweeps)
    progress.close(f"best {best.tree.label}")
    return best, ranked, vanilla


def serving_policy(
    cfg: RunConfig,
    target: Any,
    draft: Any,
    calibration: list[torch.Tensor],
    ranked: list[Candidate],
    best: Candidate,
    max_new: int,
    sampling: SamplingConfig = GREEDY,
) -> tuple[dict[int, TreeConfig | None], list[dict[str, Any]]]:
    """decode.policy (at T=0) or decode.sampling_policy (``sampling``) measured on the calibration
    prompts (pipeline.evaluate.batch_policy); a lone request keeps the searched tree, as evaluation
    decodes with it."""
    prompts = [ids[0].tolist() for ids in calibration]
    trees = candidate_trees([asdict(c) for c in ranked])
    policy, curve = measure_policy(
        target, draft, prompts, trees, cfg.decode.tune_batches, min(max_new, POLICY_MAX_NEW), 1, sampling
    )
    policy[1] = best.tree
    return policy, curve


def candidate_table(candidates: list[dict[str, Any]], vanilla: float) -> list[str]:
    """Markdown rows of the searched trees, as ranked."""
    return [
        "| total_tokens | depth | top_k | tau | draft ms/round | verify ms/round | expected tokens/s | vs vanilla |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {c['total_tokens']} | {c['depth']} | {c['top_k']} | {c['tau']:.2f} | {c['draft_ms']:.1f} | "
            f"{c['verify_ms']:.1f} | {c['tokens_per_s']:.1f} | {c['tokens_per_s'] / vanilla:.2f}x |"
            for c in candidates
        ),
    ]


def write_tune_report(out: Path, result: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "tune_tree.json", json.dumps(result, indent=2))
    curve = result["verify_ms_by_tokens"]
    step = curve[1] if 1 in curve else curve[min(curve)]
    settings = result["settings"]
    lines = [
        f"# Tree budget for {result['target']} with draft {settings['draft']}",
        "",
        f"Vanilla decoding: {result['vanilla_tokens_per_s']:.1f} tokens/s. Calibration: "
        f"{settings['prompts']} prompts x {settings['max_new_tokens']} tokens at T=0.",
        "",
        "| tree tokens N | verify ms | / one decode step |",
        "| ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {ms:.1f} | {ms / step:.2f}x |" for n, ms in curve.items()]
    sampling = result["sampling"]
    lines += ["", *candidate_table(result["candidates"], result["vanilla_tokens_per_s"])]
    lines += [
        "",
        f"At T={sampling['temperature']:g} (`decode.sampling_tree`; replayed on seeded continuations; vanilla "
        f"{sampling['vanilla_tokens_per_s']:.1f} tokens/s), the best trees:",
        "",
        *candidate_table(sampling["candidates"][:8], sampling["vanilla_tokens_per_s"]),
        "",
        "Serving: decode tokens/s of the calibration prompts decoded B at a time (griffin.engine), per",
        "option; `decode.policy` is the best per batch size (at batch 1, the searched tree):",
        "",
        *policy_table(result["policy_curve"], result["policy"]),
        "",
        f"At T={sampling['temperature']:g}, `decode.sampling_policy`: the same measurement of the T="
        f"{sampling['temperature']:g} search's trees, for rounds whose drafting rows all sample:",
        "",
        *policy_table(sampling["policy_curve"], sampling["policy"]),
    ]
    atomic_write_text(out / "tune_tree.md", "\n".join(lines) + "\n")

    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    left.plot(list(curve), list(curve.values()), marker="o")
    left.set(xlabel="tree tokens verified in one pass", ylabel="ms", title="target verify cost")
    by_total: dict[int, float] = {}
    for c in result["candidates"]:
        by_total[c["total_tokens"]] = max(by_total.get(c["total_tokens"], 0.0), c["tokens_per_s"])
    totals = sorted(by_total)
    right.plot(totals, [by_total[n] for n in totals], marker="o", label="best tree of that size")
    right.axhline(result["vanilla_tokens_per_s"], color="grey", linestyle="--", label="vanilla")
    right.set(xlabel="total_tokens", ylabel="expected tokens/s", title="expected speed")
    right.legend()
    figure.tight_layout()
    figure.savefig(out / "tune_tree.png", dpi=110)
