"""The batching engine is lossless per request: concurrent rows decode exactly what each would alone."""

import pytest
import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.engine import BatchEngine
from griffin.policy import SpeculationPolicy, sampling_table
from griffin.request import DecodeRequest
from griffin.offline import generate_batch
from griffin.model import GriffinDraft
from griffin.rows import row_mask
from tests.conftest import OracleDraft, make_target, tree_forward
from tests.griffin.law import peaked_pair

GREEDY = SamplingConfig()
SMALL = TreeConfig(total_tokens=12, depth=3, top_k=4)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 128, (int(torch.randint(1, 24, (), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]


def _zero_past_lengths(cache) -> bool:
    """griffin.rows' invariant: every column at or past a row's length is zero."""
    return all(
        not tensors.keys[slot, :, length:].any() and not tensors.values[slot, :, length:].any()
        for tensors in cache.tensors
        for slot, length in enumerate(cache.slots.lengths)
    )


def test_row_mask_places_each_rows_block_after_its_prefix():
    block = torch.tensor([[[1, 0], [1, 1]], [[1, 0], [1, 1]]], dtype=torch.bool)
    mask = row_mask(torch.tensor([2, 0]), block, 5)
    assert mask.int().tolist() == [[[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_verify_equals_per_request_verify_with_poisoned_padding(arch):
    """Three rows of different prefix lengths verify different trees in one pass; each row's logits
    equal its own batch-1 verify. The slots' previous occupant left NaN keys behind: releasing a
    slot zeroes it, so no NaN reaches a neighbour through masked padding."""
    target = make_target(arch)
    prefixes = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 11, 7)]
    cache = target.new_row_cache(3, 64)
    for tensors in cache.tensors:  # a previous occupant's overflowed KV everywhere
        tensors.keys.fill_(float("nan"))
        tensors.values.fill_(float("nan"))
    for slot in range(3):
        cache.release(slot, slot)
    assert _zero_past_lengths(cache)
    for slot, prefix in enumerate(prefixes):
        starts, _ = cache.slots.begin(slot, slot + 1, prefix.numel())
        target.forward(prefix[None], cache, starts[:, None] + torch.arange(prefix.numel()), all_logits=False)
        cache.slots.lengths[slot] += prefix.numel()
    N = 5
    trees = [torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(40 + b)) for b in range(3)]
    chain = torch.ones(N, N, dtype=torch.bool).tril()
    blocks = torch.stack([chain, torch.eye(N, dtype=torch.bool), chain])  # (3, N, N): a chain, a fan, a chain
    depths = torch.stack([torch.arange(N), torch.zeros(N, dtype=torch.long), torch.arange(N)])
    starts, width = cache.slots.begin(0, 3, N)
    _, batched = target.forward(torch.stack(trees), cache, starts[:, None] + depths, row_mask(starts, blocks, width))
    assert torch.isfinite(batched).all()
    for b, prefix in enumerate(prefixes):
        alone = target.new_cache(32)
        target.forward(prefix[None], alone, all_logits=False)
        _, expected = tree_forward(target, alone, trees[b], depths[b], blocks[b])
        torch.testing.assert_close(batched[b], expected[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [SMALL, TreeConfig(), None], ids=["small", "wide", "plain"])
def test_concurrent_greedy_rows_equal_their_batch1_vanilla_output(arch, tree):
    target = make_target(arch)
    draft = GriffinDraft.for_target(target, variant="griffin")
    prompts = _prompts(5)
    results = generate_batch(
        target, draft, [DecodeRequest(p, GREEDY, 24, stop_token_ids=[]) for p in prompts], SpeculationPolicy({1: tree})
    )
    for prompt, result in zip(prompts, results):
        assert result.tokens == vanilla_generate(target, torch.tensor([prompt]), GREEDY, 24, stop_token_ids=[]).tokens


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)]
)
def test_a_seeded_request_decodes_the_same_text_however_it_is_decoded(sampling):
    """A request's token at output position i is a function of its seed, i and the target's law
    there: batched beside neighbours under a policy that switches trees and plain rounds with the
    load, alone with either of two trees, and plain (no draft), a seeded request decodes the same
    tokens (fp32). The target's laws are peaked over 6 tokens, so about half the drafted tokens
    are accepted (checked) and the walks go deep."""
    target, draft = peaked_pair()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 6, (n,), generator=gen).tolist() for n in (3, 9, 5, 14)]
    budget, wide = 30, TreeConfig(total_tokens=20, depth=5, top_k=3)
    requests = [DecodeRequest(p, sampling, budget, 11 + i, []) for i, p in enumerate(prompts)]
    policy = SpeculationPolicy({1: wide, 2: SMALL, 4: None})  # 4 rows: plain; 2-3: SMALL; the last one: wide
    batched = [r.tokens for r in generate_batch(target, draft, requests, policy, max_rows=3)]
    accepted = 0
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        alone = [speculative_generate(target, draft, ids, tree, sampling, budget, 11 + i, []) for tree in (SMALL, wide)]
        plain = vanilla_generate(target, ids, sampling, budget, 11 + i, []).tokens
        assert batched[i] == alone[0].tokens == alone[1].tokens == plain and len(plain) == budget
        accepted += sum(alone[1].stats.accepted_per_round)
    assert accepted >= len(prompts) * budget / 4


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)]
)
def test_a_draft_whose_law_is_the_targets_drafts_every_token_a_seeded_request_draws(sampling, monkeypatch):
    """At T>0 the draft runs the walk's race with the walk's draws (griffin.tree.DraftRace): a draft
    whose law is the target's (OracleDraft) holds the token the target draws at every level, so
    every round of a seeded decode accepts its whole chain, and the text is the plain seeded
    decode's. Ranked by its own law instead (a top-k tree), the same draft's chain stops early."""
    import griffin.engine

    target = make_target("llama")
    prompt = torch.tensor([_prompts(1, seed=4)[0]])
    chain = TreeConfig(total_tokens=5, depth=4, top_k=1)
    plain = vanilla_generate(target, prompt, sampling, 21, 9, []).tokens

    def decode():
        return speculative_generate(target, OracleDraft(target, int(prompt[0, 0])), prompt, chain, sampling, 21, 9, [])

    raced = decode()
    assert raced.tokens == plain and raced.stats.accepted_per_round == [4] * 4  # 1 + 4 rounds x 5 tokens
    monkeypatch.setattr(griffin.engine.DraftRace, "of", lambda *args: None)
    ranked = decode()
    assert ranked.tokens == plain and sum(ranked.stats.accepted_per_round) < 2 * ranked.stats.rounds, ranked.stats


