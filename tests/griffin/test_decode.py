"""Losslessness of the decode loop: speculative == vanilla == HF generate at T=0; T>0 matches the target."""

import pytest
import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.model import GriffinDraft
from tests.conftest import OracleDraft, make_target

GREEDY = SamplingConfig()
TREES = {
    "root-only": TreeConfig(total_tokens=1, depth=1, top_k=1),
    "chain": TreeConfig(total_tokens=6, depth=5, top_k=1),
    "small": TreeConfig(total_tokens=12, depth=3, top_k=4),
    "default-wide": TreeConfig(),  # 60 tokens, 6 levels, top-10
}


def hf_greedy(target, ids, max_new, stop):
    out = target.model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=stop or None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_equals_vanilla_and_hf_random_draft(arch, tree):
    """Untrained draft (almost all rejected): outputs still match token for token."""
    target = make_target(arch)
    draft = GriffinDraft.for_target(target, variant="griffin")
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(3, 128, (1, int(torch.randint(1, 20, (), generator=gen))), generator=gen)
        ref = vanilla_generate(target, ids, GREEDY, 24, stop_token_ids=[])
        spec = speculative_generate(target, draft, ids, TREES[tree], GREEDY, 24, stop_token_ids=[])
        assert spec.tokens == ref.tokens == hf_greedy(target, ids, 24, None)
        assert len(spec.tokens) == 24 and spec.finish_reason == "length"


