"""Training benchmark: training-step throughput per TAT stage (1, 2, 3 passes) with the full and a
reduced draft vocabulary, peak memory per configuration, and the LLaMA3-8B training memory on paper.

Real SmolLM2-135M-Instruct features: a small store built with the project's own featurization
(``run_featurize`` on ``jobs/configs/smollm2-quick.yaml`` with ``data.limit`` / ``data.max_len``
overridden), read back in-process with ``pipeline.data.store`` and ``shift_batch`` exactly as training
does (``pipeline.train.batches.shifted_batches``, batch_tokens 2048). Each of the 6 configurations
(stage 1/2/3 x vocabulary 49152/8192) owns a GRIFFIN draft with fp32 master weights, AdamW and the
warm-up scheduler, and runs ``griffin.training.train_step(..., bf16=True)`` - the pure-PyTorch step
the Ray Train loop calls. Timing: one warm-up step per configuration, then rounds; in round r every
configuration trains on batch r (same batch), round-robin with the start rotated each round, so
load drift on the shared machine hits every configuration alike. tokens/s counts real (non-padding)
tokens; the reduced/full ratio is the median of per-round ratios on the same batch.

Memory: each configuration again in a fresh ``spawn`` subprocess on the largest batch: VmRSS after
set-up (target + draft + optimizer + batch), then the peak RSS (VmHWM, reset through
``/proc/self/clear_refs``) of the first step (allocates grads and AdamW state) and of a second step,
both reported above the set-up RSS. A profiler step per vocabulary (stage 2) splits the time into
vocabulary-sized ops (any input dimension equal to the draft vocabulary) and the rest.

Writes benchmarks/training/train.json, train.md and train.png.

    python benchmarks/training/train_bench.py [--conversations 48] [--max-len 1024] [--rounds 15] [--time-budget 420]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from queue import Empty

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from griffin.config import TrainConfig  # noqa: E402
from griffin.model import GriffinDraft, count_trainable  # noqa: E402
from griffin.training import make_optimizer, make_scheduler, train_step  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.store import iter_rows, part_files  # noqa: E402
from pipeline.resources.targets import load_target  # noqa: E402
from pipeline.train.batches import reduced_vocabulary, shifted_batches, store_tokens  # noqa: E402

OUT = Path(__file__).parent
BASE_CONFIG = "jobs/configs/smollm2-quick.yaml"
STAGES = (1, 2, 3)
GB = 1e9

# LLaMA3-8B target with GRIFFIN's draft config (docs/method.md §2.5): H 4096, I 11008, 32 heads MHA, V 128256
L3 = {"H": 4096, "I": 11008, "heads": 32, "V": 128256, "T": 2048, "P": 416_301_056}


# ---- set-up --------------------------------------------------------------------------------
def overrides(args) -> list[str]:
    return [
        f"output_dir={args.work}",
        "run_name=trainbench",
        f"data.limit={args.conversations}",
        f"data.max_len={args.max_len}",
    ]


def build_store(cfg, reuse: bool) -> dict:
    """The project's own featurization (Ray Data actor pool); resumes/skips when the store is done."""
    from pipeline.data.featurize import run_featurize

    if not reuse:
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    start = time.perf_counter()
    summary = run_featurize(cfg)
    import ray

    if ray.is_initialized():
        ray.shutdown()  # give the CPUs back before timing
    return {**summary, "wall_s": time.perf_counter() - start}


def load_batches(store: str, batch_tokens: int, hidden_size: int) -> list:
    """Every batch of the store, padded and shifted as the training loop builds them."""
    return [batch for batch, _ in shifted_batches(iter_rows(part_files(store)), batch_tokens, hidden_size, "cpu")]


def config_name(stage: int, vocab: int) -> str:
    return f"stage{stage}-V{vocab}"


