"""Reused host buffers for the arrays a window is read into.

A CPU window is two arrays of tens of MB (a CSR window of 8,192 cells x 1,500 values: 49 MB
of values, 49 MB of column ids). ``np.empty`` of that size is a fresh ``mmap``, and the decode
writing into it takes a page fault per huge page and the kernel zeroes every byte first:
~10 % of the CPU path's time on 2 cores. A :class:`BufferPool` keeps the memory of windows
already served and hands it out again.

When a buffer may be reused: a handed-out array ``A`` is made over the pooled memory with
``np.frombuffer`` (its base is a memoryview, not an ndarray), so every view of it -- the
window's arrays, a batch's outputs, a torch tensor made of them -- holds ``A`` and ``A``
dies with the last of them. A buffer is back in the pool only when ``A`` is garbage
(``weakref.finalize``), that is exactly when today's ``np.empty`` memory would have been
freed. The CPU source keeps every array it handed to DALI (``no_copy``) referenced for as
long as DALI may read it (``BatchSource._alive``), so nothing DALI may still read is ever
written again; nothing else is assumed.

Memory: the arrays in use are those the loader holds anyway; the pool adds at most
``max_free`` idle buffers and frees them all on :meth:`BufferPool.close` (a buffer in use
then is freed, not pooled, when its last view goes). Only requests of at least
``min_nbytes`` (32 MiB) are pooled; smaller ones are plain ``np.empty``: glibc serves
them from its heap, reused without page faults once the first is freed (its mmap threshold
adapts up to 32 MiB), and the pool was slower there (the demo store's ~5 MB windows, dense
output: 221k against 272k rows/s without it, alternating); above 32 MiB every ``np.empty``
is a fresh ``mmap`` (the benchmark store's 49 MB windows), where the pool gains.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import weakref
from collections.abc import Iterator

import numpy as np

__all__ = ["BufferPool", "empty", "pooled"]

_active = threading.local()


class BufferPool:
    """Host buffers handed out as arrays and taken back when the last view of one is gone."""

    #: a buffer is given out for requests of at least ``1 / MAX_SLACK`` of its size
    MAX_SLACK = 1.5
    #: new buffers are this much larger than asked (windows differ by a few % in size)
    HEADROOM = 1.0625
    GRANULE = 1 << 21  # large sizes rounded up to whole huge pages, others to pages

    def __init__(self, *, max_free: int = 8, min_nbytes: int = 1 << 25) -> None:
        self.max_free = int(max_free)
        self.min_nbytes = int(min_nbytes)
        self._free: list[np.ndarray] = []  # idle buffers (uint8), smallest first
        # buffers let go, not yet in _free: a finalizer only appends here (atomic, no lock).
        # It may run inside a garbage collection that allocation under the lock set off,
        # on the thread that holds it, which a finalizer taking the lock would wait on forever
        self._returned: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self.allocated = 0  # buffers made (a measure of how often the pool could not serve)
        self.reused = 0  # requests served from the pool

    def empty(self, shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised C-contiguous array, from pooled memory when it is large enough."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < max(self.min_nbytes, 1) or self._closed:
            return np.empty(shape, dtype=dtype)
        buf = self._take(nbytes)
        # np.frombuffer over a memoryview: views of `out` keep `out` (not `buf`) alive, so
        # `out` is garbage only once no view of the memory is left anywhere
        out = np.frombuffer(buf.data, dtype=np.uint8, count=nbytes)
        weakref.finalize(out, self._give_back, buf)
        return out.view(dtype).reshape(shape)

    def _give_back(self, buf: np.ndarray) -> None:
        """A finalizer's hand-back (any thread; deque operations are atomic): after close it
        is dropped, or the buffers of the last batches stayed held by a closed loader."""
        self._returned.append(buf)
        if self._closed:  # checked after the append: a close() in between cleared it
            self._returned.clear()

    def _capacity(self, nbytes: float) -> int:
        """The size of a new buffer for ``nbytes``."""
        granule = self.GRANULE if nbytes >= 16 * self.GRANULE else 4096
        return -(-int(nbytes * self.HEADROOM) // granule) * granule

    def _take(self, nbytes: int) -> np.ndarray:
        largest = self._capacity(nbytes * self.MAX_SLACK)
        with self._lock:
            self._take_returned()
            for i, buf in enumerate(self._free):  # the smallest that fits
                if nbytes <= buf.size <= largest:
                    self.reused += 1
                    return self._free.pop(i)
            self.allocated += 1
        return np.empty(self._capacity(nbytes), dtype=np.uint8)

    def _take_returned(self) -> None:
        """Move the buffers let go since into the pool (the lock held)."""
        if not self._returned:
            return
        while self._returned:
            buf = self._returned.popleft()
            if not self._closed:
                self._free.append(buf)
        self._free.sort(key=lambda b: b.size)
        # keep the largest: they serve any smaller request too
        del self._free[: max(0, len(self._free) - self.max_free)]

    @property
    def idle_nbytes(self) -> int:
        with self._lock:
            self._take_returned()
            return sum(b.size for b in self._free)

    def close(self) -> None:
        """Free the idle buffers; those in use are freed, not pooled, when let go."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._returned.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[BufferPool]:
        """Make :func:`empty` on this thread take from this pool inside the block."""
        previous = getattr(_active, "pool", None)
        _active.pool = self
        try:
            yield self
        finally:
            _active.pool = previous


def pooled() -> BufferPool | None:
    """The pool made active on this thread (:meth:`BufferPool.active`), if any."""
    return getattr(_active, "pool", None)


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """``np.empty``, from the pool active on this thread where there is one."""
    pool = pooled()
    return np.empty(shape, dtype=dtype) if pool is None else pool.empty(shape, dtype)