def test_rows_of_different_samplings_keep_their_own_laws_as_the_batch_changes(monkeypatch):
    """Greedy, T=1, top-k and top-p rows of different budgets share two slots, joining and leaving
    (slots reused, rows moved): each decodes what it decodes alone (fp32, seeded). The rows' sampling
    tensors are built again when the rows change, not every round."""
    import griffin.engine

    target, draft = peaked_pair()
    samplings = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=3),
        SamplingConfig(temperature=1.0, top_p=0.8),
    ]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 6, (n,), generator=gen).tolist() for n in (4, 7, 3, 10)]
    budgets = [12, 30, 20, 26]
    requests = [DecodeRequest(p, s, n, 5 + i, []) for i, (p, s, n) in enumerate(zip(prompts, samplings, budgets))]
    builds, rounds, of, walk = [], [], griffin.engine.RowSampling.of, griffin.engine.walk
    monkeypatch.setattr(griffin.engine.RowSampling, "of", lambda *a: builds.append(1) or of(*a))
    monkeypatch.setattr(griffin.engine, "walk", lambda *a: rounds.append(1) or walk(*a))
    batched = generate_batch(target, draft, requests, SpeculationPolicy({1: SMALL}), max_rows=2)
    built, walked = len(builds), len(rounds)
    for request, result in zip(requests, batched):
        alone = speculative_generate(target, draft, torch.tensor([request.prompt]), SMALL, request.sampling,
                                     request.max_new_tokens, request.seed, [])  # fmt: skip
        assert result.tokens == alone.tokens and len(alone.tokens) == request.max_new_tokens
    # a build per prefill (4), and one per change of the rows at most (4 joins, 4 leaves)
    assert built <= 4 + 4 + 4 < walked, (built, walked)


def test_unseeded_requests_draw_independently():
    """Unseeded requests get fresh seeds: four identical ones, decoded together and one after
    another, give different texts."""
    target = make_target("llama")
    prompt, sampling = _prompts(1, seed=2)[0], SamplingConfig(temperature=1.0)
    together = generate_batch(
        target, None, [DecodeRequest(prompt, sampling, 20, stop_token_ids=[])] * 4, SpeculationPolicy({1: None})
    )
    apart = [vanilla_generate(target, torch.tensor([prompt]), sampling, 20, stop_token_ids=[]) for _ in range(4)]
    outputs = [tuple(r.tokens) for r in together + apart]
    assert len(set(outputs)) == len(outputs)