class Trainer:
    """One configuration: draft (fp32 master weights, like pipeline/train/driver.py) + AdamW + scheduler."""

    def __init__(self, target, stage: int, d2t: torch.Tensor | None):
        torch.manual_seed(0)
        self.draft = GriffinDraft.for_target(target, variant="griffin", d2t=d2t).float()
        self.method = TrainConfig(stage=stage)
        self.optimizer = make_optimizer(self.draft, self.method)
        self.scheduler = make_scheduler(self.optimizer, self.method)
        self.steps = 0

    def step(self, batch) -> tuple[float, int]:
        generator = torch.Generator().manual_seed(self.steps)
        start = time.perf_counter()
        metrics = train_step(
            self.draft, self.draft, [batch], self.optimizer, self.scheduler, self.method, bf16=True, generator=generator
        )
        self.steps += 1
        return time.perf_counter() - start, int(metrics["tokens"])


# ---- timing --------------------------------------------------------------------------------
def timing(trainers: dict, batches: list, args) -> dict:
    names = list(trainers)
    samples = {name: [] for name in names}
    for name in names:  # warm-up: first-step allocations (grads, AdamW state), kernels, caches
        trainers[name].step(batches[0])
    start, rounds = time.perf_counter(), 0
    while rounds < args.rounds:
        round_start = time.perf_counter()
        batch = batches[1 + rounds % (len(batches) - 1)]
        order = names[rounds % len(names) :] + names[: rounds % len(names)]
        for name in order:
            seconds, tokens = trainers[name].step(batch)
            samples[name].append(
                {
                    "round": rounds,
                    "seconds": seconds,
                    "tokens": tokens,
                    "padded_tokens": int(batch.tokens.numel()),
                    "tokens_s": tokens / seconds,
                }
            )
        rounds += 1
        round_s = time.perf_counter() - round_start
        elapsed = time.perf_counter() - start
        print(
            f"round {rounds}: {round_s:.0f} s ({elapsed:.0f} s so far); "
            + ", ".join(f"{n} {samples[n][-1]['tokens_s']:.0f}" for n in names),
            flush=True,
        )
        if rounds >= args.min_rounds and elapsed + round_s > args.time_budget:
            break
    return {"rounds": rounds, "samples": samples}


def summarize(samples: dict, full_vocab: int, reduced: int) -> dict:
    out = {}
    for stage in STAGES:
        full, red = samples[config_name(stage, full_vocab)], samples[config_name(stage, reduced)]
        ratios = [r["tokens_s"] / f["tokens_s"] for f, r in zip(full, red)]
        out[stage] = {
            "full_tokens_s_median": statistics.median(x["tokens_s"] for x in full),
            "reduced_tokens_s_median": statistics.median(x["tokens_s"] for x in red),
            "full_step_s_median": statistics.median(x["seconds"] for x in full),
            "reduced_step_s_median": statistics.median(x["seconds"] for x in red),
            "reduced_over_full_median": statistics.median(ratios),
            "reduced_over_full_min_max": [min(ratios), max(ratios)],
        }
    for stage in STAGES[1:]:
        for vocab in ("full", "reduced"):
            per_round = [
                a["seconds"] / b["seconds"]
                for a, b in zip(
                    samples[config_name(stage, full_vocab if vocab == "full" else reduced)],
                    samples[config_name(1, full_vocab if vocab == "full" else reduced)],
                )
            ]
            out[stage][f"{vocab}_step_over_stage1_median"] = statistics.median(per_round)
    return out


