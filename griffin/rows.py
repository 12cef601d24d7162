"""KV caches with one row per request slot, for decoding several requests in one forward (griffin.engine).

Every row has its own length: a forward over rows [lo, hi) writes row b's T new entries at
[length_b, length_b + T) and attends over the first ``width`` columns, ``width`` = the longest row's
end; ``row_mask`` hides each row's columns past its own end. Invariant: every column at or past a
row's length holds zeros. Masked attention weights are exactly 0, but 0 * NaN is NaN, so a stale
non-finite entry (e.g. an overflowed bf16 request that left its slot) would poison its neighbours
in the row's padding; every write that a row does not keep is zeroed again (``zero_tail``).

Shape legend: S slots, B rows in a forward, T new tokens per row, W attended width, Hk kv heads,
Dh head dim, E entries of a block.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


def row_mask(lengths: Tensor, block: Tensor, width: int) -> Tensor:
    """Each row sees its prefix [0, length_b) and, from column length_b on, its own ``block``.

    lengths (B,); block (B, T, E) bool, True = attend, placed at columns [length_b, length_b + E);
    returns (B, T, width) bool. E.g. length 2, block [[1, 0], [1, 1]], width 5 ->
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]."""
    cols = torch.arange(width, device=block.device)  # (W,)
    relative = cols[None, :] - lengths[:, None]  # (B, W): column index inside the block
    inside = (relative >= 0) & (relative < block.shape[-1])  # (B, W)
    placed = block.gather(-1, relative.clamp(0, block.shape[-1] - 1)[:, None, :].expand(-1, block.shape[1], -1))
    return (relative < 0)[:, None, :] | (placed & inside[:, None, :])  # (B, T, W)


class RowSlots:
    """The lengths every layer of one model shares, and the window of the forward in progress."""

    def __init__(self, slots: int, device: torch.device):
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # (S,)
        self.lo, self.hi, self.new = 0, 0, 0  # the forward's rows [lo, hi) and its new tokens per row

    def begin(self, lo: int, hi: int, new: int) -> tuple[Tensor, int]:
        """A forward over rows [lo, hi) appending ``new`` entries each: (starts (B,), width)."""
        self.lo, self.hi, self.new = lo, hi, new
        starts = self.lengths[lo:hi]
        return starts, int(starts.max()) + new

    def write_positions(self) -> Tensor:
        """(B, T) the columns this forward writes: row b's [length_b, length_b + T)."""
        starts = self.lengths[self.lo : self.hi]
        return starts[:, None] + torch.arange(self.new, device=starts.device)[None, :]


