"""The exact-law harness for T>0 (tests/griffin/test_verify.py, test_decode.py, test_engine.py).

Lossless sampling means the committed tokens have the target's own law. The harness checks that
over the first K committed tokens (K >= 3, so the token drawn after an accepted leaf, the bonus, is
inside the window), against a reference written independently of griffin.verify: transformers'
own logits warpers. Its power is shown by controls: verifiers with one planted bug each
(``planted_verifier``), which the same statistic must reject at p < 1e-6 at the same sample size.

Two targets:
- ``MarkovTarget``: logits that depend only on the last token, a table (V, V). Its law over K
  tokens is a product of table rows, so verifying costs no model and tens of thousands of windows
  fit in seconds; the trees are fixed shapes drafted from a second, nearby table.
- a tiny transformers model (the engine tests): ``exact_joint`` enumerates every continuation.

Shape legend: V vocab, N tree nodes, K window length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import chisquare
from torch import Tensor
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from griffin.config import SamplingConfig
from griffin.model import GriffinDraft
from griffin.tree import DraftTree, _assemble
from griffin.verify import RowSampling, choose, walk
from tests.conftest import make_target

CONTROL_P = 1e-6  # every planted bug must be rejected at least this strongly
PASS_P = 1e-4  # the correct code's seeded runs must not be rejected at this level


def reference_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """logits (..., V) -> the target's sampling law (..., V), by transformers' warpers in
    ``generate``'s order (temperature, top-k, top-p): an oracle independent of griffin.verify."""
    scores = logits.double().reshape(-1, logits.shape[-1])
    warpers = [TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1).reshape(logits.shape)


def chi_square_p(counts: Tensor, probabilities: Tensor) -> float:
    """p-value of observed ``counts`` against ``probabilities`` (same shape, summing to 1): cells
    expecting fewer than 5 draws are pooled into one; a cell of probability 0 must never be drawn."""
    n = float(counts.sum())
    expected = probabilities.double().flatten() * n
    observed = counts.double().flatten()
    zero = probabilities.flatten() <= 0
    assert observed[zero].sum() == 0, f"{int(observed[zero].sum())} draws of tokens the target never samples"
    keep = expected > 5
    pooled_observed, pooled_expected = observed[~keep & ~zero].sum(), expected[~keep & ~zero].sum()
    observed, expected = observed[keep], expected[keep]
    if pooled_expected > 0:
        observed = torch.cat([observed, pooled_observed[None]])
        expected = torch.cat([expected, pooled_expected[None]])
    expected = expected * (observed.sum() / expected.sum())  # float round-off: chisquare checks totals
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


# ---- controls: verifiers with one known bug each -------------------------------------------------
FAULTS = {
    "no renormalisation": "a rejected child's mass is zeroed but the rest is not renormalised",
    "first child x1.3": "the first child is accepted 1.3x too often",
    "uniform leaf bonus": "the token after an accepted leaf is drawn uniformly",
    "bonus without warper": "the token after an accepted leaf is drawn from the raw softmax",
    "top-p one side": "the recovered/bonus draw skips top-p (acceptance keeps it)",
    "residual keeps rejected": "the recovered token is drawn from p, rejected children not removed",
    "root law at every depth": "children deeper than 1 are accepted with the root's probabilities",
    "temperature twice": "the warper divides by the temperature twice",
}


