"""The ablation tables from the runs ``benchmarks/ablations/ablations.sh`` made (see there for the design).

Score: ``eval/sim_accept_len`` of each stage's best checkpoint (held-out simulated acceptance: the
expected number of accepted draft tokens of a 5-step greedy chain drafted with the draft's own
features, sum_k prod_{i<=k} acc_i; tau of a chain is 1 + this) and the per-step acceptance ``eval/acc_k``.
The vocabulary rows also get what they cost at decode time: the draft LM head + top-k for one tree
level (top_k rows of the headline tree), pre-packed as in decoding, sizes interleaved, medians.
Writes benchmarks/ablations/ablations.json and ablations.md.

    python benchmarks/ablations/ablations.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent
RUNS = ROOT / "outputs"
METRICS = ("eval/sim_accept_len", "eval/acc_0", "eval/acc_1", "eval/acc_2")


def stage_score(run: str, stage: int) -> dict | None:
    done = RUNS / run / "train" / f"stage{stage}" / "_complete.json"
    if not done.is_file():
        return None
    metrics = json.loads(done.read_text())["best_metrics"]
    return {k: metrics.get(k) for k in METRICS}


def rows() -> dict[str, dict | None]:
    table = {
        "N=1 (stage-1 init, k=3)": stage_score("smollm2-full-griffin", 1),
        "N=2, k=3": stage_score("smollm2-abl-k3", 2),
        "N=3, k=3 (GRIFFIN default)": stage_score("smollm2-abl-k3", 3),
        "N=4, k=3": stage_score("smollm2-abl-k3", 4),
        "N=3, k=1": stage_score("smollm2-abl-k1", 3),
        "N=3, k=5": stage_score("smollm2-abl-k5", 3),
        "N=3, k=3, mask_shift=decode": stage_score("smollm2-abl-shift-decode", 3),
        "stage 1 only: GRIFFIN, 8k vocab": stage_score("smollm2-abl-s1-base", 1),
        "stage 1 only: without TGF": stage_score("smollm2-abl-s1-no-tgf", 1),
        "stage 1 only: without TEH": stage_score("smollm2-abl-s1-no-teh", 1),
        "stage 1 only: 4k vocab": stage_score("smollm2-abl-s1-vocab-4k", 1),
        "stage 1 only: 16k vocab": stage_score("smollm2-abl-s1-vocab-16k", 1),
        "stage 1 only: full 49152 vocab": stage_score("smollm2-abl-s1-vocab-full", 1),
    }
    return table


VOCABS = {
    "stage 1 only: 4k vocab": 4096,
    "stage 1 only: GRIFFIN, 8k vocab": 8192,
    "stage 1 only: 16k vocab": 16384,
    "stage 1 only: full 49152 vocab": 49152,
}


def head_ms(hidden: int = 576, rows: int = 4, top_k: int = 4, repeats: int = 300) -> dict[int, float]:
    """Median ms of one draft-level head (rows, hidden) @ (hidden, V) + top-k, per vocabulary size V,
    bf16 and pre-packed as ``GriffinDraft.prepack`` does on this CPU; the sizes take turns."""
    from griffin.target import PackedLinear, prepack_supported

    torch.manual_seed(0)
    heads = {}
    for vocab in VOCABS.values():
        linear = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16).requires_grad_(False)
        heads[vocab] = PackedLinear(linear) if prepack_supported(torch.device("cpu"), torch.bfloat16) else linear
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)  # (rows, H): one level's frontier
    samples: dict[int, list[float]] = {v: [] for v in heads}
    with torch.inference_mode():
        for _ in range(repeats):
            for vocab, head in heads.items():
                start = time.perf_counter()
                head(x).float().topk(top_k, dim=-1)  # (rows, V) -> (rows, top_k)
                samples[vocab].append((time.perf_counter() - start) * 1e3)
    return {v: statistics.median(s) for v, s in samples.items()}


def markdown(table: dict[str, dict | None]) -> str:
    lines = ["| configuration | sim accepted / chain (held-out) | acc_0 | acc_1 | acc_2 |", "|---|---|---|---|---|"]
    for name, score in table.items():
        if score is None:
            lines.append(f"| {name} | not run | | | |")
            continue
        cells = [f"{score[m]:.3f}" if score[m] is not None else "-" for m in METRICS]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def vocab_markdown(table: dict[str, dict | None], cost: dict[int, float]) -> str:
    lines = ["| draft vocabulary | sim accepted / chain (held-out) | head + top-k per level (ms) |", "|---|---|---|"]
    for name, vocab in VOCABS.items():
        score = table[name]
        accepted = f"{score['eval/sim_accept_len']:.3f}" if score else "not run"
        lines.append(f"| {vocab} | {accepted} | {cost[vocab]:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    table = rows()
    cost = head_ms()
    (OUT / "ablations.json").write_text(json.dumps({"runs": table, "head_ms_by_vocab": cost}, indent=2))
    text = markdown(table) + "\n" + vocab_markdown(table, cost)
    (OUT / "ablations.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