# ---- where the time goes -------------------------------------------------------------------
def profile_split(trainer: Trainer, batch, vocab: int) -> dict:
    """Self CPU time of one step, split into ops with a vocabulary-sized input dimension and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        seconds, _ = trainer.step(batch)
    vocab_us, rest_us, ops = 0.0, 0.0, {}
    for event in prof.key_averages(group_by_input_shape=True):
        shapes = [s for s in (event.input_shapes or []) if isinstance(s, (list, tuple))]
        is_vocab = any(vocab in s for s in shapes)
        if is_vocab:
            vocab_us += event.self_cpu_time_total
        else:
            rest_us += event.self_cpu_time_total
        key = f"{event.key} [{'V' if is_vocab else '-'}]"
        ops[key] = ops.get(key, 0.0) + event.self_cpu_time_total
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    total = vocab_us + rest_us
    return {
        "step_s_profiled": seconds,
        "vocab_sized_fraction": vocab_us / total,
        "vocab_sized_ms": vocab_us / 1e3,
        "other_ms": rest_us / 1e3,
        "top_ops_ms": {k: v / 1e3 for k, v in top},
    }


# ---- memory (fresh process per configuration) ----------------------------------------------
def _proc_status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"(VmHWM|VmRSS):\s+(\d+) kB", text)}


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (and ru_maxrss) to the current RSS
        return True
    except OSError:
        return False


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(args_dict: dict, stage: int, d2t: list[int] | None, batch_index: int, queue) -> None:
    torch.set_num_threads(args_dict["threads"])
    cfg = load_config(BASE_CONFIG, args_dict["overrides"])
    target = load_target(cfg.target)
    batches = load_batches(cfg.store_path, args_dict["batch_tokens"], target.hidden_size)
    batch = batches[batch_index]
    del batches
    trainer = Trainer(target, stage, torch.tensor(d2t) if d2t else None)
    gc.collect()
    setup_rss, setup_maxrss = _proc_status()["VmRSS"], _maxrss()
    can_reset = _reset_peak()
    trainer.step(batch)  # allocates grads and AdamW state
    first = _proc_status()
    first_maxrss = _maxrss()
    _reset_peak()
    trainer.step(batch)
    second = _proc_status()
    queue.put(
        {
            "setup_rss": setup_rss,
            "ru_maxrss_after_setup": setup_maxrss,
            "ru_maxrss_after_step1": first_maxrss,
            "ru_maxrss_after_step2": _maxrss(),
            "peak_reset_ok": can_reset,
            "step1_peak_rss": first["VmHWM"],
            "rss_after_step1": first["VmRSS"],
            "step2_peak_rss": second["VmHWM"],
            "rss_after_step2": second["VmRSS"],
            "step1_peak_above_setup": first["VmHWM"] - setup_rss,
            "step2_peak_above_setup": second["VmHWM"] - setup_rss,
            "trainable_params": count_trainable(trainer.draft),
            "frozen_buffers_bytes": sum(b.numel() * b.element_size() for b in trainer.draft.buffers()),
            "frozen_buffer_dtype": str(trainer.draft.head_weight.dtype),
        }
    )


def memory(args, d2t: list[int], batch_index: int, full_vocab: int) -> dict:
    ctx, out = mp.get_context("spawn"), {}
    child_args = {"threads": args.threads, "overrides": overrides(args), "batch_tokens": args.batch_tokens}
    for stage in STAGES:
        for vocab, ids in ((full_vocab, None), (len(d2t), d2t)):
            queue = ctx.Queue()
            proc = ctx.Process(target=memory_child, args=(child_args, stage, ids, batch_index, queue))
            proc.start()
            while True:
                try:
                    result = queue.get(timeout=5)
                    break
                except Empty:
                    if not proc.is_alive():
                        raise RuntimeError(
                            f"memory child for stage {stage}, V={vocab} died (exit code {proc.exitcode})"
                        )
            proc.join()
            out[config_name(stage, vocab)] = result
            print(
                f"memory {config_name(stage, vocab)}: peak above set-up "
                f"{max(result['step1_peak_above_setup'], result['step2_peak_above_setup']) / 1e6:.0f} MB",
                flush=True,
            )
    return out


def live_vocab_tensors(mem: dict, n_positions: int, full_vocab: int, reduced: int) -> dict:
    """Peak growth difference between the two vocabularies of one stage, in (B*T, V) fp32 tensors:
    how many vocabulary-sized fp32 tensors are alive at the step's peak."""
    out = {}
    for stage in STAGES:
        peak = {
            v: max(
                mem[config_name(stage, v)]["step1_peak_above_setup"],
                mem[config_name(stage, v)]["step2_peak_above_setup"],
            )
            for v in (full_vocab, reduced)
        }
        out[stage] = (peak[full_vocab] - peak[reduced]) / (n_positions * 4 * (full_vocab - reduced))
    return out


