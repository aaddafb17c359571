"""Immutable plan objects: what one rank reads and yields in one epoch.

A plan is data, not behaviour: it is computed from (seed, epoch, n_obs, rank, world_size,
settings) alone, so every process can rebuild any part of it without talking to the others,
and a loader can plan window ``w + 1`` (DALI look-ahead) or jump to batch ``i`` (resume)
without replaying the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np

from dali_zarr.planning.partition import TAG_WINDOW, ranges_to_rows, slice_ranges

__all__ = ["EpochPlan", "WindowPlan", "iter_batches"]


def _frozen(a: np.ndarray) -> np.ndarray:
    """Make an int64 array read-only, so a shared plan cannot be corrupted by a caller."""
    a = np.asarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """The rows read together in one go, and how they are shuffled and cut into batches.

    Local position ``p`` (``0 <= p < n_rows``) is the ``p``-th row of the concatenation of
    ``row_ranges``; that is the order a reader produces them in, so the shuffle is a cheap
    gather on already-loaded data instead of random reads.
    """

    index: int
    row_ranges: np.ndarray  # (k, 2) int64 global [start, stop), read order
    order: np.ndarray  # (n_rows,) int64 permutation of local positions
    batch_offsets: np.ndarray  # (n_batches + 1,) int64 offsets into `order`
    first_batch: int  # epoch-level index of batch 0 of this window
    chunk_size: int = field(default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_ranges", _frozen(self.row_ranges).reshape(-1, 2))
        object.__setattr__(self, "order", _frozen(self.order))
        object.__setattr__(self, "batch_offsets", _frozen(self.batch_offsets))

    @property
    def n_rows(self) -> int:
        """Rows in this window (sum of the range lengths)."""
        return int(self.order.shape[0])

    @property
    def n_batches(self) -> int:
        """Batches cut from this window."""
        return int(self.batch_offsets.shape[0]) - 1

    def batch_positions(self, j: int) -> np.ndarray:
        """Local positions (indices into the loaded window) of batch ``j``."""
        if not 0 <= j < self.n_batches:
            raise IndexError(f"batch {j} out of range for a window of {self.n_batches} batches")
        return self.order[self.batch_offsets[j] : self.batch_offsets[j + 1]]

    @cached_property
    def _global_rows(self) -> np.ndarray:
        return _frozen(ranges_to_rows(self.row_ranges))

    def global_rows(self) -> np.ndarray:
        """Global row id of every local position (read order), shape ``(n_rows,)``."""
        return self._global_rows

    def batch_global_rows(self, j: int) -> np.ndarray:
        """Global row ids of batch ``j``, in the order they are yielded."""
        return self._global_rows[self.batch_positions(j)]

    def chunk_ids(self) -> np.ndarray:
        """Chunk id of each entry of ``row_ranges`` (every range lies inside one chunk)."""
        if self.chunk_size <= 0:
            raise ValueError("this WindowPlan was built without chunk_size")
        return self.row_ranges[:, 0] // self.chunk_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowPlan):
            return NotImplemented
        return (
            self.index == other.index
            and self.first_batch == other.first_batch
            and self.chunk_size == other.chunk_size
            and np.array_equal(self.row_ranges, other.row_ranges)
            and np.array_equal(self.order, other.order)
            and np.array_equal(self.batch_offsets, other.batch_offsets)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """What one rank delivers in one epoch, stored compactly as global row ranges.

    ``row_ranges`` holds one ``[start, stop)`` per chunk (or chunk part) in the order the rank
    reads them, already truncated to ``n_rows``; ``range_offsets[i]`` is the position of range
    ``i`` in the rank's virtual row sequence. Memory is O(chunks of the rank), never O(rows).
    Windows are derived on demand by :meth:`window`, in any order.
    """

    epoch: int
    rank: int
    world_size: int
    n_obs: int
    batch_size: int
    seed: int
    n_batches: int
    n_windows: int
    n_rows: int
    rows_skipped: int
    chunk_size: int
    window_rows: int
    shuffle: bool
    row_ranges: np.ndarray = field(repr=False)  # (k, 2) int64
    range_offsets: np.ndarray = field(repr=False)  # (k + 1,) int64, [0] == 0, [-1] == n_rows
    # Rows of this epoch delivered before this plan starts: 0 for a fresh epoch; for the
    # rest of an epoch resumed on another number of ranks (planning/resume.py), the rows the
    # earlier run delivered. Always rows_done + (sum of n_rows over ranks) + rows_skipped == n_obs.
    rows_done: int = 0
    # Key of the window shuffle streams (after seed and epoch); resumed epochs use their own.
    stream: tuple[int, ...] = (TAG_WINDOW,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_ranges", _frozen(self.row_ranges).reshape(-1, 2))
        object.__setattr__(self, "range_offsets", _frozen(self.range_offsets))

    @property
    def batches_per_window(self) -> int:
        """Batches in every window but possibly the last."""
        return self.window_rows // self.batch_size

    def window(self, w: int) -> WindowPlan:
        """Plan window ``w`` alone: O(window) work, independent of any other window."""
        if not 0 <= w < self.n_windows:
            raise IndexError(f"window {w} out of range for an epoch of {self.n_windows} windows")
        lo = w * self.window_rows
        hi = min(lo + self.window_rows, self.n_rows)
        ranges, _ = slice_ranges(self.row_ranges, self.range_offsets, lo, hi)
        n = hi - lo
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, *self.stream, self.rank, w])
            order = rng.permutation(n).astype(np.int64, copy=False)
        else:
            order = np.arange(n, dtype=np.int64)
        offsets = np.append(np.arange(0, n, self.batch_size, dtype=np.int64), np.int64(n))
        return WindowPlan(
            index=w,
            row_ranges=ranges,
            order=order,
            batch_offsets=offsets,
            first_batch=w * self.batches_per_window,
            chunk_size=self.chunk_size,
        )

    def window_of_batch(self, i: int) -> tuple[int, int]:
        """``(window index, batch index inside that window)`` of epoch-level batch ``i``."""
        if not 0 <= i < self.n_batches:
            raise IndexError(f"batch {i} out of range for an epoch of {self.n_batches} batches")
        return divmod(i, self.batches_per_window)

    def windows(self) -> Iterator[WindowPlan]:
        """All windows in order."""
        for w in range(self.n_windows):
            yield self.window(w)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EpochPlan):
            return NotImplemented
        for f in fields(self):
            x, y = getattr(self, f.name), getattr(other, f.name)
            same = np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
            if not same:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


def iter_batches(plan: EpochPlan, start_batch: int = 0) -> Iterator[np.ndarray]:
    """Yield the global row ids of each batch of ``plan``, from ``start_batch`` on (resume)."""
    if plan.n_batches == 0 or start_batch >= plan.n_batches:
        return
    w0, j0 = plan.window_of_batch(start_batch)
    for w in range(w0, plan.n_windows):
        win = plan.window(w)
        rows = win.global_rows()
        for j in range(j0 if w == w0 else 0, win.n_batches):
            yield rows[win.batch_positions(j)]
