"""EAGLE-3 and GRIFFIN-3 drafts: multi-layer target features, EAGLE-3's layer input and trainable
head, training-time test without the feature loss, lossless decoding, and the store's layers column."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from griffin.config import DraftConfig, SamplingConfig, StagePlan, TrainConfig, TreeConfig, default_feature_layers
from griffin.decode import speculative_generate, vanilla_generate
from griffin.losses import shift_batch, token_alignable_step
from griffin.model import GriffinDraft, KVCache
from griffin.target import layer_features
from tests.conftest import make_target

MULTI = ["eagle3", "griffin3"]


@pytest.fixture(scope="module")
def target():
    return make_target("llama", num_hidden_layers=5)  # layers 2, L/2, L-3 -> (2,) distinct from the last


def causal(start, T):
    return torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]


def test_default_layers_and_variant_configs():
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2-135M: low, mid, high
    assert default_feature_layers(32) == (2, 16, 29)  # LLaMA-3-8B, EAGLE-3's choice
    assert default_feature_layers(2) == (1, 2)  # kept inside the target
    hf = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=30,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    eagle3, griffin3 = DraftConfig.from_target(hf, "eagle3"), DraftConfig.from_target(hf, "griffin3")
    assert eagle3.feature_layers == griffin3.feature_layers == (2, 15, 27) and eagle3.input_feature_size == 192
    assert eagle3.decoder_input == "concat" and not eagle3.token_guided_fusion and not eagle3.token_enhanced_head
    assert griffin3.decoder_input == "fused" and griffin3.token_guided_fusion and griffin3.token_enhanced_head
    assert eagle3.trainable_head and griffin3.trainable_head and not DraftConfig.from_target(hf).trainable_head
    with pytest.raises(ValueError, match="no fusion for TGF"):
        DraftConfig.from_target(hf, "griffin", decoder_input="concat")
    with pytest.raises(ValueError, match="distinct"):
        DraftConfig.from_target(hf, "eagle3", feature_layers=(3, 3))


def test_stage_plans_drop_the_feature_loss():
    eagle3, griffin3 = StagePlan.for_stage(3, "eagle3", 10), StagePlan.for_stage(3, "griffin3", 10)
    assert not eagle3.feature_loss and not eagle3.topk_loss and not eagle3.alignment_mask and eagle3.passes == 3
    assert not griffin3.feature_loss and griffin3.topk_loss and griffin3.alignment_mask
    assert StagePlan.for_stage(1, "griffin", 10).feature_loss


def test_target_layer_features_are_the_hidden_states(target):
    """Index i is the output of layer i (0 the embeddings), as HF's hidden_states and EAGLE-3 number them."""
    ids = torch.randint(3, 128, (1, 9))
    layers = (0, 2, 4)
    features, logits = target.forward(ids, target.new_cache(16), feature_layers=layers)  # (1, 9, 3*64)
    reference = target.model(ids, output_hidden_states=True)
    assert features.shape == (1, 9, 3 * 64)
    for k, i in enumerate(layers):
        torch.testing.assert_close(features[..., 64 * k : 64 * (k + 1)], reference.hidden_states[i])
    torch.testing.assert_close(logits, reference.logits)
    last, _ = target.forward(ids, target.new_cache(16))
    torch.testing.assert_close(last, reference.hidden_states[-1])  # no layers: the final post-norm feature


@pytest.mark.parametrize("variant", MULTI)
def test_cached_step_equals_uncached_forward(target, variant):
    draft = GriffinDraft.for_target(target, variant=variant).eval()
    layers = torch.randn(1, 11, draft.cfg.input_feature_size)
    tokens = torch.randint(0, 128, (1, 11))
    full_p, full_r = draft([layers], tokens)
    cache, outs = KVCache.allocate(draft.cfg, 32), []
    for lo, hi in [(0, 4), (4, 5), (5, 11)]:
        outs.append(
            draft.step(
                draft.fuse_target(layers[:, lo:hi]), tokens[:, lo:hi], torch.arange(lo, hi), cache, causal(lo, hi - lo)
            )
        )
    torch.testing.assert_close(torch.cat([p for p, _ in outs], 1), full_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r for _, r in outs], 1), full_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", MULTI)