def random_keys(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Random 64-bit position keys (griffin.verify.position_keys' type) from ``generator``."""
    return torch.randint(-(2**63), 2**63 - 1, shape, generator=generator)


def first_token(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """The target's own draw at the prompt, logits (V,), by griffin.verify.choose at a random key."""
    rows = RowSampling.of([sampling], logits.shape[-1], logits.device)
    return int(choose(logits[None], rows, random_keys((1,), generator)))


def griffin_verifier(tree: DraftTree, logits: Tensor, sampling: SamplingConfig, generator) -> tuple[list[int], int]:
    """griffin.verify.walk on one tree, logits (N, V), with a random key per depth: the accepted
    nodes (root first) and the next token."""
    keys = random_keys((1, int(tree.depths.max()) + 1), generator)
    rows = RowSampling.of([sampling], logits.shape[-1], logits.device)
    walked = walk(tree.tokens[None], tree.parents[None], logits[None], rows, keys)[0]
    return walked.nodes, walked.tokens[-1]


def planted_verifier(fault: str):
    """A verifier (``griffin_verifier``'s contract) with the bug ``fault`` (a FAULTS key) planted:
    the controls the law tests must reject. Recursive rejection sampling, the same law as
    griffin.verify's walk when correct, written from the method, not from griffin.verify."""
    assert fault in FAULTS, fault

    def warp(logits: Tensor, sampling: SamplingConfig, top_p: bool = True) -> Tensor:
        if fault == "temperature twice":
            logits = logits / sampling.temperature
        if not top_p:
            sampling = sampling.model_copy(update={"top_p": 1.0})
        return reference_probs(logits, sampling).float()

    def planted(tree: DraftTree, logits: Tensor, sampling: SamplingConfig, generator=None) -> tuple[list[int], int]:
        tokens, node, path, rejected = tree.tokens.tolist(), 0, [0], []
        while True:
            law_node = 0 if fault == "root law at every depth" and tree.depths[node] >= 1 else node
            probs, rejected = warp(logits[law_node], sampling), []
            accepted = None
            for rank, child in enumerate(tree.children[node]):
                boost = 1.3 if fault == "first child x1.3" and rank == 0 else 1.0
                if float(torch.rand((), generator=generator)) < boost * float(probs[tokens[child]]):
                    accepted = child
                    break
                rejected.append(tokens[child])
                if fault != "residual keeps rejected":
                    probs[tokens[child]] = 0.0
                if fault != "no renormalisation":
                    probs = probs / probs.sum()
            if accepted is None:
                return path, _final_draw(fault, tree, node, logits, sampling, probs, rejected, generator)
            node = accepted
            path.append(node)

    def _final_draw(fault, tree, node, logits, sampling, probs, rejected, generator) -> int:
        leaf = not tree.children[node]
        if leaf and fault == "uniform leaf bonus":
            probs = torch.ones_like(probs)
        elif leaf and fault == "bonus without warper":
            probs = logits[node].float().softmax(-1)
        elif fault == "top-p one side":
            probs = warp(logits[node], sampling, top_p=False)
            probs[rejected] = 0.0
        return int(torch.multinomial(probs, 1, generator=generator))

    return planted


# ---- the Markov target -----------------------------------------------------------------------------
@dataclass
class MarkovTarget:
    """Next-token logits from the last token alone: ``logits[s]`` (V,). The draft proposes from
    ``draft_logits``, the same table plus noise, so most rounds accept and leaves are reached."""

    logits: Tensor  # (V, V)
    draft_logits: Tensor  # (V, V)
    prompt_last: int = 0

    @classmethod
    def make(cls, vocab: int = 6, seed: int = 0, sharpness: float = 1.2) -> "MarkovTarget":
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=gen) * sharpness
        return cls(logits, logits + torch.randn(vocab, vocab, generator=gen))

    @property
    def vocab(self) -> int:
        return self.logits.shape[0]

    def law(self, sampling: SamplingConfig, k: int) -> Tensor:
        """P(t1, ..., tk) of the target's own sampling: (V,) * k."""
        step = reference_probs(self.logits, sampling)  # (V, V): row s = law after token s
        joint = step[self.prompt_last]
        for _ in range(k - 1):
            joint = joint[..., None] * step  # broadcast over the last token's row
        return joint

    def tree(self, root: int, shape: str) -> DraftTree:
        """A fixed draft tree under ``root``: "leaf" (depth 1, 3 children: every accepted child is a
        leaf), "chain" (depth 2, 1 child per node) or "tree" (depth 2, 2 children per node)."""
        top = self.draft_logits.argsort(dim=-1, descending=True)  # (V, V): rank order per token
        width, depth = {"leaf": (3, 1), "chain": (1, 2), "tree": (2, 2)}[shape]
        tokens, parents, depths = [], [], []
        frontier = [(-1, root)]  # (pool index, token)
        for level in range(1, depth + 1):
            next_frontier = []
            for parent, token in frontier:
                for child in top[token, :width].tolist():
                    next_frontier.append((len(tokens), child))
                    tokens.append(child)
                    parents.append(parent)
                    depths.append(level)
            frontier = next_frontier
        n = len(tokens)
        return _assemble(
            torch.tensor([root]), -torch.arange(n, dtype=torch.float), torch.tensor(tokens), torch.tensor(parents),
            torch.tensor(depths), n,
        )  # fmt: skip


@dataclass
class Windows:
    counts: Tensor  # (V,) * K: how often each window of the first K tokens was committed
    bonus: Tensor  # (V, V): [leaf token, bonus token] for every bonus drawn inside a window
    samples: int


def sample_windows(
    target: MarkovTarget, shape: str, sampling: SamplingConfig, n: int, k: int, verifier=griffin_verifier, seed=0
) -> Windows:
    """n decodes of ``k`` tokens: the first from the target at the prompt (``first_token``, as a
    prefill), then rounds of tree verification by ``verifier``."""
    V, gen = target.vocab, torch.Generator().manual_seed(seed)
    trees = [target.tree(root, shape) for root in range(V)]
    node_logits = [target.logits[t.tokens] for t in trees]  # (N, V) per root
    counts, bonus = torch.zeros((V,) * k), torch.zeros(V, V)
    for _ in range(n):
        window = [first_token(target.logits[target.prompt_last], sampling, gen)]
        while len(window) < k:
            tree = trees[window[-1]]
            nodes, next_token = verifier(tree, node_logits[window[-1]].clone(), sampling, gen)
            window += tree.tokens[nodes[1:]].tolist() + [next_token]
            if not tree.children[nodes[-1]] and len(window) <= k:
                bonus[int(tree.tokens[nodes[-1]]), next_token] += 1
        counts[tuple(window[:k])] += 1
    return Windows(counts, bonus, n)


def bonus_p(target: MarkovTarget, sampling: SamplingConfig, bonus: Tensor) -> float:
    """The leaf bonus alone: after leaf token s it must follow the target's law after s (pooled over s)."""
    expected = reference_probs(target.logits, sampling) * bonus.sum(-1, keepdim=True)  # (V, V)
    return chi_square_p(bonus, expected / expected.sum())


# ---- a tiny transformers target, through the engine ----------------------------------------------------
def peaked_pair(variant: str = "griffin"):
    """A tiny target with peaked, context-dependent laws over 6 tokens (a flat law hides bugs) and a
    confident, partly wrong draft. EAGLE-3 reads the target's layer 2 of 5."""
    target = make_target("llama", vocab_size=6, seed=7, **({"num_hidden_layers": 5} if variant == "eagle3" else {}))
    with torch.no_grad():
        target.model.lm_head.weight.mul_(10.0)
    draft = GriffinDraft.for_target(target, variant=variant)
    torch.nn.init.normal_(draft.layer.mlp.down_proj.weight, std=0.5)
    return target, draft


def exact_joint(target, prompt: list[int], sampling: SamplingConfig, k: int) -> Tensor:
    """P(t1, ..., tk) of the target's own sampling after ``prompt``, every continuation enumerated
    through the model without a cache: (V,) * k."""
    V = target.vocab_size
    joint = torch.ones(())
    contexts = torch.tensor([prompt])  # (V^j, T + j): every continuation of length j
    with torch.no_grad():
        for _ in range(k):
            law = reference_probs(target.model(contexts).logits[:, -1], sampling)  # (V^j, V)
            joint = joint[..., None] * law.reshape(*joint.shape, V)
            contexts = torch.cat([contexts.repeat_interleave(V, 0), torch.arange(V).repeat(len(contexts))[:, None]], 1)
    return joint


def engine_windows(target, draft, prompt: list[int], tree, sampling: SamplingConfig, n: int, k: int, batched: bool):
    """Counts (V,) * k of the first k tokens of n decodes through griffin.engine: alone (seeds 0..n-1,
    one request at a time, griffin.decode.speculative_generate), or batched (16 unseeded requests at
    once in 6 slots, beside 4 neighbours of other lengths and budgets; their seeds are drawn from
    torch's global generator)."""
    from griffin.decode import speculative_generate
    from griffin.policy import SpeculationPolicy
    from griffin.request import DecodeRequest
    from griffin.offline import generate_batch

    counts = torch.zeros((target.vocab_size,) * k)
    if not batched:
        ids = torch.tensor([prompt])
        for seed in range(n):
            out = speculative_generate(target, draft, ids, tree, sampling, k, seed, [])
            counts[tuple(out.tokens)] += 1
        return counts
    torch.manual_seed(0)
    neighbours = [[2, 5], [4, 1, 1, 3], [3], [5, 5, 0, 1, 2, 3, 4]]
    for _ in range(n // 16):
        requests = [DecodeRequest(prompt, sampling, k, stop_token_ids=[]) for _ in range(16)]
        requests += [DecodeRequest(p, sampling, 2 + i, stop_token_ids=[]) for i, p in enumerate(neighbours)]
        for result in generate_batch(target, draft, requests, SpeculationPolicy({1: tree}), max_rows=6)[:16]:
            counts[tuple(result.tokens)] += 1
    return counts
