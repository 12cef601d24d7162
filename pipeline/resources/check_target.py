"""``griffin check-target -c CONFIG``: will speculative decoding be lossless on this target?

Before GPU hours go into featurizing and training, this answers for the user's own target (``target.name``:
a hub id, a directory or an asset; or a ``target.tiny`` config):
1. its family and what it uses, from its config alone (griffin.families), or the refusal that names why;
2. unless ``--config-only``: a short T=0 check on the loaded target, as the run would decode it
   (``target.dtype``, ``decode.compile``), with an *untrained* draft of the configured variant. Nearly
   every draft token is rejected, so every round takes a different path through the tree mask. Prompts
   are longer than the target's window, so windowed layers cut the prefix. Checked: vanilla decoding ==
   transformers' greedy ``generate`` (first prompt), speculative decoding of each prompt alone ==
   vanilla, and all prompts batched through one slot fewer than prompts (one joins mid-flight) == vanilla.

The verdict is "lossless", "refused" or "diverged" (exit 0, 1, 1). In fp32 any difference is a divergence;
in bf16 or fp16 a difference is allowed where the target's two candidates were a near-tie (within bf16
rounding: griffin.decode.first_divergence) and counted, anything else is a divergence. Each names its
prompt, position, the two tokens and the logit gap. ``griffin run`` runs step 1 before anything else.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.console import say


def target_config(cfg: RunConfig) -> Any:
    """The target's transformers config, read without loading any weight."""
    from transformers import AutoConfig

    from griffin.assets import resolve_target_path
    from pipeline.resources.targets import tiny_config

    section = cfg.target
    if section.tiny is not None:
        return tiny_config(section.tiny)
    return AutoConfig.from_pretrained(resolve_target_path(section.name, section.revision), revision=section.revision)


def check_family(cfg: RunConfig) -> dict[str, Any]:
    """The target's family and what it uses; ``UnsupportedTarget`` (a ValueError) naming why not."""
    from griffin.families import AttentionLayout

    config = target_config(cfg)
    layout = AttentionLayout.of(config)
    return {"family": layout.family.name, "model_type": layout.family.model_type, "uses": layout.describe(config)}


def run_check_target(
    cfg: RunConfig, config_only: bool = False, prompts: int = 3, max_new_tokens: int = 24
) -> dict[str, Any]:
    from griffin.families import UnsupportedTarget

    try:
        report = check_family(cfg)
    except UnsupportedTarget as refusal:
        say(f"verdict: REFUSED. {refusal}")
        return {"target": cfg.target.name, "verdict": "refused", "reason": str(refusal), "exit_code": 1}
    say(f"target {cfg.target.name}: family {report['family']} ({report['model_type']})")
    for line in report["uses"]:
        say(f"  {line}")
    report = {"target": cfg.target.name, **report}
    if config_only:
        say("verdict: SUPPORTED family (config only: decoding not checked; drop --config-only to check it)")
        return {**report, "verdict": "supported (config only)", "exit_code": 0}
    report.update(_check_decoding(cfg, prompts, max_new_tokens))
    return {**report, "exit_code": 0 if report["verdict"] == "lossless" else 1}


def _check_decoding(cfg: RunConfig, count: int, new: int) -> dict[str, Any]:
    """Step 2: T=0 exactness of speculative decoding with an untrained draft, alone and batched."""
    from griffin.decode import speculative_generate, vanilla_generate
    from griffin.request import DecodeRequest
    from griffin.offline import generate_batch
    from griffin.model import GriffinDraft
    from pipeline.resources.targets import load_decoding_target

    if count < 2:
        raise ValueError(f"--prompts {count}: the batched check needs at least 2 prompts")
    target = load_decoding_target(cfg)
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(target, variant=cfg.draft.variant, **cfg.draft.overrides)
    draft = draft.to(target.device)
    prompts = _prompts(target, count, new)
    greedy, tree = cfg.sampling(0.0), cfg.decode.tree
    say(f"decoding {count} prompts of {len(prompts[0])}+ tokens, {new} new tokens each, tree {tree.label}")
    reference = [vanilla_generate(target, p[None], greedy, new, stop_token_ids=[]).tokens for p in prompts]
    hf = target.model.generate(
        prompts[0][None], max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, prompts[0].numel() :].tolist()
    runs = {"vanilla vs transformers generate": [(0, hf, reference[0])]}
    runs["speculative, alone"] = [
        (i, ref, speculative_generate(target, draft, p[None], tree, greedy, new, stop_token_ids=[]).tokens)
        for i, (p, ref) in enumerate(zip(prompts, reference))
    ]
    lengths = [max(1, new - 2 * i) for i in range(count)]  # rows leave at different rounds
    requests = [DecodeRequest(p.tolist(), greedy, n, stop_token_ids=[]) for p, n in zip(prompts, lengths)]
    batched = generate_batch(target, draft, requests, cfg.speculation_policy, max_rows=count - 1)
    runs["speculative, batched"] = [
        (i, ref[:n], r.tokens) for i, (ref, n, r) in enumerate(zip(reference, lengths, batched))
    ]
    return _verdict(target, prompts, runs, count, new)


def _verdict(target: Any, prompts: list[torch.Tensor], runs: dict[str, list], count: int, new: int) -> dict[str, Any]:
    """Lossless when every output equals its reference; in bf16/fp16 also when each prompt that differs
    first differs at a near-tie of the target's top two logits (griffin.decode.first_divergence)."""
    from griffin.decode import first_divergence

    exact, ties = target.dtype == torch.float32, []
    for name, results in runs.items():
        diverged = [
            (i, first_divergence(target, prompts[i].tolist(), got, ref)) for i, ref, got in results if got != ref
        ]
        say(f"  {name}: " + ("identical" if not diverged else "; ".join(_describe(i, d) for i, d in diverged)))
        real = [(i, d) for i, d in diverged if exact or not d["near_tie"]]
        if real:
            say(
                f"verdict: DIVERGED ({name}; a divergence beyond a near-tie{'' if exact else ' of ' + str(target.dtype)})"
            )
            return {"verdict": "diverged", "check": name, "first_divergence": {"prompt": real[0][0], **real[0][1]}}
        ties += [{"check": name, "prompt": i, **d} for i, d in diverged]
    if ties:
        say(
            f"verdict: LOSSLESS up to {len(ties)} {target.dtype} near-ties (rerun with target.dtype=float32 for exactness)"
        )
    else:
        say("verdict: LOSSLESS on these prompts (speculative == vanilla == transformers' greedy, token for token)")
    report = {"prompts": count, "prompt_tokens": len(prompts[0]), "new_tokens": new, "near_ties": ties}
    return {"verdict": "lossless", **report}


def _prompts(target: Any, count: int, new: int) -> list[torch.Tensor]:
    """``count`` seeded random prompts, the first longer than the target's window (or 32 tokens without
    one), each a little shorter than the last, within the context."""
    window = target.layout.window or 0
    longest = min(max(32, window + 16), target.max_context - new - 1)
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, target.vocab_size, (max(1, longest - 3 * i),), generator=generator).to(target.device)
        for i in range(count)
    ]


def _describe(prompt: int, d: dict[str, Any]) -> str:
    if d["gap"] is None:
        return f"prompt {prompt}: one output stops at new token {d['index']} where the other goes on"
    kind = "a near-tie" if d["near_tie"] else "NOT a near-tie"
    return (
        f"prompt {prompt} differs at new token {d['index']}: {d['spec_token']} instead of {d['vanilla_token']} "
        f"(the target's logit gap there {d['gap']}: {kind})"
    )