# ---- LLaMA3-8B on paper --------------------------------------------------------------------
def llama3_estimate() -> dict:
    """Training memory of one 2048-token sequence for the LLaMA3-8B GRIFFIN draft (see train.md)."""
    H, I, heads, V, T, P = (L3[k] for k in ("H", "I", "heads", "V", "T", "P"))
    tv4 = T * V * 4  # one (T, V) fp32 tensor
    static = {
        "fp32 master weights (4 B x P)": 4 * P,
        "fp32 grads (4 B x P)": 4 * P,
        "AdamW exp_avg + exp_avg_sq (8 B x P)": 8 * P,
        "frozen embedding, bf16 (V x H x 2 B)": V * H * 2,
        "frozen LM head, bf16 (V x H x 2 B)": V * H * 2,
    }
    stages = {}
    for J in STAGES:
        tgf = J * T * (30 * H + 4 * I)  # per stream: fc/norm/up inputs and outputs saved for backward
        layer = T * (30 * H + 8 * I) + J * T * 10 * H  # query-stream decoder layer + K/V of J streams
        scores = heads * T * (J * T)  # attention scores of pass J: T queries x J*T keys per head
        stages[J] = {
            "teacher p* (T x V fp32, whole step)": tv4,
            "pass loss/backward: log q + 2 transient (T x V) fp32 (grad of log q, grad of logits)": 3 * tv4,
            "layer activations saved for backward (bf16/fp32 mix)": tgf + layer,
            "attention, fused kernel (memory-efficient / flash)": 0,
            "attention, materialized (math path): scores + probs bf16": 2 * scores * 2,
        }
    return {
        "config": L3,
        "tv4_bytes": tv4,
        "static": static,
        "per_stage": stages,
        "as_implemented_extra": {
            "draft.float() also casts the frozen embedding and head to fp32 (+2 x V x H x 2 B)": 2 * V * H * 2,
            "autocast re-casts the fp32 head to bf16 per logits call, kept for backward (V x H x 2 B)": V * H * 2,
        },
    }


def estimate_totals(est: dict) -> dict:
    static = sum(est["static"].values())
    out = {}
    for J, terms in est["per_stage"].items():
        fused = static + sum(v for k, v in terms.items() if "materialized" not in k)
        out[J] = {
            "static_GB": static / GB,
            "total_fused_attention_GB": fused / GB,
            "total_materialized_attention_GB": (
                fused + terms["attention, materialized (math path): scores + probs bf16"]
            )
            / GB,
            "total_as_implemented_fused_GB": (fused + sum(est["as_implemented_extra"].values())) / GB,
        }
    return out


