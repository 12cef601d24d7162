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
    In a round whose drafting rows all sample (T > 0) a draft token is accepted only with the target's
    probability of it, so a smaller tree pays, and plain rows from a smaller batch on:
    ``sampling_trees`` (same form) then applies when given, else ``sampling_tree`` replaces a drafting
    tree of ``trees``."""

    def __init__(
        self,
        trees: dict[int, TreeConfig | None],
        sampling_tree: TreeConfig | None = None,
        sampling_trees: dict[int, TreeConfig | None] | None = None,
    ):
        for table in (trees, sampling_trees):
            if table is not None and (not table or min(table) != 1):
                raise ValueError(f"a speculation policy needs an entry for batch size 1, got {sorted(table)}")
        self.trees = dict(sorted(trees.items()))
        self.sampling_tree = sampling_tree
        self.sampling_trees = dict(sorted(sampling_trees.items())) if sampling_trees is not None else None

    def tree_for(self, batch: int, sampling: bool = False) -> TreeConfig | None:
        if sampling and self.sampling_trees is not None:
            return _entry(self.sampling_trees, batch)
        tree = _entry(self.trees, batch)
        return self.sampling_tree if tree is not None and sampling and self.sampling_tree is not None else tree

    @property
    def samples_otherwise(self) -> bool:
        """True when a round whose drafting rows all sample may draft another tree than a greedy one."""
        return self.sampling_tree is not None or self.sampling_trees is not None

    @property
    def tree_slack(self) -> int:
        """KV entries a round may write past a row's length: the widest tree, plus its draft levels."""
        sampling = list((self.sampling_trees or {}).values())
        trees = [t for t in [*self.trees.values(), self.sampling_tree, *sampling] if t]
        return max((t.total_tokens for t in trees), default=1) + max(
            ((t.depth - 1) * t.top_k for t in trees), default=0
        )

    def describe(self) -> dict[int, dict | None]:
        return _described(self.trees)

    def describe_sampling(self) -> dict[int, dict | None] | None:
        """The sampling rounds' trees per batch size; None when they follow ``sampling_tree``'s rule."""
        return None if self.sampling_trees is None else _described(self.sampling_trees)


def _described(table: dict[int, TreeConfig | None]) -> dict[int, dict | None]:
    return {size: (tree.model_dump() if tree else None) for size, tree in table.items()}


def _entry(table: dict[int, TreeConfig | None], batch: int) -> TreeConfig | None:
    """``table``'s entry for the largest batch size <= ``batch`` (sorted keys, the first is 1)."""
    return [tree for size, tree in table.items() if size <= batch][-1]
