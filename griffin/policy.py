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
    probability of it, so a smaller tree pays, and plain rows from a smaller batch on: such rounds
    follow ``sampling_trees`` (same form; ``sampling_table`` builds the one-tree rule), else ``trees``."""

    def __init__(self, trees: dict[int, TreeConfig | None], sampling_trees: dict[int, TreeConfig | None] | None = None):
        for table in (trees, sampling_trees):
            if table is not None and (not table or min(table) != 1):
                raise ValueError(f"a speculation policy needs an entry for batch size 1, got {sorted(table)}")
        self.trees = dict(sorted(trees.items()))
        self.sampling_trees = dict(sorted(sampling_trees.items())) if sampling_trees is not None else self.trees

    def tree_for(self, batch: int, sampling: bool = False) -> TreeConfig | None:
        return _entry(self.sampling_trees if sampling else self.trees, batch)

    @property
    def samples_otherwise(self) -> bool:
        """True when a round whose drafting rows all sample may draft another tree than a greedy one."""
        return self.sampling_trees != self.trees

    @property
    def tree_slack(self) -> int:
        """KV entries a round may write past a row's length: the widest tree, plus its draft levels."""
        trees = [t for t in [*self.trees.values(), *self.sampling_trees.values()] if t]
        return max((t.total_tokens for t in trees), default=1) + max(
            ((t.depth - 1) * t.top_k for t in trees), default=0
        )

    def describe(self) -> dict[int, dict | None]:
        return _described(self.trees)

    def describe_sampling(self) -> dict[int, dict | None]:
        """The trees of rounds whose drafting rows all sample, per batch size."""
        return _described(self.sampling_trees)


def sampling_table(
    trees: dict[int, TreeConfig | None], sampling_tree: TreeConfig | None
) -> dict[int, TreeConfig | None] | None:
    """The sampling rounds' trees when one ``sampling_tree`` replaces every drafting tree of ``trees``
    (plain sizes stay plain); None without one: those rounds follow ``trees``."""
    if sampling_tree is None:
        return None
    return {size: (sampling_tree if tree is not None else None) for size, tree in trees.items()}


def _described(table: dict[int, TreeConfig | None]) -> dict[int, dict | None]:
    return {size: (tree.model_dump() if tree else None) for size, tree in table.items()}


def _entry(table: dict[int, TreeConfig | None], batch: int) -> TreeConfig | None:
    """``table``'s entry for the largest batch size <= ``batch`` (sorted keys, the first is 1)."""
    return [tree for size, tree in table.items() if size <= batch][-1]
