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

from griffin.static import width_bucket


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
    """The lengths every layer of one model shares, and the forward in progress: rows [lo, hi), each
    appending ``new`` entries. Lengths live in Python (no device sync to read them); ``uniform``
    forwards (one row, or rows of equal length) write and compact with slices, not index tensors."""

    def __init__(self, slots: int, capacity: int, device: torch.device):
        self.lengths = [0] * slots
        self.capacity, self.device = capacity, device
        self.lo, self.hi, self.new, self.width = 0, 0, 0, 0
        self.static = False  # the forward in progress is a compiled one (griffin.static)
        self.cols: Tensor | None = None  # (B, T) the columns a non-uniform or static forward writes

    def begin(self, lo: int, hi: int, new: int, static: bool = False) -> tuple[Tensor, int]:
        """Starts a forward over rows [lo, hi) appending ``new`` entries each: (starts (B,), width).
        ``static`` (a compiled forward): the width is bucketed (griffin.static.width_bucket) and
        every write goes through column indices, so the forward's shapes hold for a whole bucket."""
        self.lo, self.hi, self.new, self.static = lo, hi, new, static
        starts = self.lengths[lo:hi]
        self.width = max(starts) + new
        if static:
            self.width = width_bucket(self.width, self.capacity)
        starts_t = torch.tensor(starts, device=self.device)
        self.cols = None if self.uniform else starts_t[:, None] + torch.arange(new, device=self.device)
        return starts_t, self.width

    @property
    def uniform(self) -> bool:
        """Every row of the forward starts at one column (slice writes); never for a static forward."""
        starts = self.lengths[self.lo : self.hi]
        return min(starts) == max(starts) and not self.static

    def rows(self) -> Tensor:
        """(B, 1) the slot index of each row of the forward."""
        return torch.arange(self.lo, self.hi, device=self.device)[:, None]


