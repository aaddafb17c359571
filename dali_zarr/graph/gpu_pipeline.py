"""The GPU graph: what ``Loader(device="gpu")`` builds.

Same shape as the CPU path (:mod:`dali_zarr.graph.pipeline`): one DALI sample is one whole
minibatch, the callback is pure in ``(epoch, iteration)``, the ops read the window through
``pos``. What changes:

* windows live on the device. :class:`GpuBatchSource` reads each window into a slot of a
  :class:`BufferRing` of device buffers, on the prefetch thread, ``prefetch_windows``
  windows ahead of the consumer, with the window reader of
  :mod:`dali_zarr.graph.device_window` (kvikio + nvCOMP through :mod:`dali_zarr.io.gpu`,
  one joint plan per array however many stores of a collection the window touches, and
  the plans of all arrays run together: reads in flight at once, one decode call per
  codec kind; host decode + one copy where needed);
* a gene panel (:class:`~dali_zarr.data.features.FeatureSubset`, also one split into
  subsets or in a collection) is read as its stores' windows and kept on the device: a
  CSR store's ids are mapped to the panel by one launch per window (dropped columns go
  past the panel's width, which densify skips; with CSR output the launch also cuts each
  row to its kept entries in place, whose kept lengths come back to the host to size the
  batches); a dense store's panel columns are copied out of the stored window by one
  launch per window, and the graph gathers the panel-wide rows;
* there are two ``external_source`` ops fed by one :class:`GpuBatchSource`: a GPU one for
  the window arrays (``no_copy=True``: DALI reads our slot in place) and a CPU one for the
  small per-batch arrays (``pos``, the batch's CSR row starts, obs columns, index), which
  DALI copies to the device with ``.gpu()``;
* the ops are the numba.cuda kernels of :mod:`dali_zarr.graph.cuda_kernels`, one launch per
  minibatch each (plus one for a half-precision output).

Ring sizing: a window's slot is handed to DALI without a copy, so it must not be
overwritten while DALI may still read it. A slot is recycled only after
``prefetch_queue_depth + 2`` further batches were served from other windows (DALI runs at
most ``prefetch_queue_depth`` iterations ahead of the consumer). By then DALI has handed
that batch out, and our iterators take DALI's outputs host-synchronised (``run()`` and
``share_outputs()`` without a stream), so every kernel that read the slot has finished.
Still, by default the device is also synchronised before a recycled slot is written
(belt and braces: DALI's stream is not ours to wait on; this costs the reader thread a
wait, never the consumer). ``DALI_ZARR_RING_SYNC=none`` drops that wait (``ring_sync`` in
:mod:`dali_zarr.graph.window_backends`). It ran on an H200 (2026-11-26): every ``gpu``
test passed with it and it was 4-16 % faster, but it stays opt-in, since a race would give
wrong data silently and the wait costs a reader thread, not the consumer.
``prefetch_windows + prefetch_queue_depth + 3`` slots cover the windows being read ahead,
the current one and every window DALI may still hold, so the reader never waits on the
consumer for a slot.

With the host backend (``window_backends.HostBackend``) the same source, ring and graph run
on DALI's CPU backend with the CPU kernels: that is how CI tests this module end to end
without a GPU. The CUDA backend and the CUDA kernels inside DALI need one; they ran on an
H100 (2026-11-22) and an H200 (2026-11-26; README "GPU path").

Windows are read on ``read_threads`` threads at once (default 4; each with its own executor,
stream and buffers in the CUDA backend), so one window's file reads overlap another's
decode; the source reads at least ``read_threads`` windows ahead for that.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvidia.dali.pipeline import Pipeline

from dali_zarr.data.dataset import Dataset, sub_indptr
from dali_zarr.distributed import local_rank
from dali_zarr.errors import ConfigError
from dali_zarr.graph import cuda_kernels
from dali_zarr.graph.device_window import DeviceWindowReader
from dali_zarr.graph.pipeline import (
    GraphOps,
    Transform,
    assemble_pipeline,
    declare_ops,
    source_nodes,
)
from dali_zarr.graph.source import (
    BatchSource,
    Output,
    Planner,
    Window,
    WindowKey,
    obs_source_name,
    validate_prefetch_windows,
)
from dali_zarr.graph.window_backends import CudaBackend
from dali_zarr.io.gpu import probe_gpu
from dali_zarr.planning.partition import validate_count

# ---------------------------------------------------------------------------- host helpers


def gpu_source_names(
    layout: str, output: Output, obs: list[str], return_index: bool
) -> tuple[list[str], list[str]]:
    """(host names, device names) of the GPU callback's outputs, in order."""
    host = ["pos"]
    if layout == "csr" and output == "csr":
        host += ["nnz_hint", "batch_indptr"]
    host += [*map(obs_source_name, obs), *(["index"] if return_index else [])]
    device = ["data", "indices", "indptr"] if layout == "csr" else ["values"]
    return host, device


