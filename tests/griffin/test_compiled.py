"""Compiled decoding (griffin.static, ``decode.compile=on``) decodes exactly what eager decoding does.

The same tiny fp32 targets and drafts decode eagerly and through the compiled static-shape steps
(inductor on CPU): token for token at T=0 and at seeded T>0, speculative and vanilla, alone and in
a batch of rows of different lengths whose widths cross a bucket. tests/test_gpu.py runs the twin
on CUDA, where the steps are CUDA graphs."""

import pytest
import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.offline import generate_batch, warm_up
from griffin.model import GriffinDraft
from griffin.static import MIN_BUCKET, compile_enabled, width_bucket
from griffin.target import TargetAdapter
from tests.conftest import make_target

TREE = TreeConfig(total_tokens=12, depth=3, top_k=4)
# The qwen2 target's second layer attends to a window of 3 positions (the first to all): per-layer-kind
# masks through the compiled steps, alone and in the batch test, on the suite's one compiled windowed target.
WINDOWED = dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)
NEW = MIN_BUCKET + 16  # from a 20-token prompt, the widths cross from the first bucket into the next


def compiled_twin(target: TargetAdapter) -> TargetAdapter:
    """A second adapter over the same weights that decodes compiled."""
    twin = TargetAdapter(target.model, target.tokenizer, name=f"{target.name}-compiled")
    twin.compile_decoding()
    return twin


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process (torch._dynamo.reset does not zero it)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


GRAPHS_AT_RESET: dict[str, int] = {}  # architecture -> compiled_graphs() when its ``models`` were built


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    torch._dynamo.reset()
    GRAPHS_AT_RESET[request.param] = compiled_graphs()
    target = make_target(request.param, **(WINDOWED if request.param == "qwen2" else {}))
    assert request.param != "qwen2" or target.hf_config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(1)
    return target, compiled_twin(target), GriffinDraft.for_target(target, variant="griffin")


def test_compile_setting_and_buckets():
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled("on", "cpu") and not compile_enabled("off", "cuda")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        compile_enabled("yes", "cpu")
    assert [width_bucket(w, 4096) for w in (1, 64, 65, 130, 4000)] == [64, 64, 128, 256, 4096]
    assert width_bucket(70, 100) == 100  # capped at the capacity, never below the width
    assert width_bucket(70, 70) == 70


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_equals_eager_token_for_token(models, temperature):
    target, twin, draft = models
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(temperature=temperature)
    spec = [speculative_generate(t, draft, ids, TREE, sampling, NEW, 5, stop_token_ids=[]) for t in (target, twin)]
    plain = [vanilla_generate(t, ids, sampling, NEW, 5, stop_token_ids=[]) for t in (target, twin)]
    assert spec[1].tokens == spec[0].tokens and len(spec[0].tokens) == NEW
    assert spec[1].stats.accepted_per_round == spec[0].stats.accepted_per_round
    assert plain[1].tokens == plain[0].tokens
    if temperature == 0.0:
        assert spec[1].tokens == plain[0].tokens  # and lossless: the target's greedy output
    graph_breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not graph_breaks, f"the compiled decode steps broke their graphs: {graph_breaks}"


