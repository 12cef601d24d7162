"""Benchmark: bf16 against fp32 on this CPU, for the three things the pipeline does with the target
and the draft: a featurize forward, a stage-1 training step, and a vanilla decode step.

Why: ``target.dtype: auto`` / ``train.precision: auto`` pick bf16 only where the device runs it
natively (``griffin.target.fast_bf16``: AMX / AVX512-BF16 on a CPU). This measures what that choice
is worth on the machine at hand. Interleaved fp32, bf16, fp32, ... in one process; medians.

    .venv/bin/python benchmarks/decode/dtype_bench.py [--repeats 3]
Writes benchmarks/decode/dtype.json and benchmarks/decode/dtype.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from griffin.config import SamplingConfig, StagePlan, TrainConfig  # noqa: E402
from griffin.decode import vanilla_generate  # noqa: E402
from griffin.losses import shift_batch  # noqa: E402
from griffin.model import GriffinDraft  # noqa: E402
from griffin.target import TargetAdapter, fast_bf16  # noqa: E402
from griffin.training import make_optimizer, make_scheduler, train_step  # noqa: E402

OUT = Path(__file__).parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def featurize_tokens_per_s(target: TargetAdapter) -> float:
    ids = torch.randint(0, 49000, (2, 512))  # (B, T)
    with torch.inference_mode():
        start = time.perf_counter()
        target.backbone(input_ids=ids)
        return ids.numel() / (time.perf_counter() - start)


def train_seconds_per_step(fp32_target: TargetAdapter, bf16: bool) -> float:
    """A stage-1 step of 2048 tokens with the reduced 8k draft vocabulary, fp32 master weights."""
    torch.manual_seed(0)
    ids = torch.randint(0, 8000, (2, 1024))  # (B, T)
    batch = shift_batch(torch.randn(2, 1024, fp32_target.hidden_size), ids, torch.ones_like(ids))
    draft = GriffinDraft.for_target(fp32_target, d2t=torch.arange(8192)).cast_parameters(torch.float32)
    method, plan = TrainConfig(), StagePlan.for_stage(1, "griffin", steps=10)
    optimizer = make_optimizer(draft, method, plan)
    scheduler = make_scheduler(optimizer, method, plan)
    train_step(draft, draft, [batch], optimizer, scheduler, method, plan, bf16=bf16)  # warm-up
    start = time.perf_counter()
    train_step(draft, draft, [batch], optimizer, scheduler, method, plan, bf16=bf16)
    return time.perf_counter() - start


def decode_tokens_per_s(target: TargetAdapter) -> float:
    ids = torch.randint(0, 49000, (1, 64))  # (1, T)
    start = time.perf_counter()
    result = vanilla_generate(target, ids, SamplingConfig(), 24, stop_token_ids=[])
    return len(result.tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    targets = {
        name: TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype=dtype) for name, dtype in DTYPES.items()
    }
    samples: dict[str, dict[str, list[float]]] = {name: {"featurize": [], "train": [], "decode": []} for name in DTYPES}
    for _ in range(args.repeats):
        for name in DTYPES:  # interleaved: load drift hits both dtypes alike
            samples[name]["featurize"].append(featurize_tokens_per_s(targets[name]))
            samples[name]["train"].append(train_seconds_per_step(targets["fp32"], bf16=name == "bf16"))
            samples[name]["decode"].append(decode_tokens_per_s(targets[name]))
    medians = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in samples.items()}
    result = {
        "hardware": {
            "processor": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "fast_bf16": fast_bf16("cpu"),
            "torch_threads": torch.get_num_threads(),
        },
        "repeats": args.repeats,
        "samples": samples,
        "medians": medians,
        "fp32_over_bf16": {
            "featurize": medians["fp32"]["featurize"] / medians["bf16"]["featurize"],
            "train": medians["bf16"]["train"] / medians["fp32"]["train"],
            "decode": medians["fp32"]["decode"] / medians["bf16"]["decode"],
        },
    }
    (OUT / "dtype.json").write_text(json.dumps(result, indent=2))
    ratio = result["fp32_over_bf16"]
    (OUT / "dtype.md").write_text(f"""# bf16 against fp32 on this CPU (`benchmarks/decode/dtype_bench.py`)

Hardware: {result["hardware"]}. SmolLM2-135M-Instruct; {args.repeats} interleaved repeats, medians.

| | fp32 | bf16 | fp32 / bf16 speed |
|---|---|---|---|
| featurize forward (B=2, T=512), tokens/s | {medians["fp32"]["featurize"]:.0f} | {medians["bf16"]["featurize"]:.0f} | {ratio["featurize"]:.1f}x |
| stage-1 training step (2048 tokens, 8k draft vocabulary), s | {medians["fp32"]["train"]:.2f} | {medians["bf16"]["train"]:.2f} | {ratio["train"]:.1f}x |
| vanilla decode (24 tokens after a 64-token prompt), tokens/s | {medians["fp32"]["decode"]:.1f} | {medians["bf16"]["decode"]:.1f} | {ratio["decode"]:.1f}x |

`fast_bf16` = {result["hardware"]["fast_bf16"]}: `target.dtype: auto` and `train.precision: auto` pick
{"bf16" if result["hardware"]["fast_bf16"] else "fp32"} here.
""")
    print((OUT / "dtype.md").read_text())


if __name__ == "__main__":
    main()