# ---------------------------------------------------------------------------- ring


@dataclass(eq=False)
class Lease:
    """One slot of the ring, held by one window until it is retired."""

    slot: int
    buf: Any
    key: WindowKey | None = None  # the window's key in the source's window cache
    last_served: int | None = None  # serve counter of the last batch handed out from it


class RingClosed(RuntimeError):
    """The ring was closed (the loader shut down) while a reader waited for a slot."""


class BufferRing:
    """``n_slots`` reusable device buffers (grown on demand, never shrunk)."""

    def __init__(self, n_slots: int, backend: Any) -> None:
        self.backend = backend
        self._bufs: list[Any] = [None] * n_slots  # None until first handed out
        self._free = list(range(n_slots))
        self._cond = threading.Condition()
        self._closed = False
        self.waits = 0  # times acquire() waited for the consumer (none free after reclaim)

    @property
    def n_slots(self) -> int:
        return len(self._bufs)

    @property
    def n_free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, nbytes: int, reclaim: Callable[[], None] = lambda: None) -> Lease:
        """A slot of at least ``nbytes``; calls ``reclaim`` and waits while none is free.

        Raises :class:`RingClosed` once :meth:`close` was called: a reader waiting for a
        consumer that has stopped would otherwise keep its thread, and the process, alive.
        """
        while True:
            with self._cond:
                if self._closed:
                    raise RingClosed(
                        "the loader was closed while a window waited for a device buffer"
                    )
                if self._free:
                    slot = self._free.pop(0)
                    break
            reclaim()  # slots of windows retired or dropped since the last reclaim
            with self._cond:
                if not self._free and not self._closed:  # every slot holds a window
                    self.waits += 1  # DALI may still read
                    self._cond.wait(0.05)
        try:
            buf = self._bufs[slot]
            if buf is not None:  # handed out before: DALI may still be reading it
                self.backend.before_reuse()
            if buf is None or buf.size < nbytes:
                self._bufs[slot] = None  # let the old buffer go before the larger one is made
                self._bufs[slot] = buf = self.backend.alloc(
                    max(nbytes, 2 * (0 if buf is None else buf.size))
                )
        except BaseException:
            # a slot lost here (out of memory, a CUDA error) would shrink the ring for good,
            # and a ring short of slots waits forever on windows only the consumer frees
            self.release(Lease(slot, None))
            raise
        return Lease(slot, buf)

    def abandon(self, lease: Lease) -> None:
        """Give back a slot whose filling failed part way. Uploads and launches into it may
        still be queued (the executor only waits for its own reads on an error), so wait for
        them first: the slot's next owner, with ``DALI_ZARR_RING_SYNC=none``, would race them."""
        with contextlib.suppress(Exception):  # a sticky CUDA error: the caller's is the one
            self.backend.finish()
        self.release(lease)

    def release(self, lease: Lease) -> None:
        with self._cond:
            if lease.slot not in self._free:
                self._free.append(lease.slot)
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting :meth:`acquire` with :class:`RingClosed`; no slot is handed out
        again."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drop_buffers(self) -> None:
        """Let the slots' device buffers go, once closed and no DALI run can read them: the
        queued uploads and kernels into them are waited for first (a reader thread still
        filling one holds its own reference, freed when it is done)."""
        with contextlib.suppress(Exception):  # a sticky CUDA error: nothing left to wait for
            self.backend.wait_all()  # the reader threads' streams, not this thread's
        with self._cond:
            assert self._closed, "drop_buffers() of an open ring"
            self._bufs = [None] * len(self._bufs)


