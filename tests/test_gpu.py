"""The CUDA paths: featurize, a training step and decoding on a GPU (marked ``gpu``; skipped without CUDA).

Each compares the GPU with the CPU reference or with the method's invariant, on the tiny targets:
- featurize: the Featurizer's post-norm features on CUDA match the CPU's (fp32) and the bf16 bytes decode;
- train step: a bf16-autocast step on CUDA moves the weights like the CPU step does, and the loss falls;
- decode: speculative == vanilla token for token on CUDA in fp32 (greedy), the bf16 CUDA decode runs, and
  decoding leaves out cuDNN's attention (a graph rebuilt at every new KV length).
"""

import numpy as np
import pytest
import torch

from griffin.config import SamplingConfig, StagePlan, TrainConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.losses import shift_batch
from griffin.model import GriffinDraft
from griffin.training import make_optimizer, make_scheduler, train_step
from pipeline.config import load_config
from tests.conftest import make_target

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def tiny_section(device: str):
    cfg = load_config("jobs/configs/tiny.yaml", [f"target.device={device}"])
    return cfg.target.model_dump()


def test_featurizer_on_cuda_matches_cpu():
    from pipeline.data.featurize import Featurizer
    from pipeline.data.store import decode_row

    rng = np.random.default_rng(0)
    batch = {
        "sample_id": np.asarray(["a", "b"]),
        "input_ids": np.asarray(
            [rng.integers(3, 200, 40, dtype=np.int32), rng.integers(3, 200, 17, dtype=np.int32)], dtype=object
        ),
        "loss_mask": np.asarray([np.ones(40, np.uint8), np.ones(17, np.uint8)], dtype=object),
    }
    gpu, cpu = Featurizer(tiny_section("cuda"), dtype="bf16"), Featurizer(tiny_section("cpu"), dtype="bf16")
    assert gpu.target.device.type == "cuda"
    # forward -> [(final (T, D), layers (T, k, D) or None)]
    for (ours, _), (reference, _) in zip(gpu.forward(list(batch["input_ids"])), cpu.forward(list(batch["input_ids"]))):
        assert ours.device.type == "cpu" and torch.allclose(ours, reference, atol=1e-4, rtol=1e-4)
    rows = gpu(batch)
    assert list(rows["error"]) == ["", ""]
    row = {"hidden": rows["hidden"][1], "input_ids": batch["input_ids"][1], "loss_mask": batch["loss_mask"][1]}
    decoded = decode_row(row, gpu.target.hidden_size)["hidden"]  # (T, D) bf16
    assert decoded.shape == (17, gpu.target.hidden_size)
    assert torch.allclose(decoded.float(), cpu.forward([batch["input_ids"][1]])[0][0], atol=0.05, rtol=0.02)


