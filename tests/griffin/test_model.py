"""Draft model: cached == uncached, harmonized attention, variants, reduced vocabulary."""

import pytest
import torch

from griffin.model import GriffinDraft, KVCache, count_trainable, harmonized_mask
from tests.conftest import make_target


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def causal(start, T):
    return torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]


@pytest.mark.parametrize("variant", ["griffin", "eagle"])
def test_cached_step_equals_uncached_forward(target, variant):
    draft = GriffinDraft.for_target(target, variant=variant).eval()
    feats, tokens = torch.randn(1, 11, 64), torch.randint(0, 128, (1, 11))
    full_p, full_r = draft([feats], tokens)
    cache, outs = KVCache.allocate(draft.cfg, 32), []
    for lo, hi in [(0, 4), (4, 5), (5, 11)]:  # chunks of different sizes
        p, r = draft.step(feats[:, lo:hi], tokens[:, lo:hi], torch.arange(lo, hi), cache, causal(lo, hi - lo))
        outs.append((p, r))
    assert torch.allclose(torch.cat([o[0] for o in outs], 1), full_p, atol=1e-5)
    assert torch.allclose(torch.cat([o[1] for o in outs], 1), full_r, atol=1e-5)
    assert cache.length == 11


def test_harmonized_mask_hand_built():
    """T=4, pass 3: row r sees stream0 cols <= r-2, stream1 col r-1, stream2 col r (docs/method.md §3.2)."""
    m = harmonized_mask(4, 3).int()
    expected = torch.tensor(
        [
            # stream 0     stream 1      stream 2
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
            [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(m, expected)
    assert torch.equal(harmonized_mask(3, 1), causal(0, 3))


@pytest.mark.parametrize("passes", [2, 3])
def test_harmonized_pass_equals_decode_time_draft_kv(target, passes):
    """Row r of pass j == a cached decode whose KV is the true context up to r-j+1 followed by one
    draft-stream entry per later step: what the draft holds after j-1 autoregressive steps."""
    draft = GriffinDraft.for_target(target).eval()
    T = 7
    streams = [torch.randn(1, T, 64) for _ in range(passes)]
    tokens = torch.randint(0, 128, (1, T))
    P, R = draft(streams, tokens)
    for r in range(passes - 1, T):
        cache, n_true = KVCache.allocate(draft.cfg, 32), r - passes + 2
        draft.step(streams[0][:, :n_true], tokens[:, :n_true], torch.arange(n_true), cache, causal(0, n_true))
        for k in range(1, passes):
            col = r - passes + 1 + k
            p, rr = draft.step(
                streams[k][:, col : col + 1],
                tokens[:, col : col + 1],
                torch.tensor([col]),
                cache,
                torch.ones(1, cache.length + 1, dtype=torch.bool),
            )
        assert torch.allclose(p[0, 0], P[0, r], atol=1e-5) and torch.allclose(rr[0, 0], R[0, r], atol=1e-5)


def test_padding_mask_does_not_change_real_rows(target):
    draft = GriffinDraft.for_target(target).eval()
    feats, tokens = torch.randn(1, 6, 64), torch.randint(0, 128, (1, 6))
    p_short, _ = draft([feats[:, :4]] * 2, tokens[:, :4])
    p_pad, _ = draft([feats] * 2, tokens, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert torch.allclose(p_pad[:, :4], p_short, atol=1e-5) and torch.isfinite(p_pad).all()


def test_variants_and_teh_split(target):
    griffin, eagle = GriffinDraft.for_target(target, "griffin"), GriffinDraft.for_target(target, "eagle")
    assert griffin.layer.mlp.down_proj.out_features == 128 and eagle.layer.mlp.down_proj.out_features == 64
    assert hasattr(griffin.fusion, "up_proj") and not hasattr(eagle.fusion, "up_proj")
    P, R = eagle([torch.randn(1, 3, 64)], torch.randint(0, 128, (1, 3)))
    assert torch.equal(P, R)  # one output serves both roles without TEH
    P, R = griffin([torch.randn(1, 3, 64)], torch.randint(0, 128, (1, 3)))
    assert not torch.equal(P, R)


def test_frozen_target_weights_are_shared_not_trained(target):
    draft = GriffinDraft.for_target(target)
    assert draft.embed_weight.data_ptr() == target.embed_weight.data_ptr()
    assert draft.head_weight.data_ptr() == target.head_weight.data_ptr()
    assert not any(k in draft.state_dict() for k in ("embed_weight", "head_weight"))
    assert count_trainable(draft) == sum(p.numel() for p in draft.parameters())


def test_reduced_vocabulary_maps_ids(target):
    d2t = torch.tensor([5, 7, 2, 100])
    draft = GriffinDraft.for_target(target, d2t=d2t)
    assert draft.cfg.draft_vocab_size == 4
    assert torch.equal(draft.head_weight, target.head_weight[d2t])
    assert draft.to_target_ids(torch.tensor([3, 0])).tolist() == [100, 5]
    assert draft.to_draft_ids(torch.tensor([100, 6, 2])).tolist() == [3, -1, 2]
    assert draft.logits(torch.randn(2, 64)).shape == (2, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_draft_started_from_a_target_layer_computes_that_layer(arch):
    """draft.init_layer: on an RMS-normalised input the draft's attention equals the target layer's
    after its input norm (grouped K/V heads repeated, the norm's scale folded into Q/K/V), and with TEH
    both halves of the MLP are the target's."""
    target = make_target(arch)
    layer = target.backbone.layers[-1]
    assert layer.self_attn.k_proj.weight.shape[0] < layer.self_attn.q_proj.weight.shape[0]  # grouped K/V
    if arch == "qwen2":  # the draft's projections have no biases: compare the bias-free computation
        with torch.no_grad():
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)  # a scale that is not all ones
    draft = GriffinDraft.for_target(target)
    draft.start_from_target_layer(layer)
    x, positions = torch.randn(1, 7, 64), torch.arange(7)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.hf_config.rms_norm_eps)  # RMS 1
    rope = draft.rope(positions, torch.float32)
    with torch.no_grad():
        ours = draft.layer.self_attn(x, x, rope, rope, causal(0, 7))
        theirs = layer.self_attn(
            hidden_states=layer.input_layernorm(x),
            position_embeddings=target.backbone.rotary_emb(x, positions[None]),
            attention_mask=None,
        )[0]  # no mask: HF's SDPA path is causal
        normed = draft.layer.post_attention_layernorm(x)
        prediction, regression = draft.layer.mlp(normed).split(64, dim=-1)
        expected = layer.mlp(layer.post_attention_layernorm(x))
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(prediction, expected, atol=1e-5) and torch.allclose(regression, expected, atol=1e-5)


def test_draft_init_layer_is_checked_before_training_starts(tiny_llama):
    from pipeline.config import load_config
    from pipeline.train.driver import _checked_init
    from pipeline.train.worker import _init_draft
    from tests.conftest import REPO

    tiny = REPO / "jobs" / "configs" / "tiny.yaml"
    cfg = load_config(tiny, ["draft.init_layer=-2"])
    assert _checked_init(cfg, tiny_llama) is None
    draft = _init_draft(cfg, tiny_llama, None, None)  # what each training worker builds
    assert torch.equal(draft.layer.mlp.up_proj.weight, tiny_llama.backbone.layers[0].mlp.up_proj.weight.float())
    for overrides, message in [
        (["draft.init_layer=2"], "the target has 2 decoder layers"),
        (["draft.init_layer=0", "draft.variant=eagle3"], "EAGLE-3's attention reads"),
        (["draft.init_layer=0", "train.init_from=x"], "keep one"),
    ]:
        with pytest.raises(ValueError, match=message):
            _checked_init(load_config(tiny, overrides), tiny_llama)