# ---------------------------------------------------------------------------- window reader


@dataclass(frozen=True)
class DeviceWindow(Window):
    """A window whose arrays live in a ring slot; ``host_indptr`` stays on the host (CSR)."""

    host_indptr: np.ndarray | None = None
    lease: Lease | None = field(default=None, compare=False)


# ---------------------------------------------------------------------------- the source


#: windows the GPU path reads at once unless told (``Loader(read_threads=...)``); it reads at
#: least that many windows ahead of the consumer, which a benchmark's warm-up must pass
DEFAULT_READ_THREADS = 4


class GpuBatchSource(BatchSource):
    """:class:`BatchSource` whose windows live on the device; feeds two external sources.

    ``host_source`` (CPU op) yields ``host_names``, ``device_source`` (GPU op, no copy)
    yields ``device_names``; both are pure in ``(epoch, iteration)`` like the base callback.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Planner,
        *,
        output: Output,
        obs: list[str],
        return_index: bool,
        prefetch_windows: int = 2,
        prefetch_queue_depth: int = 2,
        read_threads: int = DEFAULT_READ_THREADS,
        backend: Any = None,
        device_id: int = 0,
    ) -> None:
        # windows read at once only overlap if that many are wanted ahead of the consumer
        prefetch_windows = max(
            validate_prefetch_windows(prefetch_windows),
            validate_count("read_threads", read_threads),
        )
        super().__init__(
            dataset,
            sampler,
            output=output,
            obs=obs,
            return_index=return_index,
            prefetch_windows=prefetch_windows,
            prefetch_queue_depth=prefetch_queue_depth,
            read_threads=read_threads,
        )
        self.backend = backend if backend is not None else CudaBackend(device_id)
        self.reader = DeviceWindowReader(dataset, self.backend, output=output)
        self.host_names, self.device_names = gpu_source_names(
            dataset.layout, output, list(obs), return_index
        )
        self.names = [*self.host_names, *self.device_names]
        self.retire_after = self._alive.maxlen  # batches DALI may still hold
        self.ring = BufferRing(self.prefetch_windows + prefetch_queue_depth + 3, self.backend)
        self._served = 0
        self._leases: list[Lease] = []
        self._leases_closed = False
        self._lease_lock = threading.Lock()
        self._twins: dict[tuple[int, int, int], list] = {}
        self._twin_lock = threading.Lock()

    # -- reading (prefetch thread) ----------------------------------------------------------------

    def read_window(self, wkey: WindowKey) -> DeviceWindow:
        _, key, w = wkey
        plan = self.plan(*key).window(w)
        ranges = plan.row_ranges
        # byte plans read the files without the readers, which check each array's metadata
        # file around their reads: the dataset is checked around the window instead (a store
        # rewritten mid-epoch is refused, not read as garbage)
        lease = None
        try:
            with self.dataset.unchanged_around():
                arrays, host_indptr, lease = self._read_into_slot(ranges)
        except BaseException:
            if lease is not None:  # read, but the store changed meanwhile
                self.ring.abandon(lease)
            raise
        lease.key = wkey
        with self._lease_lock:
            if not self._leases_closed:  # a read finishing after close() is never served
                self._leases.append(lease)
        return DeviceWindow(plan, arrays, host_indptr, lease)

    def _read_into_slot(self, ranges: np.ndarray) -> tuple[tuple, np.ndarray | None, Any]:
        """The window's arrays read into a ring slot: (arrays, host indptr, the slot's lease);
        a failed read gives its slot back itself."""
        layout = self.reader.layout(ranges)
        if layout is None:
            return self.reader.read_generic(
                ranges, lambda n: self.ring.acquire(n, self._reclaim), self.ring.abandon
            )
        lease = self.ring.acquire(layout.nbytes, self._reclaim)
        try:
            arrays, host_indptr = self.reader.read(layout, lease.buf)
        except BaseException:
            self.ring.abandon(lease)
            raise
        return arrays, host_indptr, lease

    def _reclaim(self) -> None:
        """Release slots DALI can no longer read: served long enough ago, or never served and
        dropped by the window cache."""
        with self._lock:
            windows = dict(self._windows)
        with self._lease_lock:
            keep = []
            for lease in self._leases:
                if lease.last_served is not None:
                    done = self._served - lease.last_served >= self.retire_after
                else:
                    fut = windows.get(lease.key)
                    done = fut is not None and fut.done() and not _holds(fut, lease)
                    done = done or fut is None
                (self.ring.release if done else keep.append)(lease)
            self._leases = keep

    # -- the callbacks -----------------------------------------------------------------------

    def batch_outputs(self, window: Window, j: int) -> list:
        assert isinstance(window, DeviceWindow)
        pos = np.ascontiguousarray(window.plan.batch_positions(j), dtype=np.int64)
        outputs: list = [pos]
        if self.dataset.layout == "csr" and self.output == "csr":
            bptr = sub_indptr(window.host_indptr, pos)
            outputs += [np.empty((int(bptr[-1]), 0), dtype=np.uint8), bptr]
        outputs += self.row_outputs(window, j)
        with self._lease_lock:
            self._served += 1
            if window.lease is not None:
                window.lease.last_served = self._served
        self._reclaim()
        return outputs + list(window.arrays)

    def host_source(self, info) -> list:
        return self._half(info, 0)

    def device_source(self, info) -> list:
        return self._half(info, 1)

    def _half(self, info, which: int) -> list:
        key = (info.epoch_idx, info.iteration)
        with self._twin_lock:
            pending = self._twins.pop((*key, which), None)
        if pending is not None:
            return pending
        full = self(info)  # raises StopIteration at the end of the epoch, for both halves
        n_host = len(self.host_names)
        # device arrays go as one contiguous (1, ...) batch each: a list of samples would
        # make DALI copy them even with no_copy=True
        halves = (full[:n_host], [batch[0][None] for batch in full[n_host:]])
        with self._twin_lock:
            self._twins[(*key, 1 - which)] = halves[1 - which]
            while len(self._twins) > 8:  # a half DALI never asked for (epoch cut short)
                self._twins.pop(next(iter(self._twins)))
        return halves[which]

    def read_paths(self) -> dict[str, str]:
        return self.reader.read_paths()

    def restart(self) -> None:
        """As the base source's; a half fed to the old pipeline's other source must not
        serve the new one's batch of the same (epoch, iteration) either."""
        super().restart()
        with self._twin_lock:
            self._twins.clear()

    def close(self, *, pipeline_gone: bool = False) -> None:
        super().close(pipeline_gone=pipeline_gone)
        self.ring.close()  # a reader waiting for a slot the stopped consumer holds ends
        with self._lease_lock:
            self._leases_closed = True
            if pipeline_gone:  # no DALI run reads a slot any more: its memory can go
                self._leases.clear()
        if pipeline_gone:
            self.ring.drop_buffers()
        self.backend.close()