class RowTensors:
    """One attention layer's keys and values for every slot: (S, Hk, capacity, Dh), zero-filled, on the
    layer's own device (a target split over GPUs: ``target.device_map``). Index tensors come from
    ``RowSlots`` on the first layer's device and are moved here (a no-op on one device)."""

    def __init__(self, shapes: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(shapes[0], dtype=dtype, device=device)  # (S, Hk, capacity, Dk)
        self.values = torch.zeros(shapes[1], dtype=dtype, device=device)  # (S, Hk, capacity, Dv): Dv may differ

    def _here(self, index: Tensor) -> Tensor:
        return index.to(self.keys.device, non_blocking=True)

    def write(self, slots: RowSlots, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values (B, Hk, T, Dh) of rows [lo, hi) at each row's end -> this forward's (B, Hk, W, Dh) views."""
        lo, hi, width = slots.lo, slots.hi, slots.width
        if width > self.keys.shape[2]:
            raise RuntimeError(f"KV cache overflow: need {width} > capacity {self.keys.shape[2]}")
        if slots.cols is None:  # every row starts at the same column
            start = slots.lengths[lo]
            self.keys[lo:hi, :, start : start + keys.shape[2]] = keys
            self.values[lo:hi, :, start : start + keys.shape[2]] = values
        else:
            rows, cols = self._here(slots.rows()), self._here(slots.cols)
            self.keys[rows, :, cols] = keys.transpose(1, 2)  # indexed (B, T, Hk, Dh)
            self.values[rows, :, cols] = values.transpose(1, 2)
        return self.keys[lo:hi, :, :width], self.values[lo:hi, :, :width]

    def keep(self, rows: Tensor, targets: Tensor, sources: Tensor) -> None:
        """Per row, copy columns ``sources`` to ``targets`` (both (B, K)): the accepted tree path."""
        rows, targets, sources = self._here(rows), self._here(targets), self._here(sources)
        picked_k, picked_v = self.keys[rows, :, sources], self.values[rows, :, sources]  # copies: no aliasing
        self.keys[rows, :, targets], self.values[rows, :, targets] = picked_k, picked_v

    def keep_one(self, slot: int, start: int, sources: Tensor) -> None:
        """One row's ``keep``: columns ``sources`` (K,) to [start, start + K)."""
        end, sources = start + sources.numel(), self._here(sources)
        self.keys[slot, :, start:end] = self.keys[slot, :, sources]  # rhs is a gathered copy
        self.values[slot, :, start:end] = self.values[slot, :, sources]

    def zero(self, rows: Tensor, cols: Tensor) -> None:
        """rows and cols (Z,) -> those entries are zero again."""
        rows, cols = self._here(rows), self._here(cols)
        self.keys[rows, :, cols] = 0
        self.values[rows, :, cols] = 0

    def zero_span(self, slot: int, start: int, end: int) -> None:
        self.keys[slot, :, start:end] = 0
        self.values[slot, :, start:end] = 0

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` columns (a longer request arrived); existing entries are kept."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])  # keys and values keep their widths
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
        return max(self.slots.lengths[self.slots.lo : self.slots.hi]) + query_length, 0

    def get_seq_length(self) -> int:
        return max(self.slots.lengths[self.slots.lo : self.slots.hi])

    def get_max_length(self) -> int:
        return self.tensors.keys.shape[2]


class RowCache(Cache):
    """Every layer's ``RowTensors`` plus the shared ``RowSlots``: the KV of S request slots. ``shapes``:
    each layer's (keys, values) shapes, (S, Hk, capacity, Dk) and (S, Hk, capacity, Dv); ``device``: one
    for every layer, or a list with each layer's (a target split over devices)."""

    def __init__(
        self,
        shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
        dtype: torch.dtype,
        device: torch.device | list[torch.device],
    ):
        devices = device if isinstance(device, list) else [device] * len(shapes)
        slots, _, capacity, _ = shapes[0][0]
        self.slots = RowSlots(slots, capacity, devices[0])
        self.tensors = [RowTensors(pair, dtype, d) for pair, d in zip(shapes, devices)]
        super().__init__(layers=[RowLayer(t, self.slots) for t in self.tensors])

    @classmethod
    def for_draft(cls, cfg, rows: int, capacity: int, dtype: torch.dtype, device: torch.device) -> "RowCache":
        """The one-layer cache of a GRIFFIN draft (``griffin.model.DraftConfig`` ``cfg``)."""
        shape = (rows, cfg.num_key_value_heads, capacity, cfg.head_dim)
        return cls([(shape, shape)], dtype, device)

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
            self.slots.capacity = capacity

    def buffers(self) -> list[Tensor]:
        """Every layer's key and value buffers (griffin.static.mark_static)."""
        return [t for tensors in self.tensors for t in (tensors.keys, tensors.values)]

    def advance(self, lo: int, counts: list[int], written: int) -> None:
        """Rows [lo, lo + B) keep the first ``counts`` of the ``written`` entries they just appended;
        the rest are zeroed (the invariant), then their lengths grow by ``counts``."""
        lengths = self.slots.lengths
        if len(counts) == 1:
            for tensors in self.tensors:
                tensors.zero_span(lo, lengths[lo] + counts[0], lengths[lo] + written)
        else:
            drops = [(b, lengths[lo + b] + j) for b, count in enumerate(counts) for j in range(count, written)]
            if drops:
                rows, cols = torch.tensor(drops, device=self.slots.device).T  # (Z,) each
                for tensors in self.tensors:
                    tensors.zero(lo + rows, cols)
        for b, count in enumerate(counts):
            lengths[lo + b] += count

    def keep_paths(self, lo: int, paths: list[list[int]], written: int) -> None:
        """After a tree verify of rows [lo, lo + B): keep each row's accepted nodes ``paths[b]`` (node
        indices, root first) at its end; everything else it wrote is zeroed.
        E.g. start 10, path [0, 2, 5] -> entries 10, 12, 15 move to 10, 11, 12; 13.. are zero."""
        lengths, device = self.slots.lengths, self.slots.device
        if len(paths) == 1:
            sources = lengths[lo] + torch.tensor(paths[0], device=device)
            for tensors in self.tensors:
                tensors.keep_one(lo, lengths[lo], sources)
        else:
            longest = max(len(p) for p in paths)
            # padding copies a column onto itself
            padded = [p + list(range(len(p), longest)) for p in paths]
            starts = torch.tensor(lengths[lo : lo + len(paths)], device=device)[:, None]  # (B, 1)
            sources = starts + torch.tensor(padded, device=device)  # (B, K)
            targets = starts + torch.arange(longest, device=device)[None, :]
            rows = torch.arange(lo, lo + len(paths), device=device)[:, None]
            for tensors in self.tensors:
                tensors.keep(rows, targets, sources)
        self.advance(lo, [len(p) for p in paths], written)

    def release(self, slot: int, last: int) -> None:
        """Slot ``slot`` leaves; the row in slot ``last`` (the last active one) moves into it, so active
        rows stay packed in [0, active) and every forward reads a view, never a gathered copy."""
        length = self.slots.lengths[last]
        for tensors in self.tensors:
            tensors.move(last, slot, length)
        self.slots.lengths[slot], self.slots.lengths[last] = length, 0
