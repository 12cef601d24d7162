"""What a stream's detokenization costs the engine thread per round, late in a long answer: the text of
all tokens decoded again each round (how ``TextStream`` worked before) against ``IncrementalText``
(the kept text plus the last tokens). SmolLM2's tokenizer on a ShareGPT answer's text repeated to the
length, one token a round (a plain round; a speculative one commits a few), the mean over the last
200 rounds before each length (moves of the kept boundary included), A and B interleaved in one
process, 5 repetitions, medians of those means.
Writes benchmarks/serve/detok_bench.{json,md}.

    python benchmarks/serve/detok_bench.py
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scale_out"))

from restart_cost import cpu_name  # noqa: E402

LENGTHS, TIMED, REPEATS = (1000, 4000, 16000), 200, 5


def answer_tokens(tokenizer, length: int) -> list[int]:
    """An assistant answer's tokens from the packaged ShareGPT file, repeated to ``length``."""
    from pipeline.config import load_config
    from pipeline.data.sources import Ledger, load_conversations

    cfg = load_config(ROOT / "jobs/configs/smollm2-quick.yaml", ["data.limit=50"])
    text = "\n".join(m["content"] for c in load_conversations(cfg.training_data, Ledger()) for m in c.messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def per_round_ms(tokens: list[int], text_of, stateful: bool) -> float:
    """Mean ms of ``text_of(tokens[:end])`` over the last TIMED ends (a boundary move's whole decode
    included), after every earlier end ran (``stateful``: its state is what those rounds left)."""
    for end in range(1, len(tokens) - TIMED + 1 if stateful else 0):
        text_of(tokens[:end])
    times = []
    for end in range(len(tokens) - TIMED + 1, len(tokens) + 1):
        start = time.perf_counter()
        text_of(tokens[:end])
        times.append(time.perf_counter() - start)
    return statistics.fmean(times) * 1000


def main() -> None:
    from pipeline.config import load_config
    from pipeline.resources.identity import target_identity
    from pipeline.serve.sse import IncrementalText

    tokenizer = target_identity(load_config(ROOT / "jobs/configs/smollm2-quick.yaml").target).tokenizer
    rows = []
    for length in LENGTHS:
        tokens = answer_tokens(tokenizer, length)
        whole, incremental = [], []
        for _ in range(REPEATS):  # interleaved
            whole.append(per_round_ms(tokens, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), False))
            incremental.append(per_round_ms(tokens, IncrementalText(tokenizer).text, True))
        w, i = statistics.median(whole), statistics.median(incremental)
        rows.append(
            {"tokens": length, "whole_ms": round(w, 4), "incremental_ms": round(i, 4), "ratio": round(w / i, 1)}
        )
        print(rows[-1], flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} threads",
        "rows": rows,
    }
    out = Path(__file__).resolve().parent
    (out / "detok_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Detokenization per round, late in a long answer (SmolLM2 tokenizer)",
        "",
        f"{report['date']}, {report['machine']}; mean of the last {TIMED} rounds (boundary moves included), "
        f"median of {REPEATS} interleaved repetitions. `python benchmarks/serve/detok_bench.py`.",
        "",
        "| answer tokens | whole decode each round (ms) | IncrementalText (ms) | ratio |",
        "|---|---|---|---|",
        *(f"| {r['tokens']} | {r['whole_ms']} | {r['incremental_ms']} | {r['ratio']}x |" for r in rows),
    ]
    (out / "detok_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