class RowTensors:
    """One attention layer's keys and values for every slot: (S, Hk, capacity, Dh), zero-filled."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, slots: RowSlots, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values (B, Hk, T, Dh) of rows [lo, hi) at each row's end -> this forward's (B, Hk, W, Dh) views."""
        cols = slots.write_positions()  # (B, T)
        if int(cols.max()) >= self.keys.shape[2]:
            raise RuntimeError(f"KV cache overflow: need {int(cols.max()) + 1} > capacity {self.keys.shape[2]}")
        rows = torch.arange(slots.lo, slots.hi, device=cols.device)[:, None]  # (B, 1)
        self.keys[rows, :, cols] = keys.transpose(1, 2)  # indexed (B, T, Hk, Dh)
        self.values[rows, :, cols] = values.transpose(1, 2)
        width = int(cols[:, -1].max()) + 1
        return self.keys[slots.lo : slots.hi, :, :width], self.values[slots.lo : slots.hi, :, :width]

    def keep(self, rows: Tensor, targets: Tensor, sources: Tensor) -> None:
        """Per row, copy columns ``sources`` to ``targets`` (both (B, K)): the accepted tree path."""
        picked_k, picked_v = self.keys[rows, :, sources], self.values[rows, :, sources]  # copies: no aliasing
        self.keys[rows, :, targets], self.values[rows, :, targets] = picked_k, picked_v

    def zero(self, rows: Tensor, cols: Tensor) -> None:
        """rows (B, 1), cols (B, K) -> those entries are zero again."""
        self.keys[rows, :, cols] = 0
        self.values[rows, :, cols] = 0

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` columns (a longer request arrived); existing entries are kept."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot ``src``'s first ``length`` columns to slot ``dst``, then slot ``src`` is all zeros."""
        for tensor in (self.keys, self.values):
            tensor[dst] = 0
            tensor[dst, :, :length] = tensor[src, :, :length]
            tensor[src] = 0


class RowLayer(CacheLayerMixin):
    """One target layer's KV as transformers' ``Cache`` layer; the lengths live in ``RowSlots``."""

    is_sliding = False

    def __init__(self, tensors: RowTensors, slots: RowSlots):
        super().__init__()
        self.tensors, self.slots = tensors, slots
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # buffers exist from the start

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.tensors.write(self.slots, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        starts = self.slots.lengths[self.slots.lo : self.slots.hi]
        return int(starts.max()) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.slots.lengths[self.slots.lo : self.slots.hi].max())

    def get_max_length(self) -> int:
        return self.tensors.keys.shape[2]


class RowCache(Cache):
    """Every layer's ``RowTensors`` plus the shared ``RowSlots``: the KV of S request slots."""

    def __init__(self, shapes: list[tuple[int, int, int, int]], dtype: torch.dtype, device: torch.device):
        self.slots = RowSlots(shapes[0][0], device)
        self.tensors = [RowTensors(shape, dtype, device) for shape in shapes]
        super().__init__(layers=[RowLayer(t, self.slots) for t in self.tensors])

    @classmethod
    def for_draft(cls, cfg, rows: int, capacity: int, dtype: torch.dtype, device: torch.device) -> "RowCache":
        """The one-layer cache of a GRIFFIN draft (``griffin.model.DraftConfig`` ``cfg``)."""
        return cls([(rows, cfg.num_key_value_heads, capacity, cfg.head_dim)], dtype, device)

    @property
    def capacity(self) -> int:
        return self.tensors[0].keys.shape[2]

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """A one-layer cache's write (the draft's attention calls it): as ``RowLayer.update``."""
        return self.tensors[0].write(self.slots, keys, values)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self.capacity:
            for tensors in self.tensors:
                tensors.grow(capacity)

    def advance(self, lo: int, counts: Tensor, written: int) -> None:
        """Rows [lo, lo + B) keep the first ``counts`` (B,) of the ``written`` entries they just appended;
        the rest are zeroed (the invariant), then their lengths grow by ``counts``."""
        starts = self.slots.lengths[lo : lo + counts.numel()]  # (B,)
        dropped = torch.arange(written, device=counts.device)[None, :] >= counts[:, None]  # (B, written)
        rows, offsets = dropped.nonzero(as_tuple=True)  # (Z,) each
        if rows.numel():
            for tensors in self.tensors:
                tensors.zero(lo + rows, starts[rows] + offsets)
        self.slots.lengths[lo : lo + counts.numel()] += counts

    def keep_paths(self, lo: int, paths: Tensor, path_lengths: Tensor, written: int) -> None:
        """After a tree verify of rows [lo, lo + B): keep each row's accepted nodes ``paths`` (B, K)
        (node indices, root first, padded) at its end; everything else it wrote is zeroed.
        E.g. start 10, path [0, 2, 5] -> entries 10, 12, 15 move to 10, 11, 12; 13.. are zero."""
        B = paths.shape[0]
        rows = torch.arange(lo, lo + B, device=paths.device)[:, None]  # (B, 1)
        starts = self.slots.lengths[lo : lo + B][:, None]  # (B, 1)
        offsets = torch.arange(paths.shape[1], device=paths.device)[None, :]  # (1, K)
        real = offsets < path_lengths[:, None]  # (B, K)
        sources = starts + torch.where(real, paths, offsets)  # padding copies a column onto itself
        for tensors in self.tensors:
            tensors.keep(rows, starts + offsets, sources)
        self.advance(lo, path_lengths, written)

    def release(self, slot: int, last: int) -> None:
        """Slot ``slot`` leaves; the row in slot ``last`` (the last active one) moves into it, so active
        rows stay packed in [0, active) and every forward reads a view, never a gathered copy."""
        length = int(self.slots.lengths[last])
        for tensors in self.tensors:
            tensors.move(last, slot, length)
        self.slots.lengths[slot], self.slots.lengths[last] = length, 0