def test_unrolled_training_step_equals_decode_time_draft_kv(target, variant):
    """Training-time test: pass 3 at row r == a decode whose KV holds the target's (fused) features up
    to r-2 and then the draft's own two outputs, exactly what the draft sees two levels deep."""
    draft = GriffinDraft.for_target(target, variant=variant).eval()
    T, passes = 7, 3
    layers = torch.randn(1, T, draft.cfg.input_feature_size)
    own = [torch.randn(1, T, 64) for _ in range(passes - 1)]  # stand-ins for the draft's regressed features
    tokens = torch.randint(0, 128, (1, T))
    P, R = draft([layers, *own], tokens)
    for r in range(passes - 1, T):
        cache, n_true = KVCache.allocate(draft.cfg, 32), r - passes + 2
        draft.step(
            draft.fuse_target(layers[:, :n_true]), tokens[:, :n_true], torch.arange(n_true), cache, causal(0, n_true)
        )
        for k in range(1, passes):
            col = r - passes + 1 + k
            p, rr = draft.step(
                own[k - 1][:, col : col + 1],
                tokens[:, col : col + 1],
                torch.tensor([col]),
                cache,
                torch.ones(1, cache.length + 1, dtype=torch.bool),
            )
        torch.testing.assert_close(p[0, 0], P[0, r], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rr[0, 0], R[0, r], atol=1e-5, rtol=1e-5)


def test_trainable_head_starts_as_the_targets_head(target):
    """Initialised from the target's rows (through d2t) and its final norm: on any hidden state the
    draft's head gives the target's logits over the draft vocabulary."""
    d2t = torch.arange(0, 128, 2)
    draft = GriffinDraft.for_target(target, variant="eagle3", d2t=d2t)
    hidden = torch.randn(3, 64)
    expected = target.lm_head(target.backbone.norm(hidden))[:, d2t]
    torch.testing.assert_close(draft.logits(hidden), expected, atol=1e-5, rtol=1e-5)
    assert draft.lm_head.weight.requires_grad and not draft.head_weight.requires_grad
    # the teacher is still the frozen target head over the (final) target feature
    torch.testing.assert_close(draft.target_logits(hidden), hidden @ target.head_weight[d2t].T)


@pytest.mark.parametrize("variant", MULTI)
@pytest.mark.parametrize(
    "tree",
    [TreeConfig(total_tokens=8, depth=3, top_k=3), TreeConfig(total_tokens=4, depth=3, top_k=1)],
    ids=["tree", "chain"],
)
def test_greedy_equals_vanilla(target, variant, tree):
    """Lossless at T=0, exactly in fp32, with a random draft and with one trained to agree more."""
    torch.manual_seed(1)
    draft = GriffinDraft.for_target(target, variant=variant, d2t=torch.arange(0, 128, 2)).eval()
    for seed in range(3):
        prompt = torch.randint(3, 128, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        ours = speculative_generate(target, draft, prompt, tree, SamplingConfig(), 24, stop_token_ids=[])
        assert ours.tokens == vanilla_generate(target, prompt, SamplingConfig(), 24, stop_token_ids=[]).tokens


def tiny_batch(target, draft, T=24):
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, T))
    out = target.backbone(input_ids=ids, output_hidden_states=list(draft.cfg.feature_layers))
    mask = torch.ones(2, T)
    mask[:, :4] = 0
    return shift_batch(out.last_hidden_state, ids, mask, layer_features=layer_features(out, draft.cfg.feature_layers))


@pytest.mark.parametrize("variant,stage", [("eagle3", 1), ("eagle3", 3), ("griffin3", 3)])
def test_training_time_test_learns_without_a_feature_loss(target, variant, stage):
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(target, variant=variant)
    batch = tiny_batch(target, draft)
    assert batch.features.shape[-1] == draft.cfg.input_feature_size  # the input: the k layers
    plan, cfg = StagePlan.for_stage(stage, variant, 30), TrainConfig(noise_scale=0.0)
    # the token loss is a cross-entropy to the target: its floor is the teacher's entropy, so watch the KL
    teacher = torch.softmax(draft.target_logits(batch.target_features).float(), -1)  # (B, T, V)
    entropy = float((-(teacher * teacher.log()).sum(-1) * batch.loss_mask).sum() / batch.loss_mask.sum())
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        opt.zero_grad()
        metrics = token_alignable_step(draft, batch, cfg, plan)
        opt.step()
        first = first or metrics
    assert metrics["token_1"] - entropy < 0.5 * (first["token_1"] - entropy)
    topk = cfg.topk_weight * first["topk_1"] if plan.topk_loss else 0.0  # GRIFFIN-3 keeps HASS's top-k loss
    assert first["loss_1"] == pytest.approx(first["token_1"] + topk)  # no regression term
    assert "value" not in metrics and "value_1" not in metrics  # nor a curve of it
    assert draft.feature_fc.weight.grad is not None and draft.lm_head.weight.grad is not None