def _step_batch(target, device):
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 24))
    with torch.no_grad():
        features = target.backbone(input_ids=ids).last_hidden_state  # (B, T, D) on the CPU
    return shift_batch(
        features.to(device), ids.to(device), torch.ones_like(ids, device=device), torch.ones_like(ids, device=device)
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_train_step_on_cuda(stage):
    target = make_target("llama")
    batch_cpu = _step_batch(target, "cpu")
    method, plan = (
        TrainConfig(noise_scale=0.0, warmup_steps=0),
        StagePlan.for_stage(stage, "griffin", steps=20, lr=3e-3),
    )
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(1)
        draft = GriffinDraft.for_target(target).cast_parameters(torch.float32).to(device)
        start = draft.fusion.fc.weight.detach().cpu().clone()
        batch = _step_batch(target, device) if device == "cuda" else batch_cpu
        optimizer, losses = make_optimizer(draft, method, plan), []
        scheduler = make_scheduler(optimizer, method, plan)
        for _ in range(8):
            losses.append(train_step(draft, draft, [batch], optimizer, scheduler, method, plan, bf16=True)["loss"])
        results[device] = (losses, draft.fusion.fc.weight.detach().cpu() - start)
    (cpu_losses, cpu_moved), (gpu_losses, gpu_moved) = results["cpu"], results["cuda"]
    assert gpu_losses[-1] < gpu_losses[0]
    assert gpu_losses[0] == pytest.approx(cpu_losses[0], rel=0.05)  # bf16 autocast differs across devices
    # Adam moves every weight by about lr a step whatever its gradient's size, so a gradient near zero
    # that bf16 rounds to the other sign on the other device moves that weight the other way: compare
    # the updates as a whole, not weight by weight.
    cosine = torch.nn.functional.cosine_similarity(gpu_moved.flatten(), cpu_moved.flatten(), dim=0).item()
    spread = ((gpu_moved - cpu_moved).norm() / cpu_moved.norm()).item()
    assert cosine > 0.95 and spread < 0.3, f"update cosine {cosine:.4f}, relative difference {spread:.4f}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculative_equals_vanilla_on_cuda_fp32(arch):
    target = make_target(arch)
    target.model.to(CUDA)
    draft = GriffinDraft.for_target(target).to(CUDA)
    gen = torch.Generator().manual_seed(0)
    for tree in (TreeConfig(total_tokens=12, depth=3, top_k=4), TreeConfig()):
        ids = torch.randint(3, 128, (1, 12), generator=gen).to(CUDA)
        reference = vanilla_generate(target, ids, SamplingConfig(), 24, stop_token_ids=[])
        spec = speculative_generate(target, draft, ids, tree, SamplingConfig(), 24, stop_token_ids=[])
        assert spec.tokens == reference.tokens and len(spec.tokens) == 24


def test_bf16_sampling_decode_on_cuda():
    target = make_target("llama")
    target.model.to(device=CUDA, dtype=torch.bfloat16)
    draft = GriffinDraft.for_target(target).to(CUDA).cast_parameters(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 10)).to(CUDA)
    out = speculative_generate(
        target,
        draft,
        ids,
        TreeConfig(total_tokens=16, depth=4, top_k=4),
        SamplingConfig(temperature=1.0),
        32,
        0,
        stop_token_ids=[],
    )
    assert len(out.tokens) == 32 and all(0 <= t < target.vocab_size for t in out.tokens)
    assert out.stats.rounds >= 1


def test_bf16_decode_on_cuda_skips_cudnn_attention():
    """cuDNN's attention rebuilt its graph at every step's new KV length (85 vs 22-25 ms a SmolLM2
    step on an H200, benchmarks/gpu/gpu_dtype.md); decoding leaves that backend out."""
    from torch.profiler import ProfilerActivity, profile

    target = make_target("llama")
    target.model.to(device=CUDA, dtype=torch.bfloat16)
    draft = GriffinDraft.for_target(target).to(CUDA).cast_parameters(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 10)).to(CUDA)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        vanilla_generate(target, ids, SamplingConfig(), 8, stop_token_ids=[])
        speculative_generate(
            target, draft, ids, TreeConfig(total_tokens=12, depth=3, top_k=4), SamplingConfig(), 8, stop_token_ids=[]
        )
    names = {event.key for event in prof.key_averages()}
    assert not [name for name in names if "cudnn_attention" in name]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the decode


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_decode_equals_eager_on_cuda(arch):
    """decode.compile on CUDA: the steps are CUDA graphs (griffin.static); fp32 output equals eager
    token for token at T=0 and seeded T>0, speculative and vanilla, across a width bucket, and a
    batch of rows of different lengths equals each row's eager decode."""
    from griffin.policy import SpeculationPolicy
    from griffin.request import DecodeRequest
    from griffin.offline import generate_batch
    from tests.griffin.test_compiled import NEW, TREE, compiled_twin

    target = make_target(arch)
    target.model.to(CUDA)
    twin = compiled_twin(target)
    draft = GriffinDraft.for_target(target).to(CUDA)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0)).to(CUDA)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        spec = [speculative_generate(t, draft, ids, TREE, sampling, NEW, 5, stop_token_ids=[]) for t in (target, twin)]
        plain = [vanilla_generate(t, ids, sampling, NEW, 5, stop_token_ids=[]) for t in (target, twin)]
        assert spec[1].tokens == spec[0].tokens and plain[1].tokens == plain[0].tokens
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 47)]

    def batch(t):
        requests = [DecodeRequest(p, SamplingConfig(), 40, stop_token_ids=[]) for p in prompts]
        return [r.tokens for r in generate_batch(t, draft, requests, SpeculationPolicy({1: TREE}))]

    assert batch(twin) == batch(target)