# ---- report --------------------------------------------------------------------------------
def hardware(args) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    flags = re.search(r"flags\s*:\s*(.*)", cpuinfo)
    flag_set = set(flags[1].split()) if flags else set()
    mem = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    import transformers

    return {
        "cpu": model[1].strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "torch_threads": args.threads,
        "avx512_bf16": "avx512_bf16" in flag_set,
        "amx": "amx_bf16" in flag_set,
        "memory_GB": int(mem[1]) * 1024 / GB if mem else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def markdown(r: dict) -> str:
    s, V, Vr = r["setup"], r["setup"]["full_vocab"], r["setup"]["reduced_vocab"]
    hw = r["hardware"]
    rows = []
    for stage in STAGES:
        x = r["throughput"][str(stage)]
        mf, mr = (r["memory"][config_name(stage, v)] for v in (V, Vr))
        peak = lambda m: max(m["step1_peak_above_setup"], m["step2_peak_above_setup"]) / 1e6  # noqa: E731
        rows.append(
            f"| {stage} | {stage} | {x['full_tokens_s_median']:.0f} | {x['reduced_tokens_s_median']:.0f} | "
            f"{x['reduced_over_full_median']:.2f}x ({x['reduced_over_full_min_max'][0]:.2f}-{x['reduced_over_full_min_max'][1]:.2f}) | "
            f"{peak(mf):.0f} | {peak(mr):.0f} |"
        )
    prof = r["profile"]
    prof_lines = "\n".join(
        f"| stage 2, V={v} | {p['step_s_profiled']:.1f} | {100 * p['vocab_sized_fraction']:.0f}% | "
        f"{', '.join(f'{k} {ms:.0f}' for k, ms in list(p['top_ops_ms'].items())[:5])} |"
        for v, p in prof.items()
    )
    est, tot = r["llama3_8b_estimate"], r["llama3_8b_totals"]
    H, I, heads, Vl, T, P = (est["config"][k] for k in ("H", "I", "heads", "V", "T", "P"))
    static_lines = "\n".join(f"| {k} | {v / GB:.2f} |" for k, v in est["static"].items())
    stage_terms = list(est["per_stage"]["1"].keys())
    term_lines = "\n".join(
        f"| {k} | " + " | ".join(f"{est['per_stage'][str(J)][k] / GB:.2f}" for J in STAGES) + " |" for k in stage_terms
    )
    total_lines = "\n".join(
        [
            "| **total, fused attention** | "
            + " | ".join(f"**{tot[str(J)]['total_fused_attention_GB']:.1f}**" for J in STAGES)
            + " |",
            "| total, materialized attention | "
            + " | ".join(f"{tot[str(J)]['total_materialized_attention_GB']:.1f}" for J in STAGES)
            + " |",
            "| total as implemented today (fp32 frozen copies + per-call bf16 head cast), fused | "
            + " | ".join(f"{tot[str(J)]['total_as_implemented_fused_GB']:.1f}" for J in STAGES)
            + " |",
        ]
    )
    k = r["live_vocab_tensors_measured"]
    smol = r["memory"][config_name(1, V)]
    return f"""# Training throughput benchmark

`griffin.training.train_step` (bf16 autocast, fp32 master weights, AdamW, per-pass backward, grad value
clipping) of a GRIFFIN draft for SmolLM2-135M-Instruct ({smol["trainable_params"] / 1e6:.2f} M trainable parameters) on
{hw["cores"]} CPU cores ({hw["cpu"]}, AVX-512 BF16: {hw["avx512_bf16"]}, AMX: {hw["amx"]}), {hw["torch_threads"]} torch threads,
torch {hw["torch"]}, transformers {hw["transformers"]}. Features: {s["rows"]} ShareGPT conversations
featurized by `run_featurize` (max_len {s["max_len"]}, {s["store_tokens"]} tokens), batches of <= {s["batch_tokens"]} padded tokens
built like the training loop. {r["timing_rounds"]} interleaved rounds after one warm-up step per configuration; every
configuration trains on the same batch in a round (batch sizes {s["timed_batches_real_tokens"]} real tokens).
tokens/s = real (non-padding) tokens / step wall time, median over rounds; the ratio is the median of per-round
ratios (range in brackets). Load average {hw["loadavg_start"][0]:.1f} at the start, {hw["loadavg_end"][0]:.1f} at the end
(shared machine: absolute numbers are noisy, ratios are the result).

Peak memory: each configuration in a fresh spawned process on the largest batch ({s["memory_batch"]["B"]} x
{s["memory_batch"]["T"]} = {s["memory_batch"]["positions"]} padded positions): peak RSS (VmHWM, reset via
`/proc/self/clear_refs`) during a training step minus the RSS after set-up (target, draft with its frozen
buffers, optimizer, batch), max over the first step (which allocates grads and AdamW state) and a second one.

| stage | passes | tokens/s V={V} | tokens/s V={Vr} | V={Vr} / V={V} | peak MB above set-up, V={V} | peak MB, V={Vr} |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Step time relative to stage 1 (median of per-round ratios): stage 2 {r["throughput"]["2"]["full_step_over_stage1_median"]:.2f}x /
{r["throughput"]["2"]["reduced_step_over_stage1_median"]:.2f}x, stage 3 {r["throughput"]["3"]["full_step_over_stage1_median"]:.2f}x /
{r["throughput"]["3"]["reduced_step_over_stage1_median"]:.2f}x (full / reduced vocabulary).

Where the time goes (one profiled step, self CPU time; "vocabulary-sized" = ops with an input dimension equal
to the draft vocabulary: LM-head matmuls and their backward, the head cast, softmax/log-softmax, the loss
products and sums, top-k):

| step | step s (profiled) | vocabulary-sized ops | top ops (ms; [V] = vocabulary-sized) |
|---|---|---|---|
{prof_lines}

Vocabulary-sized memory at the step's peak, in (B*T, V) fp32 tensors: (peak(V={V}) - peak(V={Vr})) / (({V} - {Vr}) x
{s["memory_batch"]["positions"]} positions x 4 B) = stage 1 {k["1"]:.1f}, stage 2 {k["2"]:.1f}, stage 3 {k["3"]:.1f}. This counts the bf16 copy
of the head that autocast makes for the LM-head matmul too; each copy is H x 2 / (B*T x 4) =
{s["hidden_size"] * 2 / (s["memory_batch"]["positions"] * 4):.2f} of a (B*T, V) fp32 tensor at this H and B*T.
`ru_maxrss` is not usable for this: in the spawned child it already reads {smol["ru_maxrss_after_setup"] / 1e9:.1f} GB right
after set-up (RSS {smol["setup_rss"] / 1e9:.2f} GB) - Linux folds the forked parent's high-water mark into it at exec - and it
cannot be reset, so it never moves during the steps; VmHWM after `clear_refs` can and does.

## LLaMA3-8B target at max_len 2048 (on paper)

Draft per docs/method.md §2.5: H = {H}, I = {I}, {heads} heads MHA, V = {Vl}, P = {P:,} trainable parameters; one
{T}-token sequence per step, bf16 autocast with fp32 master weights. GB = 10^9 bytes. One (T, V) fp32 tensor is
{T} x {Vl} x 4 B = {est["tv4_bytes"] / GB:.2f} GB.

Resident for the whole run:

| term | GB |
|---|---|
{static_lines}
| **static total** | **{tot["1"]["static_GB"]:.2f}** |

Per step, at the peak (the backward of one pass's loss). Every pass is back-propagated before the next one
starts (docs/method.md §3.2), so a pass's activations are freed before the next pass; what grows with the number of
passes J is the J fused streams the TGF runs and the J*T keys the attention sees.

| term | stage 1 (J=1) | stage 2 (J=2) | stage 3 (J=3) |
|---|---|---|---|
{term_lines}
{total_lines}

Arithmetic:
- 4P = 4 x {P:,} = {4 * P / GB:.2f} GB each for the master weights and the grads; AdamW's two moments 8P = {8 * P / GB:.2f} GB;
  the frozen embedding and the (untied) LM head are V x H x 2 B = {Vl} x {H} x 2 = {Vl * H * 2 / GB:.2f} GB each.
- The teacher distribution p* = softmax(lm_head(f_t+1)) is one (T, V) fp32 tensor alive for the whole step: {est["tv4_bytes"] / GB:.2f} GB.
  In each pass the loss keeps log q (T x V fp32, saved by log_softmax) and its backward briefly holds the gradient
  of log q and of the logits at once: teacher + 3 x (T, V) fp32 = 4 x {est["tv4_bytes"] / GB:.2f} GB at the peak, the
  same for every stage (the top-k loss of stages >= 2 reuses log q; the alignment top-3 logits are bf16, no-grad).
  Check against the SmolLM2 measurement above: it predicts 4 + 1 bf16 head copy = {4 + s["hidden_size"] * 2 / (s["memory_batch"]["positions"] * 4):.2f}
  (B*T, V) fp32 equivalents there; measured {k["1"]:.1f} / {k["2"]:.1f} / {k["3"]:.1f} (stages 1 / 2 / 3).
- Layer activations: per stream the TGF keeps ~(30 H + 4 I) bytes per token ({(30 * H + 4 * I) * T / GB:.2f} GB per stream at T = {T}),
  the decoder layer ~(30 H + 8 I) bytes per token on the query stream plus ~10 H per token for the K/V of every stream.
  These are estimates of the saved tensors (bf16 matmul inputs/outputs, fp32 RMSNorm internals, fp32 residuals).
- Attention of pass J: {heads} heads x T x J*T scores = {heads} x {T} x {T} x J = {heads * T * T / 1e9:.2f} G x J elements.
  With a fused kernel (SDPA's memory-efficient kernel takes a boolean mask) nothing of that size is stored; on the
  math path scores and probabilities are kept in bf16: 2 x 2 B x {heads * T * T / 1e9:.2f} G x J = {2 * 2 * heads * T * T / GB:.2f} GB x J.
- As implemented today, `draft.float()` in `pipeline/train/driver.py` also turns the frozen embedding and head buffers
  into fp32 (+{2 * Vl * H * 2 / GB:.2f} GB), and `GriffinDraft.logits` multiplies by the fp32 head under autocast,
  so every logits call makes a bf16 copy of the head ({Vl * H * 2 / GB:.2f} GB, kept for the pass's backward).
  Keeping the frozen buffers bf16 saves ~{3 * Vl * H * 2 / GB:.1f} GB per GPU at this vocabulary.

Everything per step scales with the tokens per micro-batch: each further 2048-token sequence adds the per-step
rows again ({tot["3"]["total_fused_attention_GB"] - tot["1"]["static_GB"]:.1f} GB at stage 3, fused attention), so the official 4 x 2048 tokens per GPU
come to ~{tot["1"]["static_GB"] + 4 * (tot["3"]["total_fused_attention_GB"] - tot["1"]["static_GB"]):.0f} GB at stage 3 without gradient checkpointing (the official code checkpoints
the decoder layer, docs/method.md §3.4), and the (T, V) fp32 terms are the first thing to chunk or fuse beyond that.
"""


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    V, Vr = r["setup"]["full_vocab"], r["setup"]["reduced_vocab"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4))
    x = range(len(STAGES))
    width = 0.38
    for offset, vocab, key, color in ((-width / 2, V, "full", "tab:grey"), (width / 2, Vr, "reduced", "tab:blue")):
        med = [r["throughput"][str(s)][f"{key}_tokens_s_median"] for s in STAGES]
        per_round = [[x["tokens_s"] for x in r["samples"][config_name(s, vocab)]] for s in STAGES]
        err = [[m - min(p) for m, p in zip(med, per_round)], [max(p) - m for m, p in zip(med, per_round)]]
        left.bar([i + offset for i in x], med, width, yerr=err, capsize=3, color=color, label=f"V = {vocab}")
        peaks = [
            max(
                r["memory"][config_name(s, vocab)]["step1_peak_above_setup"],
                r["memory"][config_name(s, vocab)]["step2_peak_above_setup"],
            )
            / 1e6
            for s in STAGES
        ]
        middle.bar([i + offset for i in x], peaks, width, color=color, label=f"V = {vocab}")
    for ax in (left, middle):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
        ax.set_xticks(list(x), [f"stage {s}\n({s} pass{'es' * (s > 1)})" for s in STAGES])
        ax.legend()
    left.set_ylabel("tokens/s (median, min-max)")
    left.set_title("SmolLM2 draft train_step throughput")
    middle.set_ylabel("MB")
    middle.set_title("peak RSS above set-up per step")
    est = r["llama3_8b_estimate"]
    bottom = [0.0] * len(STAGES)
    static = sum(est["static"].values()) / GB
    right.bar(list(x), [static] * len(STAGES), color="tab:grey", label="weights+grads+AdamW+frozen")
    bottom = [static] * len(STAGES)
    colors = ["tab:orange", "tab:red", "tab:green", "white", "tab:purple"]
    for term, color in zip(est["per_stage"]["1"], colors):
        if "fused kernel" in term:
            continue
        vals = [est["per_stage"][str(s)][term] / GB for s in STAGES]
        right.bar(list(x), vals, bottom=bottom, color=color, label=term.split(":")[0].split("(")[0].strip())
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xticks(list(x), [f"stage {s}" for s in STAGES])
    right.set_ylabel("GB")
    right.set_title("LLaMA3-8B draft, T=2048, on paper")
    right.legend(fontsize=7, loc="upper left")
    right.set_ylim(0, max(bottom) * 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- main ----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--reduced-vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=15, help="at most this many timed rounds")
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=420, help="seconds of timed rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/griffin-train-bench"))
    parser.add_argument("--reuse-store", action="store_true", help="keep an existing store (featurize resumes)")
    parser.add_argument(
        "--out-prefix", default="train", help="result file names (benchmarks/training/<prefix>.json ...)"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    load_start, wall_start = os.getloadavg(), time.perf_counter()
    torch.set_num_threads(args.threads)

    cfg = load_config(BASE_CONFIG, overrides(args))
    store_summary = build_store(cfg, args.reuse_store)
    print(f"store: {json.dumps(store_summary)}", flush=True)
    target = load_target(cfg.target)
    V = target.vocab_size
    batches = load_batches(cfg.store_path, args.batch_tokens, target.hidden_size)
    d2t = reduced_vocabulary(store_tokens(cfg.store_path), args.reduced_vocab, V, exclude=set())
    print(f"{len(batches)} batches; real tokens {[int(b.attention_mask.sum()) for b in batches]}", flush=True)

    trainers = {
        config_name(stage, vocab): Trainer(target, stage, ids)
        for stage in STAGES
        for vocab, ids in ((V, None), (args.reduced_vocab, d2t))
    }
    timed = timing(trainers, batches, args)
    profile = {
        vocab: profile_split(trainers[config_name(2, vocab)], batches[1], vocab) for vocab in (V, args.reduced_vocab)
    }
    del trainers
    gc.collect()

    big = max(range(len(batches)), key=lambda i: (batches[i].tokens.numel(), batches[i].tokens.shape[1]))
    mem_batch = {
        "index": big,
        "B": batches[big].tokens.shape[0],
        "T": batches[big].tokens.shape[1],
        "positions": batches[big].tokens.numel(),
        "real_tokens": int(batches[big].attention_mask.sum()),
    }
    mem = memory(args, d2t.tolist(), big, V)
    est = llama3_estimate()
    result = {
        "hardware": {**hardware(args), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "setup": {
            "base_config": BASE_CONFIG,
            "overrides": overrides(args),
            "rows": store_summary["rows"],
            "store_tokens": store_summary["tokens"],
            "max_len": args.max_len,
            "batch_tokens": args.batch_tokens,
            "featurize": store_summary,
            "full_vocab": V,
            "reduced_vocab": args.reduced_vocab,
            "hidden_size": target.hidden_size,
            "batches": len(batches),
            "timed_batches_real_tokens": sorted({x["tokens"] for x in timed["samples"][config_name(1, V)]}),
            "reduced_vocab_coverage_of_store_tokens": None,
            "memory_batch": mem_batch,
            "method": TrainConfig(stage=1).model_dump(mode="json"),
        },
        "timing_rounds": timed["rounds"],
        "throughput": {str(k): v for k, v in summarize(timed["samples"], V, args.reduced_vocab).items()},
        "profile": {str(k): v for k, v in profile.items()},
        "memory": mem,
        "live_vocab_tensors_measured": {
            str(k): v for k, v in live_vocab_tensors(mem, mem_batch["positions"], V, args.reduced_vocab).items()
        },
        "llama3_8b_estimate": {**est, "per_stage": {str(k): v for k, v in est["per_stage"].items()}},
        "llama3_8b_totals": {str(k): v for k, v in estimate_totals(est).items()},
        "samples": timed["samples"],
        "bench_wall_s": time.perf_counter() - wall_start,
    }
    result["setup"]["reduced_vocab_coverage_of_store_tokens"] = coverage(cfg.store_path, d2t)
    prefix = args.out_prefix
    (OUT / f"{prefix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / f"{prefix}.md").write_text(markdown(result))
    plot(result, OUT / f"{prefix}.png")
    print(
        json.dumps({k: result[k] for k in ("throughput", "live_vocab_tensors_measured", "llama3_8b_totals")}, indent=2)
    )


def coverage(store: str, d2t: torch.Tensor) -> float:
    """Fraction of the store's tokens that the reduced vocabulary contains."""
    from pipeline.train.batches import store_tokens, token_frequencies

    counts = token_frequencies(store_tokens(store), set())
    keep = set(d2t.tolist())
    return sum(c for t, c in counts.items() if t in keep) / max(1, sum(counts.values()))


if __name__ == "__main__":
    main()