@pytest.mark.parametrize("variant", MULTI)
def test_save_and_load_round_trip(target, variant, tmp_path):
    from griffin.checkpoint import load_draft, save_draft

    draft = GriffinDraft.for_target(target, variant=variant, d2t=torch.arange(0, 128, 2))
    torch.nn.init.normal_(draft.feature_fc.weight)
    save_draft(draft, tmp_path / "d")
    back = load_draft(tmp_path / "d", target)
    assert back.cfg == draft.cfg
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name
    shallow = make_target("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="feature_layers"):
        load_draft(tmp_path / "d", shallow)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_store_layers_column_round_trip(tmp_path, dtype):
    """The layers column (T, k, H) goes through the codec like ``hidden``; readers that do not ask for
    it never read it, and a version-1 part (no such column) reads as before."""
    import pipeline.data.store as st

    T, k, H = 7, 3, 16
    hidden, stacked = torch.randn(T, H), torch.randn(T, k, H) * torch.tensor([0.1, 1.0, 30.0])[None, :, None]
    data, scales = st.encode_hidden(hidden, dtype)
    layers, layer_scales = st.encode_hidden(stacked.reshape(-1, H), dtype)
    rows = {
        "sample_id": np.array(["a"]),
        "input_ids": [np.arange(T)],
        "loss_mask": [np.ones(T, np.uint8)],
        "hidden": [data],
        "scales": [scales],
        "layers": [layers],
        "layer_scales": [layer_scales],
    }
    st.write_part(str(tmp_path / "v2"), "part-0.parquet", st.part_table(rows, dtype, H, layers=(2, 5, 9)))
    (row,) = st.iter_rows([str(tmp_path / "v2" / "part-0.parquet")], layers=True)
    decoded = st.decode_row(row, H, layers=True)
    tolerance = dict(atol=1e-2, rtol=1.6e-2) if dtype == "bf16" else dict(atol=0.0, rtol=0.13)
    torch.testing.assert_close(decoded["layers"].float(), stacked.reshape(T, k * H), **tolerance)
    (plain,) = st.iter_rows([str(tmp_path / "v2" / "part-0.parquet")])
    assert plain["layers"] is None  # not read without layers=True
    del rows["layers"], rows["layer_scales"]
    st.write_part(str(tmp_path / "v1"), "part-0.parquet", st.part_table(rows, dtype, H))
    (old,) = st.iter_rows([str(tmp_path / "v1" / "part-0.parquet")], layers=True)
    torch.testing.assert_close(st.decode_row(old, H)["hidden"], decoded["hidden"])
    with pytest.raises(ValueError, match="no feature layers"):
        st.decode_row(old, H, layers=True)


CONVERSATIONS = [
    {
        "conversations": [
            {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)},
        ]
    }
    for i in range(24)
]


def test_featurize_stores_the_layers_and_train_refuses_a_store_without_them(tmp_path, ray_local):
    """Through Ray Data, `draft.variant=eagle3` stores layers 1, 2 of the tiny target beside the final
    feature, equal to its hidden states; a multi-layer draft refuses a store without its layers by name.
    (tests/test_e2e.py trains, registers and serves an EAGLE-3 draft with `griffin run`.)"""
    import json

    from pipeline.config import load_config
    from pipeline.data.featurize import run_featurize
    from pipeline.resources.targets import load_target
    from pipeline.data.store import decode_row, iter_rows, part_files, read_manifest
    from pipeline.train.driver import _check_store_layers

    data = tmp_path / "conversations.json"
    data.write_text(json.dumps(CONVERSATIONS))
    cfg = load_config(
        "jobs/configs/tiny.yaml",
        [f"output_dir={tmp_path}", f"data.source={data}", "data.limit=null", "draft.variant=eagle3", "run_name=e3"],
    )
    run_featurize(cfg)
    manifest = read_manifest(cfg.store_path)
    assert manifest["capture_key"]["feature_layers"] == [1, 2]
    target = load_target(cfg.target)
    for row in iter_rows(part_files(cfg.store_path), layers=True):
        decoded = decode_row(row, target.hidden_size, layers=True)
        with torch.inference_mode():
            states = target.model(decoded["input_ids"][None], output_hidden_states=True).hidden_states
        expected = torch.cat([states[1][0], states[2][0]], -1)  # (T, 2D) fp32
        # the store rounds to bf16 (at most half an ulp, 2^-9 relative); featurize runs padded batches,
        # whose fp32 sums may differ in the last bits from this single row's, so allow one ulp (2^-8)
        torch.testing.assert_close(decoded["layers"].float(), expected, atol=1e-6, rtol=2**-8)
    _check_store_layers(cfg, target, manifest)  # the store holds the draft's layers: accepted
    final_only = {
        **manifest,
        "capture_key": {k: v for k, v in manifest["capture_key"].items() if k != "feature_layers"},
    }
    with pytest.raises(ValueError, match=r"reads target layers \[1, 2\].*only the final feature.*features.layers"):
        _check_store_layers(cfg, target, final_only)
    griffin = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", "run_name=e3"])
    _check_store_layers(griffin, target, final_only)  # GRIFFIN reads the final feature of any store
