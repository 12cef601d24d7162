"""``griffin ship``: a trained draft as a shipped, self-describing directory under ``drafts/``.

``drafts/<target-slug>/<variant>/`` holds what a user needs to serve it with no training:
- ``model.safetensors``: the draft's own weights in bf16 (the frozen target embedding and head are
  re-bound from the target at load time, so the file stays small);
- ``config.json``: the draft config with its provenance (target fingerprint, data, steps, metrics);
- ``card.json``: machine-readable: the tree the draft was measured with, τ and speedup per dataset
  and temperature from an evaluation report, data, steps, commit;
- ``README.md``: the model card in words.

It loads through ``pipeline.resources`` like any draft, lineage checked:
``griffin serve -c C serve.draft_uri=drafts/...``, ``griffin eval --draft drafts/...``,
``griffin register --checkpoint drafts/...``, ``train.init_from=drafts/...``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_draft_config
from pipeline.config import RunConfig
from pipeline.files import atomic_write, atomic_write_json, atomic_write_text
from pipeline.resources.drafts import REPO, check_lineage, load_draft_uri, resolve_draft
from pipeline.resources.targets import load_target

CARD_NAME = "card.json"
MAX_BYTES = 30 << 20  # a shipped draft stays small enough for the repository


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def measured(report: dict[str, Any], method: str) -> dict[str, Any]:
    """τ and speedups of ``method`` per "<dataset>/T<t>" from an evaluation report (report.json)."""
    results = {}
    for key, result in report["results"].items():
        entry = result["methods"].get(method)
        if entry is None:
            raise ValueError(f"the evaluation report has no method {method!r} (it has {sorted(result['methods'])})")
        vanilla = result["methods"]["vanilla"]["tokens_per_s_median"]
        results[key] = {
            "tau": entry.get("tau"),
            "tokens_per_s": entry["tokens_per_s_median"],
            "speedup_vs_vanilla": entry["tokens_per_s_median"] / vanilla,
            "generations": entry["generations"],
        }
        if "hf_generate" in result["methods"]:
            results[key]["speedup_vs_hf_generate"] = (
                entry["tokens_per_s_median"] / result["methods"]["hf_generate"]["tokens_per_s_median"]
            )
    return results


def build_card(raw_config: dict[str, Any], report: dict[str, Any], method: str) -> dict[str, Any]:
    provenance = raw_config.get("provenance") or {}
    resolved = provenance.get("resolved_config") or {}
    tree = report["tree"]
    return {
        "target": (provenance.get("target") or {}).get("target_id"),
        "variant": raw_config["griffin"]["variant"],
        "draft_vocab_size": raw_config.get("draft_vocab_size"),
        "tree": {"total_tokens": tree["total_tokens"], "depth": tree["depth"], "top_k": tree["top_k"]},
        "measured": measured(report, method),
        "measured_with": {
            "mode": report["mode"],
            "hardware": report.get("hardware"),
            "max_new_tokens": report["config"]["eval"]["max_new_tokens"],
            "num_questions": report["config"]["eval"]["num_questions"],
        },
        "data": {key: resolved.get("data", {}).get(key) for key in ("source", "limit", "max_len", "split")},
        "schedule": resolved.get("train", {}).get("schedule"),
        # drafts trained before these options existed trained with KL and a vocabulary from all tokens
        "token_loss": resolved.get("train", {}).get("method", {}).get("token_loss", "kl"),
        "vocab_from": resolved.get("draft", {}).get("vocab_from", "all"),
        "steps": sum(stage["steps"] for stage in resolved.get("train", {}).get("schedule") or []),
        "held_out": provenance.get("metrics", {}).get("eval/sim_accept_len"),
        "feature_manifest_sha256": provenance.get("feature_manifest_sha256"),
        "commit": _commit(),
    }


def card_markdown(card: dict[str, Any], serve_command: str) -> str:
    rows = "\n".join(
        f"| {key} | {v['tau']:.2f} | {v['speedup_vs_vanilla']:.2f}x | "
        f"{v.get('speedup_vs_hf_generate', float('nan')):.2f}x | {v['generations']} |"
        for key, v in card["measured"].items()
    )
    tree = card["tree"]
    return f"""# {card["variant"]} draft for {card["target"]}

A {card["variant"].upper()} speculative-decoding draft for `{card["target"]}`, trained by this project
({card["steps"]} optimizer steps on {card["data"]["limit"] or "all"} conversations of
`{card["data"]["source"]}`, schedule {card["schedule"]}; token loss `{card.get("token_loss", "kl")}`, draft
vocabulary from `{card.get("vocab_from", "all")}` tokens), bf16. Decoding with it is lossless: the
target verifies every drafted token.

Serve it:

```bash
{serve_command}
```

Measured with the tree total_tokens={tree["total_tokens"]}, depth={tree["depth"]}, top_k={tree["top_k"]}
({card["measured_with"]["mode"]}, {card["measured_with"]["num_questions"]} questions per set,
{card["measured_with"]["max_new_tokens"]} new tokens; speedups are tokens/s ratios in one process,
runs interleaved):

| dataset / T | τ | speedup vs vanilla | vs HF generate | generations |
|---|---|---|---|---|
{rows}

Held-out expected accepted tokens at training: {card["held_out"]}. Commit: {card["commit"]}.
`card.json` holds the same in machine-readable form.
"""


def run_ship(
    cfg: RunConfig,
    source: str | None = None,
    report: str | None = None,
    method: str = "griffin",
    out: str | None = None,
) -> dict[str, Any]:
    """``griffin ship --source DRAFT --report EVAL/report.json [--method griffin] [--out DIR]``."""
    if source is None or report is None:
        raise ValueError(
            "griffin ship needs --source (the draft) and --report (an evaluation report.json that "
            "measured it) so that the card states what the draft delivers"
        )
    draft_dir = resolve_draft(source, cfg)
    target = load_target(cfg.target)
    check_lineage(draft_dir, target, source)
    evaluation = json.loads(Path(report).read_text())
    _, raw = read_draft_config(draft_dir)
    out_dir = Path(out) if out else REPO / "drafts" / cfg.target_slug / raw["griffin"]["variant"]
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(draft_dir / WEIGHTS_NAME).items()
    }
    atomic_write(out_dir / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_json(out_dir / CONFIG_NAME, raw)
    card = build_card(raw, evaluation, method)
    atomic_write_json(out_dir / CARD_NAME, card)
    relative = out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir
    serve_command = f"griffin serve -c jobs/configs/smollm2-quick.yaml serve.draft_uri={relative}"
    atomic_write_text(out_dir / "README.md", card_markdown(card, serve_command))
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    if size > MAX_BYTES:
        raise ValueError(
            f"{out_dir} is {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB a shipped draft may take"
        )
    load_draft_uri(out_dir, target, cfg)  # it loads back, lineage checked
    return {"out": str(out_dir), "bytes": size, "card": card}
