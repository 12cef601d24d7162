"""The batching engine: several requests decode together, one round for all of them at a time.

Each ``step()``:
- prefills waiting requests into free slots, at most ``prefill_chunk`` prompt tokens a step
  (``decode.prefill_chunk``): a burst of short prompts joins in one step, and a long prompt goes in
  over several, each chunk followed by a round for the running rows, so it never stalls them long;
- picks the round's tree from the ``SpeculationPolicy`` for the load: active rows plus requests
  waiting for a slot, a lower load only once it held ``SWITCH_DOWN_ROUNDS`` rounds (``None``: plain
  decoding, one token per row, the draft idle; the sampling tree when every drafting row samples);
- drafts every row's tree in one batched draft pass per level, verifies every row's tree in one
  batched target pass (trees padded to the widest; see griffin.rows for per-row lengths);
- accepts every row at once, each with its own ``SamplingConfig`` and position-keyed draws
  (griffin.verify), and hands each row its committed tokens (``on_tokens``);
- retires rows that finished, hit a stop token or were cancelled, freeing their slots at once.

Lossless per request: a row's logits are those of its own prefix and tree (masked per row), so T=0
output is the target's greedy output, and T>0 samples from the target's law with the row's own
seed: its token at output index i is a function of the seed, i and the target's law there
(griffin.verify), so a seeded request decodes the same text alone or batched, drafting or plain.
Shape legend: B active rows, N tree nodes, D_f target features, V vocab.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import Tensor
from torch.profiler import record_function

from griffin.config import SamplingConfig, TreeConfig
from griffin.model import GriffinDraft
from griffin.policy import SWITCH_DOWN_ROUNDS, SpeculationPolicy
from griffin.request import DecodeRequest, Row
from griffin.results import GenerationResult, Scores, append_tokens, check_request, device_time
from griffin.rows import RowCache, row_mask
from griffin.static import MIN_BUCKET, decode_mode, length_bucket, mark_static
from griffin.target import TargetAdapter, decode_attention
from griffin.tree import DraftRace, DraftTree, TreeBatch, catch_up_rows, draft_rows, root_tree
from griffin.verify import RowSampling, Walked, choose, walk


class BatchEngine:
    """One model replica's decoding: ``submit`` from any thread, ``step`` from one."""

    def __init__(self, target: TargetAdapter, draft: GriffinDraft | None, policy: SpeculationPolicy, max_rows: int):
        self.target, self.draft, self.policy, self.max_rows = target, draft, policy, max_rows
        self.layers = draft.cfg.feature_layers if draft is not None else None
        self.waiting: deque[Row] = deque()
        self.rows: list[Row] = []  # active, row i in slot i
        self.filling: Row | None = None  # a prompt part-way through its prefill, in slot len(rows)
        self.prefill_chunk = target.prefill_chunk  # prompt tokens a step may prefill; None: no limit
        self._sampling: RowSampling | None = None  # the active rows' settings; None whenever the rows change
        self.lock = threading.Condition()
        self.tree_slack = policy.tree_slack
        # compiled decoding (griffin.static) follows the target: compile_decoding() at load
        self.compiled = target.compiled_forward is not None
        if self.compiled and draft is not None:
            draft.compile_decoding()
        # compiled: the whole context at once, so the buffers never grow (a new shape and address: a
        # new graph); eager: room for short requests, doubled on demand
        capacity = target.max_context + self.tree_slack + 1 if self.compiled else 64
        self.cache = target.new_row_cache(max_rows, capacity)
        self.draft_cache = None
        if draft is not None:
            # a catch-up writes the longest pending run (padded to a power of two when compiled) after
            # every row's length: at most a capacity after a capacity
            room = capacity + (length_bucket(capacity) if self.compiled else capacity)
            self.draft_cache = RowCache.for_draft(draft.cfg, max_rows, room, draft.param_dtype, target.device)
        if self.compiled:  # CUDA graphs write these buffers in place; sized for the whole context, they never move
            mark_static(self.cache.buffers() + (self.draft_cache.buffers() if self.draft_cache is not None else []))
        self.rounds, self.last_batch = 0, 0
        self.policy_load, self.lower_rounds = 0, 0  # the load the policy last followed; rounds below it
        self.failed: BaseException | None = None  # fail_all's error: later requests end with it at once

    # ---- requests ----
    def submit(self, request: DecodeRequest) -> Row:
        check_request(self.target, torch.tensor([request.prompt]), request.max_new_tokens)
        if request.seed is not None and not isinstance(request.seed, int):
            raise TypeError(f"a request's seed is an int (sampling is keyed by position), not {type(request.seed)}")
        stop = set(self.target.stop_token_ids if request.stop_token_ids is None else request.stop_token_ids)
        # an unseeded request's seed comes from torch's global generator: random per process, and
        # reproducible where a caller seeds it (torch.manual_seed)
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, ()))
        row = Row(request, stop, seed)
        with self.lock:
            if self.failed is None:
                self.waiting.append(row)
                self.lock.notify_all()
                return row
        row.error = self.failed  # the engine stopped (fail_all) before this request could join
        self._finish(row, "stop")
        return row

    def cancel(self, row: Row) -> None:
        """Ends ``row`` at the next round (or before it starts); its slot is free after that round."""
        row.cancelled = True
        with self.lock:
            self.lock.notify_all()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.filling or self.waiting)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: self.busy, timeout)

    def fail_all(self, error: BaseException) -> None:
        """End every active and waiting row with ``error``: the engine cannot go on, and its caller
        stops stepping it (its caches are left as they are)."""
        with self.lock:
            rows = [*self.rows, *([self.filling] if self.filling else []), *self.waiting]
            self.rows, self.filling, self.waiting, self.failed = [], None, deque(), error
            self._sampling = None
        for row in rows:
            row.error = row.error or error
            self._finish(row, "stop")

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    def warm_up(self, batches: list[int]) -> None:
        """Compile and capture the decode steps before anything is timed or served (a no-op unless
        decoding is compiled; call it from the thread that will decode: CUDA graphs are per thread).
        Each batch size decodes through two width buckets (griffin.static), in drafting rounds (with
        the sampling rounds' trees too, when the policy has its own for them) and in plain ones.
        Synthetic prompts; the outputs are dropped."""
        if not self.compiled:
            return
        modes = [(SamplingConfig(), True), (SamplingConfig(), False)]
        modes += [(SamplingConfig(temperature=1.0), True)] if self.policy.samples_otherwise else []
        chunk, self.prefill_chunk = self.prefill_chunk, None  # each batch's rows join in one step, together
        try:
            for batch in batches:
                for sampling, speculative in modes:
                    for b in range(batch):
                        prompt = list(range(1, 17 + b))
                        request = DecodeRequest(prompt, sampling, 2 * MIN_BUCKET, 0, [], speculative=speculative)
                        self.submit(request)
                    self.run_until_idle()
        finally:
            self.prefill_chunk = chunk

    # ---- one round ----
    def step(self) -> None:
        with decode_mode(self.compiled), decode_attention(self.target.device):
            self._drop_cancelled_waiting()
            self._prefill()
            self._retire()  # the admitted row may be done already; cancelled rows leave before the round
            if self.rows:
                try:
                    self._round()
                except Exception as error:  # a round that failed fails its rows, not the engine
                    for row in self.rows:
                        row.error = error
            self._retire()
            if not self.rows:  # idle: the next request starts the policy afresh (no warm-up's or burst's load)
                self.policy_load = self.lower_rounds = 0

    def _drop_cancelled_waiting(self) -> None:
        with self.lock:
            gone = [row for row in self.waiting if row.cancelled]
            for row in gone:
                self.waiting.remove(row)
        for row in gone:
            self._finish(row, "stop")

    def _prefill(self) -> None:
        """Prompts into free slots, at most ``prefill_chunk`` tokens this step: the row part-way
        through (``filling``) first, then waiting rows in order. A row whose prompt is all in joins
        the active rows (an error ends it there, so ``_retire`` frees its slot)."""
        budget = self.prefill_chunk or float("inf")
        while budget > 0:
            if self.filling is None:
                with self.lock:
                    if not self.waiting or len(self.rows) >= self.max_rows:
                        return
                    self.filling = self.waiting.popleft()
                req = self.filling.request
                self._ensure_capacity(len(req.prompt) + req.max_new_tokens)
            row = self.filling
            count = int(min(budget, len(row.request.prompt) - row.prefilled))
            if not row.cancelled:
                self._prefill_chunk(row, len(self.rows), count)
            budget -= count
            if row.cancelled or row.error is not None or row.prefilled == len(row.request.prompt):
                self.rows.append(row)  # a row that ended leaves at the next _retire
                self.filling, self._sampling = None, None

    def _prefill_chunk(self, row: Row, slot: int, count: int) -> None:
        """The next ``count`` prompt tokens of ``row`` into the target's KV in ``slot``, queued for the
        draft; after the last, the row's first token. A failure ends this row only."""
        req, device, start = row.request, self.target.device, device_time(self.target.device)
        ids = torch.tensor([req.prompt[row.prefilled : row.prefilled + count]], device=device)  # (1, C)
        starts, _ = self.cache.slots.begin(slot, slot + 1, count)
        positions = starts[:, None] + torch.arange(count, device=device)
        last = row.prefilled + count == len(req.prompt)
        try:
            features, logits = self.target.forward(
                ids, self.cache, positions, all_logits=False, feature_layers=self.layers
            )  # (1, C, D_f), (1, 1, V)
            self.cache.slots.lengths[slot] += count
            row.prefilled += count
            if last:
                rows = RowSampling.of([req.sampling], logits.shape[-1], device)
                token = int(choose(logits[0, -1:], rows, torch.tensor(row.keys(1), device=device)))
        except Exception as error:
            row.error = error
            return
        row.stats.prefill_time += device_time(device) - start
        # each prompt position's features pair with the token after it: the next prompt token, or the first output
        after = req.prompt[row.prefilled - count + 1 : row.prefilled] + (
            [token] if last else [req.prompt[row.prefilled]]
        )
        self._pend(row, features[0], after)
        if last:
            self._deliver(row, [token], lambda recorder: recorder.score(logits[0, -1:], [token]))

    def _ensure_capacity(self, need: int) -> None:
        """Room for a request of ``need`` positions (prompt + new tokens) plus a tree; growing doubles.
        The draft's rows also hold a catch-up of the longest pending run (at most a capacity)."""
        need += self.tree_slack + 1
        if need > self.cache.capacity:
            self.cache.ensure_capacity(max(need, 2 * self.cache.capacity))
        if self.draft_cache is not None:
            self.draft_cache.ensure_capacity(2 * self.cache.capacity)

    def _load(self) -> int:
        """The batch size the policy sees: active rows plus those on their way in (part-way through a
        prefill, or waiting for a slot), so that rows about to have company do not start drafting for
        a batch of one."""
        with self.lock:
            return min(self.max_rows, len(self.rows) + (self.filling is not None) + len(self.waiting))

    def _policy_load(self) -> int:
        """``_load`` with hysteresis (``SWITCH_DOWN_ROUNDS``)."""
        load = self._load()
        self.lower_rounds = self.lower_rounds + 1 if load < self.policy_load else 0
        if load >= self.policy_load or self.lower_rounds >= SWITCH_DOWN_ROUNDS:
            self.policy_load, self.lower_rounds = load, 0
        return self.policy_load

    def _round(self) -> None:
        rows, device = self.rows, self.target.device
        drafting_rows = [row for row in rows if row.request.speculative] if self.draft is not None else []
        sampling = all(not row.request.sampling.greedy for row in drafting_rows)
        tree = self.policy.tree_for(self._policy_load(), sampling) if drafting_rows else None
        depth = tree.depth if tree is not None else 0
        keys = self._keys(depth + 1)  # (B, D + 1): the draft's race and the walk read the same draws
        start = device_time(device)
        trees = self._draft(tree, keys[:, :depth]) if tree is not None else None
        mid = device_time(device)
        if trees is None:
            roots = torch.tensor([row.root for row in rows], device=device)
            trees = [root_tree(roots[b : b + 1]) for b in range(len(rows))]
        batch = TreeBatch.of(trees, device)
        with record_function("griffin.verify_forward"):
            features, logits = self._verify_forward(batch)  # (B, N, D_f), (B, N, V)
        walks = self._accept_and_commit(batch, logits, keys)
        end = device_time(device)
        self.rounds, self.last_batch = self.rounds + 1, len(rows)
        for b, (row, tree_b, walked) in enumerate(zip(rows, trees, walks)):
            row.stats.draft_time += mid - start
            row.stats.verify_time += end - mid
            row.stats.round_seconds.append((mid - start, end - mid))
            row.stats.rounds += 1
            row.stats.accepted_per_round.append(walked.accept_len)
            row.stats.drafted_per_round.append(tree_b.size - 1)
            accepted = torch.tensor(walked.nodes, device=device)
            self._pend(row, features[b, accepted], walked.tokens)
            # called at once, inside _deliver, only when the request records log-probabilities
            self._deliver(row, walked.tokens, lambda recorder: recorder.score(logits[b, accepted], walked.tokens))

    def verify_only(self, trees: list[DraftTree]) -> list[Walked]:
        """A round's verify phase for the active rows with ``trees`` (one each), as ``step`` runs it
        after drafting: the batched target pass, the walk and the KV commit. Nothing is delivered,
        so the rows' KV runs ahead of their outputs: for timing (griffin.offline.verify_cost), on rows
        that are cancelled afterwards."""
        with decode_mode(self.compiled), decode_attention(self.target.device):
            batch = TreeBatch.of(trees, self.target.device)
            _, logits = self._verify_forward(batch)
            keys = self._keys(max(int(t.depths.max()) for t in trees) + 1)  # (B, D + 1)
            return self._accept_and_commit(batch, logits, keys)

    def _draft(self, tree: TreeConfig, keys: Tensor) -> list[DraftTree]:
        """Every row's tree: catch the draft up on each row's pending pairs (padded to the longest),
        then the levels, all rows at once, T>0 rows racing with ``keys`` (B, L), the draws of the
        level positions. A request that asked for no draft keeps only its root."""
        assert self.draft is not None, "drafting rounds run only with a draft"
        rows, device = self.rows, self.target.device
        counts = [sum(run.numel() for run in row.pending_tokens) for row in rows]
        width, first = max(counts), rows[0].pending_features[0]
        width = length_bucket(width) if self.compiled else width  # compiled: a shape per power of two
        features = torch.zeros(len(rows), width, first.shape[-1], device=device, dtype=first.dtype)
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            features[b, : counts[b]] = torch.cat(row.pending_features)
            tokens[b, : counts[b]] = torch.cat(row.pending_tokens)
            row.pending_features, row.pending_tokens = [], []
        with record_function("griffin.draft.catch_up"):
            P, R = catch_up_rows(self.draft, self.draft_cache, features, tokens, counts, self.compiled)  # (B, D)
        roots = torch.tensor([row.root for row in rows], device=device)
        race = self._draft_race(keys)
        with record_function("griffin.draft_tree"):
            trees = draft_rows(self.draft, self.draft_cache, P, R, roots, tree, self.compiled, race)
        return [t if row.request.speculative else root_tree(t.tokens[:1]) for row, t in zip(rows, trees)]

    def _draft_race(self, keys: Tensor) -> DraftRace | None:
        """The T>0 rows' race with the walk's draws ``keys`` (B, L) (griffin.tree.DraftRace); None when
        every row is greedy."""
        assert self.draft is not None, "drafting rounds run only with a draft"
        sampling = self._row_sampling(self.target.head_weight.shape[0], self.target.device)
        return DraftRace.of(self.draft, sampling, keys)

    def _verify_forward(self, batch: TreeBatch) -> tuple[Tensor, Tensor]:
        """One target pass over every row's tree, padded to the widest: a padding node sees only itself."""
        B, N = batch.tokens.shape
        starts, width = self.cache.slots.begin(0, B, N, static=self.compiled)
        # one token per row at a common length: transformers' own causal mask is exact (and cheaper);
        # never when compiled (uniform is then False): its size would come from Python-side lengths
        mask = None if N == 1 and self.cache.slots.uniform else row_mask(starts, batch.mask, width)  # (B, N, W)
        return self.target.forward(
            batch.tokens, self.cache, starts[:, None] + batch.depths, mask, feature_layers=self.layers,
            compiled=self.compiled,
        )  # fmt: skip

    def _accept_and_commit(self, batch: TreeBatch, logits: Tensor, keys: Tensor) -> list[Walked]:
        """Every row's walk (griffin.verify.walk), all rows at once with their own sampling and draws
        ``keys`` (B, D + 1), D the trees' depth; the target KV keeps each row's accepted path."""
        with record_function("griffin.accept"):
            rows = self._row_sampling(logits.shape[-1], logits.device)
            walks = walk(batch.tokens, batch.parents, logits, rows, keys)
        with record_function("griffin.commit"):
            self.cache.keep_paths(0, [w.nodes for w in walks], batch.tokens.shape[1])
        return walks

    def _keys(self, count: int) -> Tensor:
        """(B, count) long on the device: each row's keys for its next ``count`` output positions
        (griffin.verify.position_keys; a greedy row's are unused)."""
        return torch.tensor([row.keys(count) for row in self.rows]).to(self.target.device)

    def _row_sampling(self, vocab: int, device) -> RowSampling:
        """The active rows' sampling settings on the device, built again only after the rows change
        (``_prefill``, ``_retire`` and ``fail_all`` reset it)."""
        if self._sampling is None:
            self._sampling = RowSampling.of([row.request.sampling for row in self.rows], vocab, device)
        return self._sampling

    def _pend(self, row: Row, features: Tensor, committed: list[int]) -> None:
        """Queue the round's committed pairs for the draft's next catch-up."""
        if self.draft is None:
            return
        row.pending_features.append(features)  # after a plain round the draft was idle: the runs accumulate
        row.pending_tokens.append(torch.tensor(committed, device=features.device))

    def _deliver(self, row: Row, tokens: list[int], scores: Scores) -> None:
        r = row.request
        try:
            row.finish = append_tokens(row.out, tokens, row.stop, r.max_new_tokens, r.on_tokens, r.logprobs, scores)
        except BaseException as error:  # the consumer ended the request (client gone, stop sequence)
            row.error = error

    # ---- leaving ----
    def _retire(self) -> None:
        """Rows that finished, failed or were cancelled leave; the last active row moves into each freed slot."""
        for slot in range(len(self.rows) - 1, -1, -1):
            row = self.rows[slot]
            if row.finish is None and row.error is None and not row.cancelled:
                continue
            last = len(self.rows) - 1
            self.cache.release(slot, last)
            if self.draft_cache is not None:
                self.draft_cache.release(slot, last)
            self.rows[slot] = self.rows[last]
            self.rows.pop()
            if self.filling is not None:  # the prompt part-way in follows, into slot len(rows)
                self.cache.release(last, last + 1)
            self._sampling = None
            self._finish(row, row.finish or "stop")

    def _finish(self, row: Row, reason: str) -> None:
        logprobs = row.request.logprobs.entries if row.request.logprobs is not None else None
        row.result = GenerationResult(row.out, row.stats, reason, logprobs)
        row.done.set()
        if row.request.on_done is not None:
            row.request.on_done(row)
