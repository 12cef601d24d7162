"""The first check on a GPU image, before anything costly: does the compiler work there?

1. ``torch.compile(mode="reduce-overhead")`` of a tiny function equals eager over three calls (on CUDA
   the later calls replay a CUDA graph; inductor and Triton must build on the image).
2. A compiled decode of the tiny target (``griffin.static`` through the batching engine) equals the
   eager decode token for token, vanilla and speculative with a random draft; the CUDA graphs that
   warm-up recorded, and those decoding recorded after it (should be none), are counted.

Writes OUT/smoke.json; exits 1 when a check fails.

    python benchmarks/gpu/smoke.py --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from griffin.config import SamplingConfig, TreeConfig  # noqa: E402
from griffin.decode import speculative_generate, vanilla_generate  # noqa: E402
from griffin.policy import SpeculationPolicy  # noqa: E402
from griffin.model import GriffinDraft  # noqa: E402
from griffin.offline import warm_up  # noqa: E402
from griffin.static import graph_counts  # noqa: E402
from griffin.target import TargetAdapter  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.resources.targets import load_target  # noqa: E402

TREE = TreeConfig(total_tokens=8, depth=3, top_k=2)


def tiny_function(device: torch.device) -> dict:
    """A compiled x -> relu(x @ w) + 1 against eager, three calls."""
    w = torch.randn(64, 64, device=device)
    compiled = torch.compile(lambda x: torch.relu(x @ w) + 1, mode="reduce-overhead")
    x = torch.randn(8, 64, device=device)
    outs = [compiled(x).clone() for _ in range(3)]
    return {"equal": all(torch.allclose(o, torch.relu(x @ w) + 1, atol=1e-4) for o in outs)}


def tiny_decode(device: torch.device) -> dict:
    """The tiny target's compiled decode against its eager decode, vanilla and speculative (fp32)."""
    cfg = load_config(
        ROOT / "jobs/configs/tiny.yaml", [f"target.device={device}", "target.dtype=float32", "target.prepack=false"]
    )
    eager = load_target(cfg.target, decoding=True)
    compiled = TargetAdapter(eager.model, eager.tokenizer, name=eager.name)
    compiled.compile_decoding()
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(eager)
    prompt, greedy = torch.tensor([[3, 17, 42, 9, 28]], device=device), SamplingConfig()
    started = time.monotonic()
    for draft_or_none, tree in ((None, None), (draft, TREE)):
        warm_up(compiled, draft_or_none, SpeculationPolicy({1: tree}))
    warm = graph_counts(device)
    warm_up_s = time.monotonic() - started
    same = []
    for _ in range(2):  # the second pass must record nothing new
        same.append(
            vanilla_generate(compiled, prompt, greedy, 24).tokens == vanilla_generate(eager, prompt, greedy, 24).tokens
        )
        spec = speculative_generate(compiled, draft, prompt, TREE, greedy, 24).tokens
        same.append(spec == vanilla_generate(eager, prompt, greedy, 24).tokens)
    after = graph_counts(device)
    return {
        "equal": all(same),
        "warm_up_s": round(warm_up_s, 1),
        "graphs_after_warm_up": warm["recorded"],
        "graphs_recorded_while_decoding": after["recorded"] - warm["recorded"],
        "skipped_cudagraphs": after["skipped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    result: dict = {"device": str(device), "torch": torch.__version__}
    for name, check in (("tiny_function", tiny_function), ("tiny_decode", tiny_decode)):
        try:
            result[name] = check(device)
        except Exception:  # the image's failure is the finding: keep it, go on to the next check
            result[name] = {"equal": False, "error": traceback.format_exc(limit=8)}
        print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["ok"] = all(result[name]["equal"] for name in ("tiny_function", "tiny_decode"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "smoke.json").write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
