"""The family matrix: every family griffin.families accepts decodes losslessly, and the others are refused.

Each supported family is built as a tiny random fp32 model from its transformers config (no downloads),
with sliding windows (where it has them) of WINDOW tokens, far shorter than the prompts and outputs, so
every windowed layer's verify mask cuts the prefix and, with an oracle draft's long chains, the tree
itself. T=0 output must equal HF greedy ``generate`` token for token: alone and batched (rows of
different lengths, a row joining mid-flight), GRIFFIN and EAGLE-3 drafts, several tree shapes, plain
rounds. The T>0 law is checked on two windowed families, featurize + a training step of every variant
and the export round trip on each. Compiled == eager with a windowed layer: tests/griffin/test_compiled.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from griffin.config import SamplingConfig, TrainConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.offline import generate_batch
from griffin.families import FAMILIES, SLIDING, AttentionLayout, UnsupportedTarget
from griffin.model import GriffinDraft
from griffin.target import TargetAdapter
from tests.conftest import OracleDraft

WINDOW = 3
GREEDY = SamplingConfig()
CHAIN = TreeConfig(total_tokens=6, depth=6, top_k=1)  # deeper than the window: the tree itself is cut
SMALL = TreeConfig(total_tokens=12, depth=4, top_k=3)
# deeper than the window and wide: an accepted node's ancestors sit at columns past their positions
DEEP = TreeConfig(total_tokens=20, depth=7, top_k=2)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
MOE = dict(num_experts_per_tok=2)
# model_type -> config fields on top of BASE: windows (mixed with full layers where the family allows),
# experts, and what else distinguishes the family
CASES = {
    "llama": dict(
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )
    ),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    "olmo2": {},
    "olmoe": dict(num_experts=4, **MOE),
    "gemma": dict(head_dim=16),
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW, num_local_experts=4, **MOE),
    "phi3": dict(sliding_window=WINDOW),
    "starcoder2": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen2_moe": dict(
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **MOE,
    ),
    "qwen3": dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3_moe": dict(
        head_dim=16, use_sliding_window=True, sliding_window=WINDOW, num_experts=4, moe_intermediate_size=32, **MOE
    ),
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),
    "gemma2": dict(head_dim=16, sliding_window=WINDOW),
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, layer_types=MIXED),
    "cohere2": dict(sliding_window=WINDOW),
    "gpt_oss": dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, **MOE),
    "ministral": dict(head_dim=16, sliding_window=WINDOW, layer_types=MIXED),
    "olmo3": dict(sliding_window=WINDOW),
    "exaone4": dict(head_dim=16, sliding_window=WINDOW),
    "phimoe": dict(sliding_window=WINDOW, num_local_experts=4, **MOE),
    "granitemoe": dict(num_local_experts=4, **MOE),
    "granitemoeshared": dict(num_local_experts=4, shared_intermediate_size=32, **MOE),
    "olmo": {},
    "cohere": {},
    "glm": dict(head_dim=16),
    "glm4": dict(head_dim=16),
    "stablelm": {},
    "helium": dict(head_dim=16),
    "seed_oss": dict(head_dim=16),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=2),
    "arcee": {},
    "apertus": {},
    "ernie4_5": {},
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "nemotron": dict(head_dim=16),
    "jetmoe": {},
    "vaultgemma": dict(head_dim=16, sliding_window=WINDOW),
    "deepseek_v2": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        **MOE,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        **MOE,
    ),
}
WINDOWED = [t for t, fields in CASES.items() if "sliding_window" in fields]


def build(model_type: str, seed: int = 0, **extra) -> TargetAdapter:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**BASE, **CASES[model_type], **extra})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=FAMILIES[model_type].attn_implementation)
    model = model.float()
    return TargetAdapter(model, name=f"tiny-{model_type}")


def hf_greedy(target: TargetAdapter, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in (13, 7, 18)[:count]]


def test_every_case_is_a_supported_family_and_windowed_cases_have_windows():
    assert set(CASES) == set(FAMILIES), "each supported family runs the matrix"
    for model_type in WINDOWED:
        layout = AttentionLayout.of(AutoConfig.for_model(model_type, **{**BASE, **CASES[model_type]}))
        assert SLIDING in layout.layer_kinds and layout.window == WINDOW, model_type


@pytest.mark.parametrize("model_type", list(CASES))
def test_greedy_equals_hf_alone_and_batched(model_type):
    """Untrained GRIFFIN and EAGLE-3 drafts (nearly everything rejected), an oracle draft (paths
    accepted deeper than the window, through a wide tree), plain rounds, and a batch of three through two slots: the third
    request joins mid-flight when the shortest one finishes."""
    target = build(model_type)
    torch.manual_seed(1)
    griffin, eagle3 = GriffinDraft.for_target(target), GriffinDraft.for_target(target, variant="eagle3")
    new = [6, 20, 20]
    cases = prompts(3)
    reference = [hf_greedy(target, p, n) for p, n in zip(cases, new)]
    for prompt, n, ref in zip(cases[1:], new[1:], reference[1:]):
        ids = torch.tensor([prompt])
        assert vanilla_generate(target, ids, GREEDY, n, stop_token_ids=[]).tokens == ref
        for draft, tree in ((griffin, SMALL), (griffin, CHAIN), (eagle3, SMALL)):
            assert speculative_generate(target, draft, ids, tree, GREEDY, n, stop_token_ids=[]).tokens == ref
        oracle = OracleDraft(target, prompt[0])
        spec = speculative_generate(target, oracle, ids, DEEP, GREEDY, n, stop_token_ids=[])
        assert spec.tokens == ref and max(spec.stats.accepted_per_round) >= WINDOW  # chains past the window
    for draft, policy in ((griffin, {1: SMALL}), (griffin, {1: SMALL, 2: None}), (None, {1: None})):
        requests = [DecodeRequest(p, GREEDY, n, stop_token_ids=[]) for p, n in zip(cases, new)]
        out = generate_batch(target, draft, requests, SpeculationPolicy(policy), max_rows=2)
        assert [r.tokens for r in out] == reference, (draft is not None, policy)


@pytest.mark.parametrize("model_type", ["gemma2", "qwen2"])
def test_sampling_law_with_windows(model_type):
    """Joint law of the first three sampled tokens == the target's (tests/griffin/law.py), with a
    window of 2 over a 4-token prompt: the verify passes see only the last tokens."""
    from tests.griffin.law import PASS_P, chi_square_p, engine_windows, exact_joint

    target = build(model_type, seed=7, vocab_size=6, sliding_window=2)
    with torch.no_grad():  # peaked, context-dependent laws: a verify pass that ignored the window would show
        target.lm_head.weight.mul_(10.0)
    draft = GriffinDraft.for_target(target)
    torch.nn.init.normal_(draft.layer.mlp.down_proj.weight, std=0.5)  # a confident, wrong-ish draft
    prompt, sampling, tree = [1, 4, 3, 5], SamplingConfig(temperature=1.0), TreeConfig(total_tokens=5, depth=2, top_k=2)
    counts = engine_windows(target, draft, prompt, tree, sampling, 1200, 3, batched=False)
    p_value = chi_square_p(counts, exact_joint(target, prompt, sampling, 3))
    assert p_value > PASS_P, f"chi-square p-value {p_value:.2e}"


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "gemma2", "qwen3_moe", "deepseek_v3"])
def test_featurize_then_train_every_variant(model_type):
    """The featurizer's forward (right-padded batch, EAGLE-3's layer capture) on MoE and windowed
    targets, then one training step of each variant on what it produced."""
    from griffin.config import StagePlan
    from griffin.losses import shift_batch, token_alignable_step
    from pipeline.data.featurize import Featurizer

    tiny = {"model_type": model_type, **{k: v for k, v in {**BASE, **CASES[model_type]}.items() if "token" not in k}}
    section = {"name": f"tiny-{model_type}", "dtype": "float32", "tiny": tiny}
    layers = GriffinDraft.for_target(build(model_type), variant="eagle3").cfg.feature_layers
    featurizer = Featurizer(section, layers=layers)
    sequences = [__import__("numpy").arange(3, 3 + n) for n in (20, 14)]
    features = featurizer.forward(sequences)
    alone = featurizer.forward(sequences[1:])[0][0]
    assert torch.allclose(features[1][0], alone, atol=1e-5)  # right padding changes nothing
    ids = torch.stack([torch.from_numpy(s[:14]) for s in sequences])
    final = torch.stack([f[:14] for f, _ in features])  # (2, 14, D)
    stacked = torch.stack([s[:14] for _, s in features]).flatten(2)  # (2, 14, k*D)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[:, :3] = 0
    for variant in ("griffin", "hass", "eagle", "eagle3", "griffin3"):
        torch.manual_seed(0)
        draft = GriffinDraft.for_target(featurizer.target, variant=variant)
        multi = draft.cfg.feature_layers is not None
        batch = shift_batch(final, ids, mask, layer_features=stacked if multi else None)
        metrics = token_alignable_step(draft, batch, TrainConfig(noise_scale=0.0), StagePlan.for_stage(3, variant, 4))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), (variant, metrics)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters()), variant


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma3_text", "mixtral", "cohere2", "deepseek_v3"])
def test_export_round_trip(model_type, tmp_path):
    """Each layout that can carry the draft of this family's target writes, reloads bit-exactly and
    binds to the target (export_draft checks both), and the reloaded draft decodes the same tokens."""
    from griffin.checkpoint import save_draft
    from griffin.export import export_draft, load_export

    target = build(model_type)
    prompt = torch.tensor([prompts(1)[0]])
    for variant, layouts in (("griffin", ["hf", "griffin-upstream"]), ("eagle3", ["speculators", "specforge"])):
        torch.manual_seed(2)
        draft = GriffinDraft.for_target(target, variant=variant)
        save_draft(draft, tmp_path / variant)
        before = speculative_generate(target, draft, prompt, SMALL, GREEDY, 12, stop_token_ids=[])
        for layout in layouts:
            out = export_draft(tmp_path / variant, tmp_path / f"{variant}-{layout}", layout, target)
            after = speculative_generate(target, load_export(out, target), prompt, SMALL, GREEDY, 12, stop_token_ids=[])
            assert after.tokens == before.tokens and after.stats.accepted_per_round == before.stats.accepted_per_round


REFUSALS = {
    "deepseek_v32": ("sparse attention", dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=16)),
    "llama4_text": ("chunked attention", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3_next": ("cannot be cut back", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "lfm2": ("cannot be cut back", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "gemma3": ("text-only", {}),
    "gpt2": ("not among the families", dict(n_embd=64, n_head=4, n_layer=2)),
}


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_unsupported_families_are_refused_at_load_by_name(model_type):
    why, fields = REFUSALS[model_type]
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, vocab_size=128, **fields)
    with pytest.raises(UnsupportedTarget, match=f"'{model_type}' is not supported: .*{why}.*Supported families: Llama"):
        AttentionLayout.of(config)
    if model_type in ("qwen3_next", "lfm2"):  # the model itself, as a user would hand it over
        with pytest.raises(UnsupportedTarget, match=model_type):
            TargetAdapter(AutoModelForCausalLM.from_config(config))


def test_flash_attention_is_refused():
    target = build("mistral")
    target.model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedTarget, match="ignores the tree mask.*sdpa"):
        TargetAdapter(target.model)


def test_latent_attention_with_grouped_kv_heads_is_refused():
    config = AutoConfig.for_model("deepseek_v3", **{**BASE, **CASES["deepseek_v3"], "num_key_value_heads": 2})
    with pytest.raises(UnsupportedTarget, match="'deepseek_v3' is not supported: num_key_value_heads=2 with 4"):
        AttentionLayout.of(config)


def test_a_layer_kind_outside_the_contract_is_refused():
    config = AutoConfig.for_model("qwen3", **{**BASE, **CASES["qwen3"]})
    config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(UnsupportedTarget, match=r"'qwen3' is not supported: layer kinds \['linear_attention'\]"):
        AttentionLayout.of(config)