def _holds(future, lease: Lease) -> bool:
    if future.cancelled():
        return False
    try:
        return getattr(future.result(timeout=0), "lease", None) is lease
    except BaseException:
        return False


# ---------------------------------------------------------------------------- the graph


def _ops(source: GpuBatchSource, blocks: int, threads: int) -> GraphOps:
    return GraphOps(on_gpu=source.backend.on_device, blocks=blocks, threads=threads)


def build_gpu_graph(
    source: GpuBatchSource,
    *,
    blocks: int = cuda_kernels.DEFAULT_BLOCKS,
    threads: int = cuda_kernels.DEFAULT_THREADS,
) -> dict:
    """Declare the GPU graph inside an active pipeline (with a ``device_id``).

    Returns the named output nodes, all on the GPU: ``X`` float32 ``[B, *features]`` (or
    ``X_data``/``X_indices``/``X_indptr`` for ``output="csr"``), obs columns, ``index``.
    (With a :class:`HostBackend` source the same graph runs on DALI's CPU backend.)
    """
    ops = _ops(source, blocks, threads)
    node = source_nodes(source, source.host_source, source.host_names)
    node.update(source_nodes(source, source.device_source, source.device_names, ops.device))
    return declare_ops(source, node, ops)


def build_gpu_pipeline(
    source: GpuBatchSource,
    *,
    device_id: int | None,
    dtype: Any = "float32",
    num_threads: int = 2,
    prefetch_queue_depth: int = 2,
    transform: Transform | None = None,
    enable_checkpointing: bool = False,
    checkpoint: bytes | str | None = None,
    blocks: int = cuda_kernels.DEFAULT_BLOCKS,
    threads: int = cuda_kernels.DEFAULT_THREADS,
) -> tuple[Pipeline, list[str]]:
    """A GPU DALI pipeline yielding one minibatch per iteration, and its output names.

    Same contract as :func:`dali_zarr.graph.pipeline.build_pipeline` (``dtype``, ``transform``,
    checkpointing), with every output on device ``device_id``. ``prefetch_queue_depth`` must
    be the value the source's ring was sized for. ``device_id`` is ignored (None: a CPU
    pipeline) for a source with a :class:`HostBackend`.
    """
    if not source.backend.on_device:
        device_id = None
    elif device_id is None:
        raise ConfigError("build_gpu_pipeline needs the device_id of the source's GPU")
    return assemble_pipeline(
        lambda: build_gpu_graph(source, blocks=blocks, threads=threads),
        dataset=source.dataset,
        ops=_ops(source, blocks, threads),
        dtype=dtype,
        device_id=device_id,
        num_threads=num_threads,
        prefetch_queue_depth=prefetch_queue_depth,
        transform=transform,
        enable_checkpointing=enable_checkpointing,
        checkpoint=checkpoint,
    )