@pytest.mark.parametrize("tree", ["chain", "small"])
def test_greedy_equals_vanilla_oracle_draft(tree):
    """A draft that agrees with the target: long acceptances, same output."""
    target = make_target("qwen2", seed=3)
    for seed in range(3):
        ids = torch.randint(3, 128, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        draft = OracleDraft(target, int(ids[0, 0]))
        ref = vanilla_generate(target, ids, GREEDY, 30, stop_token_ids=[])
        spec = speculative_generate(target, draft, ids, TREES[tree], GREEDY, 30, stop_token_ids=[])
        assert spec.tokens == ref.tokens
        if tree == "chain":  # every chain token is the target's own choice: all accepted
            assert spec.stats.acceptance_length > 5.0


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_boundaries(max_new):
    target = make_target("llama")
    ids = torch.tensor([[5, 9, 17, 33]])
    draft = OracleDraft(target, 5)
    ref = vanilla_generate(target, ids, GREEDY, max_new, stop_token_ids=[])
    spec = speculative_generate(target, draft, ids, TREES["chain"], GREEDY, max_new, stop_token_ids=[])
    assert spec.tokens == ref.tokens and len(spec.tokens) == max_new


def test_stop_tokens_mid_acceptance():
    """A stop token inside an accepted run ends generation right there (stop token kept)."""
    target = make_target("llama")
    ids = torch.tensor([[5, 9, 17, 33]])
    full = vanilla_generate(target, ids, GREEDY, 20, stop_token_ids=[]).tokens
    for stop_at in (0, 3, 8):
        stop = [full[stop_at]]
        first = full.index(stop[0])
        ref = vanilla_generate(target, ids, GREEDY, 20, stop_token_ids=stop)
        spec = speculative_generate(
            target, OracleDraft(target, 5), ids, TREES["chain"], GREEDY, 20, stop_token_ids=stop
        )
        assert spec.tokens == ref.tokens == full[: first + 1]
        assert spec.finish_reason == "stop"
        assert hf_greedy(target, ids, 20, stop) == full[: first + 1]


def test_default_stop_tokens_from_config():
    target = make_target("llama")
    assert target.stop_token_ids == [2]


def test_rejects_bad_requests():
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    with pytest.raises(ValueError, match="context window"):
        speculative_generate(target, draft, torch.ones(1, 500, dtype=torch.long), TreeConfig(), GREEDY, 100)
    with pytest.raises(ValueError, match="shape"):
        vanilla_generate(target, torch.ones(2, 3, dtype=torch.long), GREEDY, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        vanilla_generate(target, torch.ones(1, 3, dtype=torch.long), GREEDY, 0)


def _exact_joint(target, prompt, sampling):
    """P(first, second) of the target's own sampling: (V, V)."""
    from griffin.verify import warp_probs

    V = target.vocab_size
    with torch.no_grad():
        p1 = warp_probs(target.model(prompt).logits[0, -1], sampling)  # (V,)
        nxt = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)  # (V, T+1)
        p2 = warp_probs(target.model(nxt).logits[:, -1], sampling)  # (V, V)
    return p1[:, None] * p2


def chi_square_p(counts, probabilities, n):
    """p-value of observed ``counts`` against ``n`` draws from ``probabilities`` (same shape), cells
    expecting fewer than 5 draws pooled into one; a cell of probability 0 must never be drawn."""
    from scipy.stats import chisquare

    expected = probabilities.double().flatten() * n
    keep = expected > 5  # chi-square needs populated cells; the rest are pooled into one
    observed, expected = counts.double().flatten()[keep], expected[keep]
    pooled_observed, pooled_expected = counts.double().flatten()[~keep].sum(), n - expected.sum()
    if pooled_expected > 1e-9:
        observed = torch.cat([observed, pooled_observed[None]])
        expected = torch.cat([expected, pooled_expected[None]])
    else:  # tokens the warper removed must never be produced
        assert pooled_observed == 0
    expected = expected * (observed.sum() / expected.sum())  # float round-off: chisquare checks totals
    return chisquare(observed.double().numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize(
    "variant,sampling,n",
    [
        ("griffin", SamplingConfig(temperature=1.0), 2000),
        ("griffin", SamplingConfig(temperature=0.7, top_p=0.8), 2000),
        ("eagle3", SamplingConfig(temperature=1.0), 1000),
    ],
    ids=["T1", "T0.7-top_p", "eagle3-T1"],
)
def test_sampling_matches_target_end_to_end(variant, sampling, n):
    """Joint law of the first two sampled tokens (the second goes through tree verification) ==
    the target's, by a chi-square test over n seeded generations (the 20k-draw test of the
    verifier itself is in test_verify.py). EAGLE-3 reads the target's layer 2 (of 5)."""
    target = make_target("llama", vocab_size=8, seed=7, **({"num_hidden_layers": 5} if variant == "eagle3" else {}))
    draft = GriffinDraft.for_target(target, variant=variant)
    torch.nn.init.normal_(draft.layer.mlp.down_proj.weight, std=0.5)  # a confident, wrong-ish draft
    prompt, tree = torch.tensor([[1, 4, 3]]), TreeConfig(total_tokens=6, depth=3, top_k=3)
    counts = torch.zeros(8, 8)
    for seed in range(n):
        out = speculative_generate(
            target, draft, prompt, tree, sampling, 2, torch.Generator().manual_seed(seed), stop_token_ids=[]
        ).tokens
        counts[out[0], out[1]] += 1
    p_value = chi_square_p(counts, _exact_joint(target, prompt, sampling), n)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e}"


def test_on_tokens_streams_every_committed_token_once():
    target = make_target("llama")
    ids = torch.tensor([[5, 9, 17, 33]])
    chunks = []
    spec = speculative_generate(
        target, OracleDraft(target, 5), ids, TREES["chain"], GREEDY, 17, stop_token_ids=[], on_tokens=chunks.append
    )
    assert [t for c in chunks for t in c] == spec.tokens and len(chunks) == spec.stats.rounds + 1
    chunks.clear()
    ref = vanilla_generate(target, ids, GREEDY, 5, stop_token_ids=[], on_tokens=chunks.append)
    assert chunks == [[t] for t in ref.tokens]


def test_decodes_run_without_cudnn_attention_on_cuda(monkeypatch):
    """cuDNN's attention builds a graph per new shape, and every decode step is one: on CUDA the
    decode loops and tune-tree's replay run under ``decode_attention``, which leaves it out."""
    import griffin.engine
    import griffin.replay
    from griffin.replay import greedy_reference, replay_greedy
    from griffin.target import decode_attention

    with decode_attention(torch.device("cuda")):  # the flags are process-wide; no GPU needed to set them
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    with decode_attention("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing changes off CUDA

    entered = []

    def recording(device):
        entered.append(torch.device(device).type)
        return decode_attention(device)

    monkeypatch.setattr(griffin.engine, "decode_attention", recording)
    monkeypatch.setattr(griffin.replay, "decode_attention", recording)
    target = make_target("llama")
    draft = GriffinDraft.for_target(target)
    ids, tree = torch.randint(3, 128, (1, 8)), TREES["small"]
    vanilla_generate(target, ids, GREEDY, 4, stop_token_ids=[])
    speculative_generate(target, draft, ids, tree, GREEDY, 4, stop_token_ids=[])
    assert entered and set(entered) == {"cpu"}  # every engine step
    steps = len(entered)
    replay_greedy(draft, greedy_reference(target, ids, 4, lookahead=tree.depth, stop_token_ids=[]), tree)
    assert len(entered) > steps + 1 and set(entered) == {"cpu"}  # the reference's vanilla decode, then the replay
