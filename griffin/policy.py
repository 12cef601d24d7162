"""The serving engine's speculation policy: which tree a round drafts at each batch size (or plain
decoding), griffin.engine's ``SpeculationPolicy``. griffin tune-tree measures one on a machine
(pipeline.evaluate.tune); ``decode.policy`` sets it.
"""

from __future__ import annotations

from griffin.config import TreeConfig

# rounds a lower load must last before the policy follows it (a higher load counts at once): rows
# joining and leaving around a threshold would otherwise flip between trees and plain rounds, and
# each return to drafting costs a catch-up on the plain rounds' backlog
SWITCH_DOWN_ROUNDS = 4


class SpeculationPolicy:
    """The tree for each batch size: ``trees[b]`` for the largest listed b <= the batch; ``None`` =
    plain decoding. E.g. {1: wide, 2: small, 4: None}: batch 3 uses small, batch 8 decodes plainly.
    ``sampling_tree`` replaces a drafting tree in a round whose drafting rows all sample (T > 0): a
    draft token is then accepted only with the target's probability of it, so a smaller tree pays."""

    def __init__(self, trees: dict[int, TreeConfig | None], sampling_tree: TreeConfig | None = None):
        if not trees or min(trees) != 1:
            raise ValueError(f"a speculation policy needs an entry for batch size 1, got {sorted(trees)}")
        self.trees = dict(sorted(trees.items()))
        self.sampling_tree = sampling_tree

    def tree_for(self, batch: int, sampling: bool = False) -> TreeConfig | None:
        tree = [tree for size, tree in self.trees.items() if size <= batch][-1]
        return self.sampling_tree if tree is not None and sampling and self.sampling_tree is not None else tree

    @property
    def tree_slack(self) -> int:
        """KV entries a round may write past a row's length: the widest tree, plus its draft levels."""
        trees = [t for t in [*self.trees.values(), self.sampling_tree] if t]
        return max((t.total_tokens for t in trees), default=1) + max(
            ((t.depth - 1) * t.top_k for t in trees), default=0
        )

    def describe(self) -> dict[int, dict | None]:
        return {size: (tree.model_dump() if tree else None) for size, tree in self.trees.items()}