def test_rows_join_leave_and_cancel_mid_decode_and_reused_slots_decode_as_fresh():
    """Two slots, six requests of different lengths: rows join as others finish (slots reused, rows
    moved), one is cancelled mid-decode; every other output equals its batch-1 output, and the
    zero-past-length invariant holds after every step."""
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    engine = BatchEngine(
        target, draft, SpeculationPolicy({1: SMALL, 2: TreeConfig(total_tokens=6, depth=2, top_k=3)}), max_rows=2
    )
    prompts, budgets = _prompts(6, seed=3), [5, 17, 9, 30, 3, 12]
    rows = [engine.submit(DecodeRequest(p, GREEDY, m, stop_token_ids=[])) for p, m in zip(prompts, budgets)]
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        if steps == 4:
            engine.cancel(rows[3])
        assert len(engine.rows) <= 2
        assert _zero_past_lengths(engine.cache) and _zero_past_lengths(engine.draft_cache)
    assert rows[3].done.is_set() and len(rows[3].result.tokens) < budgets[3]
    for i, (row, prompt, budget) in enumerate(zip(rows, prompts, budgets)):
        if i != 3:
            assert (
                row.result.tokens
                == vanilla_generate(target, torch.tensor([prompt]), GREEDY, budget, stop_token_ids=[]).tokens
            )


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["T0", "T1"])
def test_long_prompts_prefill_in_chunks_between_rounds_and_decode_as_if_whole(sampling):
    """decode.prefill_chunk 5, two slots: a 30-token prompt goes in over several steps while the row
    beside it gets a round every step; that row finishes while the prompt is part-way in (whose KV
    then moves down a slot); a third prompt is cancelled part-way in. Every output equals its
    unchunked batch-1 output (fp32; T=1 seeded), and the zero-past-length invariant holds throughout."""
    target, draft = peaked_pair()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 6, (n,), generator=gen).tolist() for n in (3, 30, 23, 12)]
    budgets = [6, 10, 12, 8]
    requests = [DecodeRequest(p, sampling, n, 7 + i, []) for i, (p, n) in enumerate(zip(prompts, budgets))]
    alone = [speculative_generate(target, draft, torch.tensor([r.prompt]), SMALL, sampling, r.max_new_tokens,
                                  r.seed, []) for r in requests]  # fmt: skip
    target.prefill_chunk = 5
    engine = BatchEngine(target, draft, SpeculationPolicy({1: SMALL}), max_rows=2)
    short, long, cancelled, last = [engine.submit(r) for r in requests]
    moved = False
    while engine.busy:
        before = len(short.out)
        engine.step()
        if engine.filling is long and not short.done.is_set():
            assert len(short.out) > before  # a round every step while the long prompt goes in
        moved |= engine.filling is long and short.done.is_set() and long.prefilled < len(long.request.prompt)
        if engine.filling is cancelled and cancelled.prefilled >= 10:
            engine.cancel(cancelled)
        assert _zero_past_lengths(engine.cache) and _zero_past_lengths(engine.draft_cache)
    assert moved and cancelled.result.tokens == [] and cancelled.prefilled < len(cancelled.request.prompt)
    for row, expected in zip((short, long, last), (alone[0], alone[1], alone[3])):
        assert row.error is None and row.result.tokens == expected.tokens
        # the draft saw the same (feature, next token) pairs: it proposed and got accepted the same
        assert row.result.stats.accepted_per_round == expected.stats.accepted_per_round


