"""Target adapter: post-norm features, tree verification in one pass, KV compaction."""

import pytest
import torch

from griffin.model import GriffinDraft
from griffin.target import PackedLinear, prepack_supported
from tests.conftest import make_target, tree_forward
from tests.griffin.test_verify import hand_tree

PROMPT = torch.tensor([[3, 17, 42, 9, 77]])


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2"])
def test_prefill_features_are_post_norm_last_hidden_state(arch):
    target = make_target(arch)
    features, logits = target.forward(PROMPT, target.new_cache(16))
    ref = target.model(PROMPT, output_hidden_states=True)
    assert torch.allclose(features, ref.hidden_states[-1], atol=1e-5)
    assert torch.allclose(logits, ref.logits, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_verify_equals_each_path_separately(arch):
    target = make_target(arch)
    tree = hand_tree()  # 7 nodes, root token 4, depth 2
    tree.tokens[:] = torch.tensor([11, 20, 21, 22, 30, 31, 40])
    cache = target.new_cache(32)
    target.forward(PROMPT, cache)
    feats, logits = tree_forward(target, cache, tree.tokens, tree.depths, tree.mask)
    for path in tree.retrieve.tolist():
        path = [n for n in path if n >= 0]
        seq = torch.cat([PROMPT, tree.tokens[path][None]], dim=1)
        ref = target.model(seq, output_hidden_states=True)
        assert torch.allclose(logits[0, path], ref.logits[0, PROMPT.shape[1] :], atol=1e-4)
        assert torch.allclose(feats[0, path], ref.hidden_states[-1][0, PROMPT.shape[1] :], atol=1e-5)


def test_cache_overflow_is_an_error():
    target = make_target("llama")
    with pytest.raises(RuntimeError, match="overflow"):
        target.forward(PROMPT, target.new_cache(3))


def test_tied_head_is_the_embedding():
    target = make_target("llama-tied")
    assert target.head_weight.data_ptr() == target.embed_weight.data_ptr()


# (dtype, tolerance): fp32 packs everywhere oneDNN is built in; bf16 only where the CPU runs it natively
PACKED_DTYPES = [
    pytest.param(torch.float32, 1e-4, id="fp32"),
    pytest.param(
        torch.bfloat16,
        0.05,
        id="bf16",
        marks=pytest.mark.skipif(
            not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU"
        ),
    ),
]


@pytest.mark.parametrize("dtype,atol", PACKED_DTYPES)
def test_prepacked_target_and_draft_match_unpacked(dtype, atol):
    """Pre-packed oneDNN linears compute the same function: prefill and tree-verify logits, the
    weights the draft and the tied head read, and the draft's logits all agree with plain weights."""
    plain, packed = make_target("llama-tied"), make_target("llama-tied")
    plain.model.to(dtype), packed.model.to(dtype)
    assert packed.prepack() and isinstance(packed.lm_head, PackedLinear)
    assert packed.head_weight.data_ptr() == packed.embed_weight.data_ptr()  # still tied, same tensor
    assert packed.weights_sha256 == plain.weights_sha256  # taken before the plain copies were released
    body = [m for m in packed.model.modules() if isinstance(m, PackedLinear) and m is not packed.lm_head]
    assert len(body) == 7 * packed.hf_config.num_hidden_layers and all(m.weight is None for m in body)
    ids = torch.randint(3, 128, (1, 9))
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    outs = []
    for target in (plain, packed):
        cache = target.new_cache(32)
        _, prefill = target.forward(ids, cache)
        _, verify = tree_forward(target, cache, torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1]), tree_mask)
        _, step = target.forward(torch.tensor([[8]]), cache)  # batch 1: the decode step's GEMV
        outs.append((prefill, verify, step))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=atol, rtol=0.02)
    draft = GriffinDraft.for_target(packed).cast_parameters(dtype)
    prediction = torch.randn(1, 3, packed.hidden_size, dtype=dtype)
    before = draft.logits(prediction)
    assert draft.prepack()
    torch.testing.assert_close(draft.logits(prediction), before, atol=atol, rtol=0.02)
    assert "packed_head" not in dict(draft.named_modules()) and set(draft.state_dict()) == set(
        GriffinDraft.for_target(plain).state_dict()
    )


def test_prepack_is_a_no_op_in_fp16():
    target = make_target("llama")
    target.model.to(torch.float16)
    assert not target.prepack() and isinstance(target.lm_head, torch.nn.Linear)
