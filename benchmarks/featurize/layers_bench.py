"""Multi-layer feature store benchmark: what EAGLE-3's low/mid/high layers cost featurize.

The featurize actor's own code (``pipeline.data.featurize.Featurizer``: the target forward, the NaN check,
the codec) runs over the same padded batches with no feature layers (GRIFFIN, HASS, EAGLE-2) and
with SmolLM2's default EAGLE-3 layers (2, 15, 27), each in bf16 and fp8, interleaved batch by batch in one process so that
the shared machine's load hits both alike. Each batch is written as a part (``part_table`` +
``write_part``) to measure bytes per token on disk. Reports tokens/s medians over batches and the
bf16 ratio. Writes benchmarks/featurize/layers.json and benchmarks/featurize/layers.md.

    .venv/bin/python benchmarks/featurize/layers_bench.py [--conversations 60] [--max-len 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from griffin.config import default_feature_layers  # noqa: E402
from pipeline.data import store as st  # noqa: E402
from pipeline.config import config_from_dict  # noqa: E402
from pipeline.data.featurize import Featurizer, prepare_samples, plan_parts, token_batches  # noqa: E402
from pipeline.resources.identity import target_identity  # noqa: E402

OUT = Path(__file__).parent


def batches_of(cfg, samples, hidden_size) -> list[dict]:
    """The actor's padded batches (same parts, same token budget) as Featurizer inputs."""
    out = []
    for part in plan_parts(samples, cfg, hidden_size):
        ids = np.split(part["input_ids"], np.cumsum(part["lengths"])[:-1])
        masks = np.split(part["loss_mask"], np.cumsum(part["lengths"])[:-1])
        for group in token_batches(part["lengths"], cfg.features.batch_tokens):
            rows = np.empty(len(group), dtype=object)
            rows[:] = [ids[i] for i in group]
            mask_rows = np.empty(len(group), dtype=object)
            mask_rows[:] = [masks[i] for i in group]
            out.append(
                {"sample_id": np.asarray([f"{len(out)}-{i}" for i in group]), "input_ids": rows, "loss_mask": mask_rows}
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="griffin-layers-bench-"))
    cfg = config_from_dict(
        {
            "run_name": "layers-bench",
            "output_dir": str(work),
            "target": {"name": "smollm2-135m-instruct", "dtype": "bfloat16"},
            "data": {"source": "sharegpt", "limit": args.conversations, "max_len": args.max_len, "shuffle_seed": 42},
            "features": {"batch_tokens": args.batch_tokens},
        }
    )
    key, samples, _ = prepare_samples(cfg, target_identity(cfg.target))
    hidden = key["hidden_size"]
    layers = default_feature_layers(30)
    featurizers = {
        (name, dtype): Featurizer(cfg.target.model_dump(), dtype, args.batch_tokens, chosen)
        for name, chosen in (("final feature only", ()), (f"+ layers {list(layers)}", layers))
        for dtype in ("bf16", "fp8")
    }
    batches = batches_of(cfg, samples, hidden)
    rates = {key: [] for key in featurizers}
    sizes = {key: [0, 0] for key in featurizers}
    for i, batch in enumerate(batches):
        order = list(featurizers.items())
        for key, featurizer in order if i % 2 == 0 else order[::-1]:  # alternate who goes first
            start = time.perf_counter()
            rows = featurizer(batch)
            rates[key].append(int(rows["seq_len"].sum()) / (time.perf_counter() - start))
            table = st.part_table(rows, featurizer.dtype, hidden, featurizer.layers)
            entry = st.write_part(str(work / "parts"), f"part-{i}-{key[1]}-{len(featurizer.layers)}.parquet", table)
            sizes[key][0] += entry["bytes"]
            sizes[key][1] += entry["tokens"]
    shutil.rmtree(work, ignore_errors=True)
    label = lambda key: f"{key[0]} ({key[1]})"  # noqa: E731
    medians = {label(key): float(np.median(r)) for key, r in rates.items()}
    plain, multi = [key for key in featurizers if key[1] == "bf16"]
    ratios = [b / a for a, b in zip(rates[plain], rates[multi])]
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "target": "smollm2-135m-instruct (bf16, H=576, 30 layers)",
        "layers": list(layers),
        "batches": len(batches),
        "tokens": int(sum(len(s.input_ids) for s in samples)),
        "tokens_per_s_median": medians,
        "bf16_speed_ratio_median": float(np.median(ratios)),
        "bytes_per_token": {label(key): b / t for key, (b, t) in sizes.items()},
        "samples_tokens_per_s": {label(key): r for key, r in rates.items()},
    }
    (OUT / "layers.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Multi-layer feature store: featurize cost (`benchmarks/featurize/layers_bench.py`)",
        "",
        f"SmolLM2-135M-Instruct bf16, {args.threads} threads, {len(batches)} batches of <= {args.batch_tokens} "
        f"tokens ({result['tokens']} tokens of {args.conversations} ShareGPT conversations), the four "
        "featurizers interleaved batch by batch; medians over batches.",
        "",
        "| store | dtype | featurize tokens/s | bytes/token on disk |",
        "|---|---|---:|---:|",
    ]
    for key in featurizers:
        lines.append(
            f"| {key[0]} | {key[1]} | {medians[label(key)]:.0f} | {result['bytes_per_token'][label(key)]:.1f} |"
        )
    lines += [
        "",
        f"bf16 featurize speed with layers / without, median of per-batch ratios: "
        f"{result['bf16_speed_ratio_median']:.3f}.",
    ]
    (OUT / "layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