def test_policy_picks_the_tree_for_the_batch_size_and_plain_rounds_keep_the_draft_in_step(monkeypatch):
    """{1: tree, 2: plain}: two rows decode plainly (from the first round: the policy counts the row
    still waiting for its slot), and when one leaves the other speculates, its draft caught up on
    every token committed meanwhile; outputs unchanged."""
    policy = SpeculationPolicy({1: SMALL, 2: None, 4: TreeConfig(total_tokens=6, depth=5, top_k=1)})
    assert policy.tree_for(1) == SMALL and policy.tree_for(3) is None and policy.tree_for(9).depth == 5
    with pytest.raises(ValueError, match="batch size 1"):
        SpeculationPolicy({2: None})
    import griffin.engine

    catch_ups, real = [], griffin.engine.catch_up_rows
    monkeypatch.setattr(griffin.engine, "catch_up_rows", lambda *a: catch_ups.append(a[4]) or real(*a))
    target = make_target("qwen2")
    draft = GriffinDraft.for_target(target, variant="griffin")
    prompts = _prompts(2, seed=5)
    requests = [
        DecodeRequest(prompts[0], GREEDY, 6, stop_token_ids=[]),
        DecodeRequest(prompts[1], GREEDY, 30, stop_token_ids=[]),
    ]
    results = generate_batch(target, draft, requests, policy)
    # row 0 never drafts (alone in its first round, row 1 already waiting); once row 0 is done, row 1
    # drafts, first catching up on the pairs of its prompt and of every plain round at once
    assert set(results[0].stats.drafted_per_round) == {0}
    assert catch_ups and all(len(counts) == 1 for counts in catch_ups)
    assert catch_ups[0][0] >= len(prompts[1]) + 2
    for prompt, result, budget in zip(prompts, results, (6, 30)):
        assert (
            result.tokens == vanilla_generate(target, torch.tensor([prompt]), GREEDY, budget, stop_token_ids=[]).tokens
        )


def test_the_policy_follows_a_higher_load_at_once_and_a_lower_one_after_it_held():
    """{1: tree, 2: plain}: while two rows decode, rounds are plain from the first; after the short
    row leaves, the long one stays plain for SWITCH_DOWN_ROUNDS - 1 more rounds, then drafts."""
    from griffin.policy import SWITCH_DOWN_ROUNDS

    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    short, long = _prompts(2, seed=8)
    requests = [DecodeRequest(short, GREEDY, 6, stop_token_ids=[]), DecodeRequest(long, GREEDY, 30, stop_token_ids=[])]
    results = generate_batch(target, draft, requests, SpeculationPolicy({1: SMALL, 2: None}))
    together = results[0].stats.rounds  # the short row's rounds: 5 plain ones after its prefill token
    drafted = results[1].stats.drafted_per_round
    first_tree = next(i for i, n in enumerate(drafted) if n > 0)
    assert together == 5 and first_tree == together + SWITCH_DOWN_ROUNDS - 1 and all(drafted[first_tree:])


def test_rounds_whose_drafting_rows_all_sample_draft_the_sampling_tree():
    """policy {1: a 4-token tree} with SMALL (12 tokens) as the sampling tree: a T=1 request alone
    drafts 11 nodes a round, a T=0 one 3, and the two together 3 (a greedy row drafts); the KV slack
    covers the sampling tree."""
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    trees = {1: TreeConfig(total_tokens=4, depth=1, top_k=3)}
    policy = SpeculationPolicy(trees, sampling_table(trees, SMALL))
    sampled, prompts = SamplingConfig(temperature=1.0), _prompts(2, seed=9)
    alone = [
        generate_batch(target, draft, [DecodeRequest(prompts[0], s, 12, 1, [])], policy)[0] for s in (sampled, GREEDY)
    ]
    assert set(alone[0].stats.drafted_per_round) == {11} and set(alone[1].stats.drafted_per_round) == {3}
    both = generate_batch(
        target, draft, [DecodeRequest(p, s, 12, 1, []) for p, s in zip(prompts, (sampled, GREEDY))], policy
    )
    assert set(both[0].stats.drafted_per_round[:5]) == {3} and both[0].tokens == alone[0].tokens
    assert policy.tree_slack == SMALL.total_tokens + (SMALL.depth - 1) * SMALL.top_k


def test_a_sampling_policy_decides_the_rounds_whose_drafting_rows_all_sample():
    """sampling_trees {1: SMALL, 2: plain} beside a greedy policy that drafts at every size: two T=1 rows
    together decode plainly, a T=1 row alone drafts SMALL, a T=0 row beside a T=1 one follows the greedy
    policy; each T=1 row's tokens are those it decodes alone (seeded), and the KV slack covers SMALL."""
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    leaf = TreeConfig(total_tokens=4, depth=1, top_k=3)
    policy = SpeculationPolicy({1: leaf}, {1: SMALL, 2: None})
    assert policy.tree_for(1, sampling=True) == SMALL and policy.tree_for(5, sampling=True) is None
    assert policy.tree_for(5) == leaf and policy.describe_sampling() == {1: SMALL.model_dump(), 2: None}
    with pytest.raises(ValueError, match="batch size 1"):
        SpeculationPolicy({1: leaf}, sampling_trees={2: None})
    sampled, prompts = SamplingConfig(temperature=1.0), _prompts(2, seed=11)
    alone = [
        generate_batch(target, draft, [DecodeRequest(p, sampled, 12, i, [])], policy)[0] for i, p in enumerate(prompts)
    ]
    assert set(alone[0].stats.drafted_per_round) == {SMALL.total_tokens - 1}
    together = generate_batch(
        target, draft, [DecodeRequest(p, sampled, 12, i, []) for i, p in enumerate(prompts)], policy
    )
    assert set(together[0].stats.drafted_per_round[:5]) == {0}  # both sample: plain rows from the first round
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    mixed = generate_batch(
        target,
        draft,
        [DecodeRequest(prompts[0], sampled, 12, 0, []), DecodeRequest(prompts[1], GREEDY, 12, 1, [])],
        policy,
    )
    assert set(mixed[0].stats.drafted_per_round[:5]) == {leaf.total_tokens - 1} and mixed[0].tokens == alone[0].tokens
    assert policy.tree_slack == SMALL.total_tokens + (SMALL.depth - 1) * SMALL.top_k


