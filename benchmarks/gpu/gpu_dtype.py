"""Decode cost per dtype on a GPU, SmolLM2-135M's shape with random weights (no weights to carry).

For fp32 and bf16, interleaved over ``--reps``: a vanilla decode (ms per step), and a speculative
decode with a random draft and a 60/6/10 tree (draft and verify ms per round). Then a
``torch.profiler`` table of 16 vanilla steps per dtype, to show where the time goes. Writes
``gpu_dtype.json`` and ``gpu_dtype_profile.txt`` to ``--out``.

    python benchmarks/gpu/gpu_dtype.py --out DIR [--device cuda] [--reps 3] [--new 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.model import GriffinDraft
from pipeline.resources.targets import build_tiny_target

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(dtype: torch.dtype, device: str):
    target = build_tiny_target(SMOLLM2, dtype)
    target.model.to(device)
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(target).to(device).cast_parameters(dtype)
    return target, draft


def one_rep(target, draft, ids, new: int) -> dict[str, float]:
    greedy, tree = SamplingConfig(), TreeConfig(total_tokens=60, depth=6, top_k=10)
    vanilla = vanilla_generate(target, ids, greedy, new, stop_token_ids=[]).stats
    spec = speculative_generate(target, draft, ids, tree, greedy, new, stop_token_ids=[]).stats
    return {
        "vanilla_ms_per_step": 1e3 * vanilla.verify_time / vanilla.rounds,
        "draft_ms_per_round": 1e3 * spec.draft_time / spec.rounds,
        "verify_ms_per_round": 1e3 * spec.verify_time / spec.rounds,
    }


def profile_table(target, ids) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        vanilla_generate(target, ids, SamplingConfig(), 16, stop_token_ids=[])
    averages = prof.key_averages()
    text = averages.table(sort_by="self_cpu_time_total", row_limit=18)
    if ids.device.type == "cuda":
        text += "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=12)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="outputs/gpu_dtype")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {name: build(dtype, args.device) for name, dtype in DTYPES.items()}
    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0)).to(args.device)
    for target, draft in models.values():  # warm-up: kernels, allocator
        one_rep(target, draft, ids, 8)
    samples = {name: [] for name in models}
    for _ in range(args.reps):
        for name, (target, draft) in models.items():
            samples[name].append(one_rep(target, draft, ids, args.new))
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "shape": SMOLLM2,
        "samples": samples,
        "placement": {
            name: sorted({f"{p.device}/{p.dtype}" for p in t.model.parameters()}) for name, (t, _) in models.items()
        },
        "median": {
            name: {key: round(median(s[key] for s in runs), 2) for key in runs[0]} for name, runs in samples.items()
        },
    }
    (out / "gpu_dtype.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"placement": result["placement"], "median": result["median"]}, indent=1), flush=True)
    tables = [f"## {name}\n{profile_table(target, ids)}" for name, (target, _) in models.items()]
    (out / "gpu_dtype_profile.txt").write_text("\n\n".join(tables))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
