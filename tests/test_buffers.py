"""The pool of window buffers (dali_zarr.io.buffers) and the CPU source that reads into it.

A pooled buffer must come back only once no array over it is left (a view, a batch output,
a torch tensor), never while the source keeps a batch alive for DALI, and the pool must hold
nothing after close().
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import dali_zarr as dz
from dali_zarr.graph.source import BatchSource
from dali_zarr.io import buffers
from dali_zarr.io.buffers import BufferPool
from tests.stores import batch_info, epoch_outputs

MB = 1 << 20


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_small_requests_are_plain_arrays():
    pool = BufferPool(min_nbytes=MB)
    a = pool.empty((10, 3), np.float32)
    assert a.shape == (10, 3) and a.dtype == np.float32 and a.flags.owndata
    del a
    assert pool.allocated == 0 and pool.idle_nbytes == 0


def test_buffer_returns_only_when_the_last_view_is_gone():
    pool = BufferPool(min_nbytes=MB)
    a = pool.empty((MB, 2), np.int32)
    assert a.shape == (MB, 2) and a.dtype == np.int32 and a.flags.c_contiguous
    assert a.flags.writeable
    at = _address(a)
    view = a[5:9].reshape(-1)  # a view of a view
    tensor = torch.from_numpy(a[100:200])
    del a
    gc.collect()
    assert pool.idle_nbytes == 0, "returned while views were alive"
    # a request now gets other memory
    other = pool.empty((MB, 2), np.int32)
    assert _address(other) != at
    del view
    gc.collect()
    assert pool.idle_nbytes == 0, "returned while a torch tensor was alive"
    del tensor
    gc.collect()
    assert pool.idle_nbytes >= 8 * MB
    again = pool.empty((MB, 2), np.float32)
    assert _address(again) == at and pool.reused == 1
    del other, again


def test_sizes_that_do_not_fit_get_new_memory():
    pool = BufferPool(min_nbytes=MB)
    pool.empty(4 * MB, np.uint8)  # let go at once
    assert pool.idle_nbytes > 0
    big = pool.empty(16 * MB, np.uint8)  # larger than the idle buffer
    small = pool.empty(MB, np.uint8)  # the idle buffer is over 1.5x this
    assert pool.reused == 0 and pool.allocated == 3
    del big, small


def test_idle_buffers_are_bounded_and_freed_on_close():
    pool = BufferPool(max_free=2, min_nbytes=MB)
    arrays = [pool.empty(MB * (i + 1), np.uint8) for i in range(4)]
    del arrays
    gc.collect()
    assert pool.idle_nbytes > 0 and len(pool._free) == 2
    late = pool.empty(2 * MB, np.uint8)
    pool.close()
    assert pool.idle_nbytes == 0
    del late  # in use at close: freed, not pooled
    gc.collect()
    assert not pool._returned, "a buffer let go after close() stayed held by the pool"
    assert pool.idle_nbytes == 0
    assert pool.empty(2 * MB, np.uint8).flags.owndata  # closed: plain arrays


def test_a_buffer_let_go_while_its_pool_is_locked_does_not_wait_for_the_lock():
    """A finalizer that took the pool's lock waited forever where the garbage collection
    that ran it was set off, on the same thread, while that lock was held (allocation in
    ``_take`` or when buffers come back)."""
    pool = BufferPool(min_nbytes=MB)

    def let_go_under_the_lock():
        held = pool.empty(2 * MB, np.uint8)
        cycle = [held]
        cycle.append(cycle)  # freed only by the cyclic collector, as a dropped loader's is
        del held, cycle
        with pool._lock:
            gc.collect()  # runs the finalizer here, on the thread that holds the lock

    worker = threading.Thread(target=let_go_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the finalizer waited for the lock its own thread held"
    assert pool.idle_nbytes >= 2 * MB  # and the buffer came back


def test_module_empty_takes_from_the_active_pool_on_this_thread_only():
    pool = BufferPool(min_nbytes=MB)
    assert buffers.empty(2 * MB, np.uint8).flags.owndata
    with pool.active():
        a = buffers.empty(2 * MB, np.uint8)
        assert buffers.pooled() is pool
    assert buffers.pooled() is None
    assert not a.flags.owndata and pool.allocated == 1
    del a


def _sampler():
    return dz.ChunkSampler(
        chunk_size=16, preload_nchunks=4, batch_size=16, shuffle=True, drop_last=False, seed=3
    )


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_source_reuses_windows_but_never_a_batch_dali_may_hold(odd_csr_store, output):
    """Every window array pooled (min_nbytes 0): the served batches equal those of a source
    without reuse; the batches the source keeps for DALI (the last prefetch_queue_depth +
    2) stay as served, and no other window is read into their memory; earlier windows'
    memory is reused. The test holds copies and addresses only, never the arrays (but for
    the batch just served, which the source keeps for DALI anyway)."""
    ds = dz.open_dataset(odd_csr_store)
    pooled = BatchSource(ds, _sampler(), output=output, obs=[], return_index=True)
    pooled._buffers = BufferPool(min_nbytes=0)
    plain = BatchSource(ds, _sampler(), output=output, obs=[], return_index=True)
    plain._buffers = BufferPool(min_nbytes=2**62)
    keep = pooled._alive.maxlen
    assert keep == 2 + 2
    served: list[tuple[tuple, list, list]] = []  # (window, window arrays' spans, copies)
    for epoch in range(3):
        for src in (pooled, plain):
            src.bind_epoch(epoch, epoch, next_epoch=epoch + 1)
        plan = pooled.plan(epoch)
        for it, got in epoch_outputs(pooled, plain, epoch):
            want = plain(batch_info(epoch, it))
            for name, g, w in zip(pooled.names, got, want, strict=True):
                if name != "nnz_hint":
                    np.testing.assert_array_equal(g[0], w[0], err_msg=name)
            window = (epoch, plan.window_of_batch(it)[0])
            arrays = [
                g[0]
                for name, g in zip(pooled.names, got, strict=True)
                if name in ("data", "indices", "indptr", "values")
            ]
            spans = [(_address(a), _address(a) + a.nbytes) for a in arrays if a.nbytes]
            for before, their_spans, _ in served[-(keep - 1) :]:
                if before == window:
                    continue
                for lo, hi in spans:
                    for b_lo, b_hi in their_spans:
                        assert hi <= b_lo or b_hi <= lo, (
                            f"window {window} read into the memory of window {before}, "
                            "whose batch DALI may still read"
                        )
            served.append((window, spans, [g[0].copy() for g in got]))
            del got, want, arrays
            gc.collect()  # every array the source dropped goes now
            for outputs, (_, _, copies) in zip(pooled._alive, served[-keep:], strict=True):
                for x, c in zip(outputs, copies, strict=True):
                    np.testing.assert_array_equal(x, c, err_msg=f"epoch {epoch} batch {it}")
    assert pooled._buffers.reused > 0, "no window memory was reused"
    assert plain._buffers.reused == plain._buffers.allocated == 0
    pooled.close()
    plain.close()
    assert pooled._buffers.idle_nbytes == 0