def default_device_id(visible: int | None = None) -> int:
    """This process's GPU: its rank on the node (torchrun's ``LOCAL_RANK``, else srun's
    ``SLURM_LOCALID``, else 0) among the ``visible`` GPUs (counted when None). A process
    that sees one GPU takes it, and so does a srun task that sees only GPUs of its own
    (``srun --gpus-per-task=N`` gives local task 3 devices 0..N-1): its first. Anything
    else past the visible GPUs is refused rather than put beside another rank.
    """
    found = local_rank()
    if found is None:
        return 0
    name, rank = found
    if visible is None:
        visible = visible_gpus()
    if visible == 1 or (name == "SLURM_LOCALID" and 0 < visible <= _slurm_gpus_per_task()):
        return 0
    if rank < 0 or (visible and rank >= visible):
        raise ConfigError(
            f"{name}={rank} picks this process's GPU, but it sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch "
            "at most one process per visible GPU, or pass Loader(..., device_id=...)"
        )
    return rank


def _slurm_gpus_per_task() -> int:
    """GPUs srun gives each task (``SLURM_GPUS_PER_TASK``, e.g. ``2`` or ``a100:2``); 0
    where not set or not a count. A task that sees no more than that sees its own."""
    raw = os.environ.get("SLURM_GPUS_PER_TASK", "")
    try:
        return int(raw.rsplit(":", 1)[-1])
    except ValueError:
        return 0


def visible_gpus() -> int:
    """CUDA devices this process sees (0 when that cannot be asked)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver: the GPU path will say why it is unusable
        return 0


def gpu_status() -> tuple[bool, str]:
    """(GPU path usable, a sentence saying what was found) — for ``device="auto"``."""
    s = probe_gpu()
    if not s.usable:
        return False, f"dali_zarr: CPU path ({s.reason})"
    io = "GPUDirect Storage" if s.gds else ("kvikio compat mode" if s.kvikio else "pread + copy")
    dec = "nvCOMP" if s.nvcomp else "CPU decode (no nvCOMP)"
    return True, f"dali_zarr: GPU path (reads: {io}; zstd/lz4 decode: {dec})"