# one architecture, the windowed one: compiling costs ~30 s a test
@pytest.mark.parametrize("models", ["qwen2"], indirect=True)
def test_compiled_batch_equals_eager(models, monkeypatch):
    """Rows of different lengths decode together over a full layer and a window-3 one, one of them plainly
    (speculative: false); a policy switches to plain rounds at batch 3 and back as rows leave: every row
    equals its eager decode, and every compiled catch-up is padded to a power of two (a shape per bucket,
    not per length)."""
    import griffin.engine

    target, twin, draft = models
    widths, catch_up = {}, griffin.engine.catch_up_rows

    def recording(draft, cache, features, tokens, counts, compiled=False):
        widths.setdefault(compiled, []).append(tokens.shape[1])
        return catch_up(draft, cache, features, tokens, counts, compiled)

    monkeypatch.setattr(griffin.engine, "catch_up_rows", recording)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 30, 47)]
    policy = SpeculationPolicy({1: TREE, 3: None})

    def decode(t):
        requests = [
            DecodeRequest(p, SamplingConfig(temperature=0.8), 12 + 16 * i, i, [], i != 1) for i, p in enumerate(prompts)
        ]  # budgets 12, 28, 44: plain rounds while three decode, then the tree
        return [r.tokens for r in generate_batch(t, draft, requests, policy)]

    assert decode(twin) == decode(target)
    assert widths[True] and all(w & (w - 1) == 0 for w in widths[True]), widths[True]
    assert any(w & (w - 1) for w in widths[False])  # eager catch-ups are not padded


@pytest.mark.parametrize("models", ["llama"], indirect=True)
def test_the_compiled_draft_cache_holds_a_padded_catch_up_after_any_row(models):
    """A compiled catch-up pads every row's pending run to the longest one's power of two and writes
    it after each row's length: with a context that is not a power of two (300), a row near the end
    of the context beside a new row's whole prompt still fits the draft cache."""
    from griffin.engine import BatchEngine
    from griffin.static import length_bucket

    _, twin, draft = models
    twin.context_cap = 300
    try:
        engine = BatchEngine(twin, draft, SpeculationPolicy({1: TREE}), max_rows=2)
        capacity = engine.cache.capacity
        assert engine.draft_cache.capacity >= capacity + length_bucket(capacity) > 2 * capacity
    finally:
        twin.context_cap = None


@pytest.mark.parametrize("models", ["llama"], indirect=True)
def test_warm_up_captures_before_the_timed_decode(models):
    """After warm_up, graphs have been compiled for these models (since the fixture's dynamo reset: by
    warm_up or this module's earlier decodes), and a lone decode, speculative and vanilla, reuses the
    warmed engine and compiles nothing new."""
    _, twin, draft = models
    policy = SpeculationPolicy({1: TREE})
    warm_up(twin, draft, policy)
    graphs = compiled_graphs()
    assert graphs > GRAPHS_AT_RESET["llama"]  # the decode steps are compiled: "nothing new" means something
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    speculative_generate(twin, draft, ids, TREE, SamplingConfig(), 100, stop_token_ids=[])
    vanilla_generate(twin, ids, SamplingConfig(), 100, stop_token_ids=[])
    assert compiled_graphs() == graphs


def test_a_prepacked_target_is_not_compiled():
    """Inductor cannot lower PackedLinear's oneDNN op (and packs weights itself): refused by name."""
    target = make_target("llama")
    if not target.prepack():
        pytest.skip("no oneDNN packing on this machine")
    with pytest.raises(ValueError, match="pre-packed"):
        TargetAdapter(target.model, name="twin").compile_decoding()


@pytest.mark.parametrize("models", ["llama"], indirect=True)
def test_offline_decodes_reuse_one_engine_per_draft(models):
    """Compiled: one pooled engine per draft (its KV buffers hold the captured graphs' addresses),
    reused with each call's policy, replaced when a call needs more rows; in use, a fresh one."""
    from griffin.offline import engine_for

    _, twin, draft = models
    twin.__dict__.pop("idle_engines", None)  # earlier tests' engines
    with engine_for(twin, draft, SpeculationPolicy({1: TREE}), 1) as first:
        pass
    with engine_for(twin, draft, SpeculationPolicy({1: None}), 1) as again:
        assert again is first and again.policy.trees == {1: None}
    with engine_for(twin, draft, SpeculationPolicy({1: TREE}), 3) as larger:
        assert larger is not first and larger.max_rows == 3
    with engine_for(twin, draft, SpeculationPolicy({1: TREE}), 2) as held:
        assert held is larger
        with engine_for(twin, draft, SpeculationPolicy({1: TREE}), 2) as other:
            assert other is not held
