"""Losslessness of the decode loop: speculative == vanilla == HF generate at T=0 (the T>0 law: test_verify.py
and test_engine_law.py)."""

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
    from griffin.replay import decode_reference, replay_decode
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
    replay_decode(draft, decode_reference(target, ids, 4, lookahead=tree.depth, stop_token_ids=[]), tree)
    assert len(entered) > steps + 1 and set(entered) == {"cpu"}  # the reference's vanilla decode, then the replay