def test_a_request_without_speculation_decodes_plainly_beside_speculative_rows():
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    prompts = _prompts(3, seed=6)
    requests = [DecodeRequest(p, GREEDY, 16, stop_token_ids=[], speculative=(i != 1)) for i, p in enumerate(prompts)]
    results = generate_batch(target, draft, requests, SpeculationPolicy({1: SMALL}))
    assert set(results[1].stats.accepted_per_round) == {0}
    for prompt, result in zip(prompts, results):
        assert result.tokens == vanilla_generate(target, torch.tensor([prompt]), GREEDY, 16, stop_token_ids=[]).tokens


def test_a_request_cancelled_while_waiting_for_a_slot_never_decodes():
    target = make_target("llama")
    engine = BatchEngine(target, None, SpeculationPolicy({1: None}), max_rows=1)
    running = engine.submit(DecodeRequest([5, 6, 7], GREEDY, 8, stop_token_ids=[]))
    waiting = engine.submit(DecodeRequest([8, 9], GREEDY, 8, stop_token_ids=[]))
    engine.step()
    engine.cancel(waiting)
    engine.run_until_idle()
    assert waiting.done.is_set() and waiting.result.tokens == [] and waiting.result.stats.rounds == 0
    assert len(running.result.tokens) == 8


def test_a_rows_own_failure_ends_that_row_only():
    """A row whose own callback fails, at its prefill or in a later round, ends with its error; the
    rows decoding beside it go on and still equal their batch-1 outputs."""
    target = make_target("llama")
    draft = GriffinDraft.for_target(target, variant="griffin")
    engine = BatchEngine(target, draft, SpeculationPolicy({1: SMALL}), max_rows=3)
    prompts, budget = _prompts(3, seed=5), 12
    failure = RuntimeError("the row's consumer broke")

    def fails_at(delivery: int):
        calls = []

        def on_tokens(tokens):
            calls.append(tokens)
            if len(calls) == delivery:
                raise failure

        return on_tokens

    good = [engine.submit(DecodeRequest(p, GREEDY, budget, stop_token_ids=[])) for p in prompts[:2]]
    sampled = SamplingConfig(temperature=1.0)
    at_prefill = engine.submit(DecodeRequest(prompts[2], sampled, budget, 0, [], on_tokens=fails_at(1)))
    in_a_round = engine.submit(DecodeRequest(prompts[2], sampled, budget, 0, [], on_tokens=fails_at(3)))
    engine.run_until_idle()
    for row in (at_prefill, in_a_round):
        assert row.done.is_set() and row.error is failure
    for row, prompt in zip(good, prompts):
        assert row.error is None
        assert (
            row.result.tokens
            == vanilla_generate(target, torch.tensor([prompt]), GREEDY, budget, stop_token_ids=[]).tokens
        )


def test_fail_all_ends_every_active_and_waiting_row():
    target = make_target("llama")
    engine = BatchEngine(target, None, SpeculationPolicy({1: None}), max_rows=1)
    rows = [engine.submit(DecodeRequest(p, GREEDY, 50, stop_token_ids=[])) for p in _prompts(3)]
    engine.step()
    failure = RuntimeError("the device went away")
    engine.fail_all(failure)
    assert all(row.done.is_set() and row.error is failure for row in rows) and not engine.busy
    late = engine.submit(DecodeRequest(_prompts(1)[0], GREEDY, 5, stop_token_ids=[]))
    assert late.done.is_set() and late.error is failure  # a request after the failure never waits
