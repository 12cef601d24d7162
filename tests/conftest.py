"""Shared fixtures: tiny random targets built from a config (no downloads)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from griffin.target import TargetAdapter
from pipeline.runtime import free_port  # noqa: F401  (the tests' servers and Ray nodes take ports from it)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray Train's controller polls its workers every 2 s by default, and a worker's ray.train.report
# waits until the previous report was polled: the tests' stages of a few steps spent most of their
# training time waiting on polls. Propagated to the controller and the workers (and inherited by the
# `griffin` subprocesses and the cluster test's nodes).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# The decoder replicas' fault-injection flag (pipeline.serve.replica.FAULT_ENV), named before Ray starts so
# that every replica process inherits it: a test makes a replica's engine fail by writing the file. Each
# test process (each pytest-xdist worker) names its own, so that a fault planted by one worker's test
# never fails another worker's replicas.
os.environ["GRIFFIN_ENGINE_FAULT"] = str(Path(tempfile.mkdtemp(prefix="griffin-faults-")) / "engine")
# In-process tests run tiny models: their many small ops are fastest on one thread, and on a loaded
# 2-core machine torch's spinning intra-op threads made them ~100x slower (timeouts).
torch.set_num_threads(1)

# Nothing outside the checkout: this process and every Python process the tests start (Ray workers,
# `griffin` subprocesses, Serve replicas) log any file they open beside the checkout; the session
# fails if one did (tests/audit/sitecustomize.py).
REPO = Path(__file__).resolve().parents[1]
AUDIT = Path(__file__).resolve().parent / "audit"
os.environ["GRIFFIN_AUDIT_REPO"] = str(REPO)
# setdefault, not a name per process: under pytest-xdist the controller checks the log at the end (a
# worker's failed session status is not passed on), so the workers write to the controller's log
os.environ.setdefault("GRIFFIN_AUDIT_LOG", str(Path(tempfile.mkdtemp(prefix="griffin-audit-")) / "outside.log"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(AUDIT), os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, str(AUDIT))
import sitecustomize as _audit  # noqa: E402  (this process: the hook installs on import)

if getattr(_audit, "_hook", None) is None:  # another sitecustomize was imported first: install ours
    import importlib.util

    spec = importlib.util.spec_from_file_location("griffin_audit", AUDIT / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@contextlib.contextmanager
def tiny_deployment(tmp: Path, *overrides: str):
    """Serve the tiny target with a random draft (lineage recorded) on the suite's Ray; yields
    (url, httpx client, config, target, draft directory) and shuts the application down after."""
    import httpx

    from griffin.model import GriffinDraft
    from pipeline.config import load_config
    from pipeline.resources.drafts import save_draft_with_lineage
    from pipeline.resources.targets import load_target
    from pipeline.serve.lifecycle import start_serve, stop_serve

    tiny = REPO / "jobs" / "configs" / "tiny.yaml"
    target = load_target(load_config(tiny, [f"output_dir={tmp}"]).target)
    torch.manual_seed(0)
    draft_dir = save_draft_with_lineage(GriffinDraft.for_target(target), tmp / "draft", target)
    cfg = load_config(
        tiny,
        [
            f"output_dir={tmp}",
            f"serve.draft_uri={draft_dir}",
            f"serve.port={free_port()}",
            "cluster.num_cpus=2",
            *overrides,
        ],
    )
    url = start_serve(cfg)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield SimpleNamespace(client=client, url=url, cfg=cfg, target=target, draft_dir=draft_dir)
    finally:
        stop_serve()


def joining_env() -> dict[str, str]:
    """The environment for a `griffin` subprocess that joins the suite's local Ray (``ray_local``) as a
    cluster user's command joins theirs, instead of starting and stopping a Ray of its own: most of a
    small command's cost on 2 cores."""
    import ray

    address = ray.get_runtime_context().gcs_address
    return {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def wait_for(condition, timeout: float = 120.0, what: str = "condition"):
    """Polls ``condition`` every 0.1 s until it returns something true, which is returned; fails after
    ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)
    return value


def first_content(lines) -> dict:
    """Reads a stream's lines (``iter_lines``) up to its first chunk with content, past the role chunk
    and the blank lines between events: the decode has committed tokens. Returns that chunk."""
    for line in lines:
        assert line != "data: [DONE]", "the stream ended before any content"
        chunk = json.loads(line.removeprefix("data: ")) if line.startswith("data: ") else {}
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            return chunk
    raise AssertionError("the stream ended before any content")


# `make test` runs the suite on two pytest-xdist workers, a module at a time (`--dist loadscope`, handed
# out in collection order). These modules take most of its time (their sums of test durations, 2 vCPUs,
# 2026-12-07, in seconds: 520, 380, 320, 180, 170, 155, 130, 120, 70): handed out first, longest first, so
# that the two workers end together instead of one of them starting a long module last.
LONGEST_FIRST = [
    "tests/pipeline/test_train.py",
    "tests/test_e2e.py",
    "tests/test_cluster.py",
    "tests/pipeline/test_serve_replica_death.py",
    "tests/griffin/test_compiled.py",
    "tests/griffin/test_engine_law.py",
    "tests/griffin/test_families.py",
    "tests/griffin/test_verify.py",
    "tests/pipeline/test_serve_sigterm.py",
]


def pytest_collection_modifyitems(config, items):
    """The longest modules first (``LONGEST_FIRST``; the rest keep their order), and ``gpu``-marked
    tests run where CUDA is, and are skipped (not failed) everywhere else."""
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: in-module order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (the gpu marker); runs on a machine with a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def opened_outside_checkout() -> list[str]:
    log = Path(os.environ["GRIFFIN_AUDIT_LOG"])
    return log.read_text().splitlines() if log.is_file() else []


def pytest_sessionfinish(session, exitstatus):
    # a child process a failed test left behind (e.g. a stuck DDP rank) would keep pytest from exiting:
    # the interpreter joins non-daemonic multiprocessing children at exit
    for child in multiprocessing.active_children():
        print(f"\nkilling a leftover child process: {child.name} (pid {child.pid})")
        child.kill()
    outside = opened_outside_checkout()
    if outside:
        print(
            "\nfiles opened beside the checkout (the project must carry what it reads):\n  " + "\n  ".join(outside[:20])
        )
        session.exitstatus = 1


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
)


def make_target(arch: str = "llama", seed: int = 0, **overrides) -> TargetAdapter:
    torch.manual_seed(seed)
    fields = {**TINY, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields, tie_word_embeddings=False))
    elif arch == "llama-tied":
        model = LlamaForCausalLM(LlamaConfig(**fields, tie_word_embeddings=True))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**fields, tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "sdpa"
    return TargetAdapter(model.float(), name=f"tiny-{arch}")


def tree_forward(target: TargetAdapter, cache, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor):
    """A reference tree verify on a one-sequence cache (``target.new_cache``): ``tokens`` and
    ``depths`` (N,) written after the cache's prefix, ``tree_mask`` (N, N) ancestor-or-self. Returns
    the features (1, N, D_f) and logits (1, N, V)."""
    n = cache.length
    mask = torch.cat([torch.ones(tree_mask.shape[0], n, dtype=torch.bool), tree_mask], dim=1)  # (N, n + N)
    return target.forward(tokens[None], cache, n + depths, mask)


def last_checkpoint(run_dir: Path, run_name: str, stage: int) -> Path:
    """A training stage's latest complete checkpoint (Ray Train names the folders by time)."""
    return max(
        p.parent for p in (run_dir / "ray_train" / f"{run_name}-stage{stage}").glob("checkpoint_*/train_state.pt")
    )


def assert_same_train_state(ours: Path, theirs: Path, world: int) -> None:
    """Two training checkpoints (``pipeline.train.worker._save_checkpoint``'s folders) hold the same state
    bit for bit: the draft's weights, the step, the LR schedule, the data position and Adam's moments."""
    from safetensors.torch import load_file

    weights = [load_file(ckpt / "draft" / "model.safetensors") for ckpt in (ours, theirs)]
    assert weights[0].keys() == weights[1].keys()
    assert [k for k in weights[1] if not torch.equal(weights[0][k], weights[1][k])] == [], "weights differ"
    state, reference = (torch.load(ckpt / "train_state.pt", weights_only=True) for ckpt in (ours, theirs))
    assert state["step"] == reference["step"] and state["scheduler"] == reference["scheduler"]
    assert state["stream"] == reference["stream"] and state["world_size"] == reference["world_size"] == world
    moments, expected = state["optimizer"]["state"], reference["optimizer"]["state"]
    assert moments.keys() == expected.keys()
    differ = [(k, n) for k in expected for n in expected[k] if not torch.equal(moments[k][n], expected[k][n])]
    assert differ == [], "Adam's moments differ"


@pytest.fixture(scope="session")
def tiny_llama() -> TargetAdapter:
    return make_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> TargetAdapter:
    return make_target("qwen2", seed=1)


class OracleDraft(torch.nn.Module):
    """A test draft whose proposals are the target's own next-token logits, so nearly every draft
    token is accepted (the opposite worst case to an untrained draft). It mimics
    ``GriffinDraft.step`` / ``logits`` by replaying each query's visible token context through the
    target without a cache; features are ignored."""

    def __init__(self, target: TargetAdapter, first_token: int):
        super().__init__()
        from griffin.config import DraftConfig

        self.target = target
        self.cfg = DraftConfig.from_target(target.hf_config, variant="eagle")
        self.head_weight = target.head_weight
        self.d2t = None
        self.first_token = first_token
        self.entry_tokens: list[int] = []  # token of each draft-cache entry

    param_dtype = torch.float32

    def logits(self, prediction):
        return prediction  # step() already returns logits as the "prediction"

    def to_target_ids(self, ids):
        return ids

    def fuse_target(self, features):
        return features

    def step(self, features, tokens, positions, cache, mask):
        """One request (a one-row cache): mask (1, 1, T, S); the tree code sets the cache's length."""
        del self.entry_tokens[cache.slots.lengths[0] :]  # the tree code rolls the length back each round
        self.entry_tokens.extend(tokens[0].tolist())
        rows = []
        for row in mask[0, 0].tolist():
            context = [self.first_token] + [t for t, seen in zip(self.entry_tokens, row) if seen]
            out = self.target.model(torch.tensor([context]))
            rows.append(out.logits[0, -1])
        logits = torch.stack(rows)[None]  # (1, T, V)
        return logits, torch.zeros(1, tokens.shape[1], self.cfg.hidden_size)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session, started as the product starts one (127.0.0.1, its own State API
    server), shut down at the end. tiny.yaml's 6 logical CPUs exceed the 2 physical cores so that
    2 train workers and Ray Data tasks can be placed at once."""
    import ray

    from pipeline.config import load_config
    from pipeline.runtime import ensure_ray

    os.environ.pop("RAY_ADDRESS", None)  # never a cluster of the user's: the tests start their own
    ensure_ray(load_config(REPO / "jobs" / "configs" / "tiny.yaml"))
    yield
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()
