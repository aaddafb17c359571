"""Where a window's ring slot lives, and the launches the window reader makes there.

A backend gives :class:`~dali_zarr.graph.device_window.DeviceWindowReader` typed views of a
slot's bytes, runs byte plans into them, and launches the window-level kernels (gene
panels: :func:`~dali_zarr.graph.kernels.host_kernel`'s CPU twins, or
:mod:`~dali_zarr.graph.cuda_kernels`). :class:`CudaBackend` holds cupy buffers and a
:class:`~dali_zarr.io.gpu.GpuPlanExecutor` per reader thread; :class:`HostBackend` holds
NumPy stand-ins and runs the same reader and ring logic on the CPU, which is how CI tests
the GPU path end to end.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from dali_zarr.errors import ConfigError
from dali_zarr.graph import cuda_kernels, kernels
from dali_zarr.io.gpu import (
    Pieces,
    describe_path,
    execute_plan_cpu,
    gpu_codec_kind,
    launch,
    plan_problem,
    probe_gpu,
)
from dali_zarr.planning.partition import run_offsets


def plan_target(plan: Any, out: Any) -> Any:
    """``out`` as ``plan`` fills it: bit for bit where ``out`` is a view of the same width
    (the uint16 bits of a float16 array: see :func:`~dali_zarr.graph.source.window_dtype`),
    widened by the plan's final copy where ``out`` is wider (int32 column ids of one store
    in a collection's int64 window, float16 CSR values in a float32 window)."""
    target = out.reshape(plan.out_shape)
    same_width = np.dtype(target.dtype).itemsize == np.dtype(plan.dtype).itemsize
    if target.dtype != plan.dtype and same_width:
        target = target.view(plan.dtype)
    return target


class _Backend:
    """What the host and CUDA backends share: typed views of a byte buffer, and reading an
    array's rows through its byte plan (or, when it has none, a host read plus one upload)."""

    def view(self, buf: Any, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        return buf[offset : offset + n].view(dtype).reshape(shape)

    def upload_rows(self, reader: Any, ranges: np.ndarray, pieces: Pieces | None, out: Any) -> None:
        """Rows ``ranges`` of an array that has no byte plan, read on the host and copied
        into ``out`` (whole, or as ``pieces``: one store's share of a collection's window)."""
        host = _as_window_dtype(np.ascontiguousarray(reader.read_rows(ranges)), out.dtype)
        if pieces is None:
            self.upload(host, out)
            return
        src = run_offsets(pieces[1])
        for a, start, n in zip(src[:-1].tolist(), *(p.tolist() for p in pieces), strict=True):
            if n:
                self.upload(host[a : a + n], out[start : start + n])

    def run_plans(self, jobs: Sequence[tuple[Any, Any, Any]]) -> None:
        """Run every ``(plan, reader, out)`` of a window into its :func:`plan_target`, here
        one after the other; the CUDA backend runs them together."""
        for plan, reader, out in jobs:
            self.run_plan(plan, reader, plan_target(plan, out))

    def run_plan(self, plan: Any, reader: Any, out: Any) -> None:
        raise NotImplementedError

    def upload(self, host: np.ndarray, out: Any) -> None:
        raise NotImplementedError

    def to_device(self, host: np.ndarray) -> Any:
        """A device copy of ``host``, made once (a table the kernels read every window)."""
        raise NotImplementedError

    def to_host(self, values: Any) -> np.ndarray:
        """A host copy of ``values`` (a few ids an error names: not for the hot path)."""
        raise NotImplementedError

    def remap_columns(self, indices: Any, run_bounds: np.ndarray, run_maps: np.ndarray,
                      run_widths: np.ndarray, maps: Any) -> int:  # fmt: skip
        """Map each run's column ids through its panel map, in place (the contract of
        ``kernels._remap_run_columns``); returns 0, or 1 + a run holding an id out of range."""
        raise NotImplementedError

    def keep_panel_rows(self, data: Any, indices: Any, indptr: Any, row_maps: np.ndarray,
                        row_widths: np.ndarray, maps: Any,
                        n_kept: int) -> tuple[np.ndarray, int]:  # fmt: skip
        """Keep each row's panel entries at its start, in place (the contract of
        ``kernels._keep_panel_rows``); returns (each row's kept count on the host, 0 or 1 +
        a row holding an id out of range)."""
        raise NotImplementedError

    def select_columns(self, out: Any, values: Any, row_starts: np.ndarray, row_maps: np.ndarray,
                       maps: Any) -> None:  # fmt: skip
        """Copy each row's panel columns out of the stored rows ``values`` (flat) into
        ``out`` (the contract of ``kernels._select_row_columns``)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait until the uploads and plans issued so far have landed."""

    def before_reuse(self) -> None:
        """Wait until nothing may still read a buffer about to be overwritten."""

    def wait_all(self) -> None:
        """Wait until all work queued on the device, by any thread, has finished."""

    def close(self) -> None:
        """Release what the backend holds open."""


def _bits(values: Any) -> Any:
    """``values`` viewed as unsigned integers of the same width: a copy that moves bits
    compiles once per width, and numba has no float16 on the host."""
    return values.view(f"u{values.dtype.itemsize}")


def _as_window_dtype(host: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``host`` as a window array of ``dtype``: its bits where the width is the same (see
    :func:`plan_target`), widened otherwise."""
    if host.dtype == dtype:
        return host
    return (
        host.view(dtype) if host.dtype.itemsize == np.dtype(dtype).itemsize else host.astype(dtype)
    )


class HostBackend(_Backend):
    """NumPy stand-in for the device: runs the same window reader and ring logic on the CPU.

    Used by the tests (and usable for debugging): "device" buffers are host arrays and the
    byte plans run with :func:`dali_zarr.io.gpu.execute_plan_cpu`.
    """

    name = "host"
    on_device = False  # the graph runs on DALI's CPU backend with the CPU kernels

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def run_plan(self, plan: Any, reader: Any, out: Any) -> None:
        execute_plan_cpu(plan, reader, out=out)

    def upload(self, host: np.ndarray, out: Any) -> None:
        out[...] = host.reshape(out.shape)

    def to_device(self, host: np.ndarray) -> np.ndarray:
        return np.array(host)

    def to_host(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values)

    def remap_columns(self, indices, run_bounds, run_maps, run_widths, maps) -> int:
        remap = kernels.host_kernel(kernels._remap_run_columns)
        return int(remap(indices, run_bounds, run_maps, run_widths, maps))

    def keep_panel_rows(self, data, indices, indptr, row_maps, row_widths, maps, n_kept):
        kept = np.empty(len(indptr) - 1, dtype=np.int64)
        bad = kernels.host_kernel(kernels._keep_panel_rows)(
            kept, data, indices, indptr, row_maps, row_widths, maps, n_kept
        )
        return kept, int(bad)

    def select_columns(self, out, values, row_starts, row_maps, maps) -> None:
        select = kernels.host_kernel(kernels._select_row_columns)
        select(_bits(out), _bits(values), row_starts, row_maps, maps)

    def minmax(self, values: Any) -> tuple[int, int]:
        return int(values.min()), int(values.max())

    def path(self, reader: Any) -> str:
        return _plan_path(reader, "host")


RING_SYNC_ENV = "DALI_ZARR_RING_SYNC"


#: threads per block of the window-level kernels that give each row a block
ROW_THREADS = 128


def _row_blocks(n_rows: int) -> int:
    """A block per row (the kernels stride over the rest past the grid's limit)."""
    return max(1, min(65535, n_rows))


def ring_sync() -> str:
    """What the CUDA backend waits for before it rewrites a recycled ring slot: ``"device"``
    (``cudaDeviceSynchronize``, the default) or ``"none"`` (rely on DALI's host-synchronised
    outputs, see the module docstring); from ``DALI_ZARR_RING_SYNC``."""
    want = os.environ.get(RING_SYNC_ENV, "").strip().lower() or "device"
    if want not in ("device", "none"):
        raise ConfigError(f"{RING_SYNC_ENV}={want!r}: use 'device' or 'none', or leave it unset")
    return want


JOINT_PLANS_ENV = "DALI_ZARR_JOINT_PLANS"


def joint_plans() -> bool:
    """Whether the CUDA backend runs a window's byte plans together (``1``, the default:
    one ``GpuPlanExecutor.run_many``) or one at a time (``0``: the way before 2026-11-27's
    session q, kept to compare the two on a GPU); from ``DALI_ZARR_JOINT_PLANS``."""
    want = os.environ.get(JOINT_PLANS_ENV, "").strip()
    if want not in ("", "0", "1"):
        raise ConfigError(f"{JOINT_PLANS_ENV}={want!r}: use 1 or 0, or leave it unset")
    return want != "0"


class CudaBackend(_Backend):
    """The device: cupy buffers, :class:`~dali_zarr.io.gpu.GpuPlanExecutor` reads (GPU only).

    Each reader thread gets its own executor (stream, staging buffers, nvCOMP codecs), so
    windows read on several threads overlap one's file reads with another's decode.
    """

    name = "cuda"
    on_device = True

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        self.cp = cupy
        self.device_id = device_id
        self.support = probe_gpu()
        self.ring_sync = ring_sync()
        self._local = threading.local()
        self._executors: list[Any] = []
        self._executors_lock = threading.Lock()
        self._closed = False

    @property
    def executor(self) -> Any:
        """This thread's executor (made on first use; refused once closed, where it would
        hold files and codecs that nothing closes)."""
        executor = getattr(self._local, "executor", None)
        if executor is None:
            from dali_zarr.io.gpu import GpuPlanExecutor

            with self._executors_lock:
                if self._closed:
                    raise RuntimeError("this loader's GPU backend was closed")
                executor = GpuPlanExecutor(self.device_id, support=self.support)
                self._executors.append(executor)
            self._local.executor = executor
        return executor

    def alloc(self, nbytes: int) -> Any:
        with self.cp.cuda.Device(self.device_id):
            return self.cp.empty(max(nbytes, 1), dtype=self.cp.uint8)

    def run_plans(self, jobs: Sequence[tuple[Any, Any, Any]]) -> None:
        """The window's plans in one ``GpuPlanExecutor.run_many`` (reads of all in flight,
        one decode call per codec kind), or one at a time with ``DALI_ZARR_JOINT_PLANS=0``."""
        targets = [(plan, reader, plan_target(plan, out)) for plan, reader, out in jobs]
        if joint_plans():
            self.executor.run_many(targets)
            return
        for job in targets:
            self.executor.run_many([job])

    def upload(self, host: np.ndarray, out: Any) -> None:
        with self.cp.cuda.Device(self.device_id):
            out.reshape(-1).set(np.ascontiguousarray(host).reshape(-1), stream=self.executor.stream)

    def to_device(self, host: np.ndarray) -> Any:
        with self.cp.cuda.Device(self.device_id):
            out = self.cp.asarray(host)
            self.cp.cuda.runtime.deviceSynchronize()
        return out

    def to_host(self, values: Any) -> np.ndarray:
        with self.cp.cuda.Device(self.device_id):
            return values.get(stream=self.executor.stream)  # waits for the stream

    def _launch(self, fn: Any, blocks: int, threads: int, *args: Any) -> None:
        """One launch of the window-level kernel ``fn`` on this thread's stream, on our
        device; host (NumPy) arguments are uploaded first."""
        stream = self.executor.stream
        with self.cp.cuda.Device(self.device_id), stream:
            args = tuple(self.cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
            launch(fn, blocks, threads, stream, *args)

    def _int64s(self, n: int, *, zeroed: bool = False) -> Any:
        """A device array of ``n`` int64 for a kernel to write (counts, a bad-id flag),
        zeroed on this thread's stream: the launch that reads it runs there, and a
        non-blocking stream does not wait for the default one."""
        with self.cp.cuda.Device(self.device_id), self.executor.stream:
            return (self.cp.zeros if zeroed else self.cp.empty)(n, dtype=self.cp.int64)

    def remap_columns(self, indices, run_bounds, run_maps, run_widths, maps) -> int:
        bad = self._int64s(1, zeroed=True)
        blocks = max(1, min(4096, -(-int(run_bounds[-1]) // 256)))
        self._launch(cuda_kernels.remap_run_columns, blocks, 256,
                     bad, indices, run_bounds, run_maps, run_widths, maps)  # fmt: skip
        return int(bad.get(stream=self.executor.stream)[0])  # waits for the kernel

    def keep_panel_rows(self, data, indices, indptr, row_maps, row_widths, maps, n_kept):
        n_rows = len(indptr) - 1
        kept, bad = self._int64s(n_rows), self._int64s(1, zeroed=True)
        args = (kept, bad, data, indices, indptr, row_maps, row_widths, maps, n_kept)
        self._launch(cuda_kernels.keep_panel_rows, _row_blocks(n_rows), ROW_THREADS, *args)
        stream = self.executor.stream
        return kept.get(stream=stream), int(bad.get(stream=stream)[0])

    def select_columns(self, out, values, row_starts, row_maps, maps) -> None:
        self._launch(cuda_kernels.select_row_columns, _row_blocks(out.shape[0]), ROW_THREADS,
                     _bits(out), _bits(values), row_starts, row_maps, maps)  # fmt: skip

    def minmax(self, values: Any) -> tuple[int, int]:
        with self.cp.cuda.Device(self.device_id), self.executor.stream:
            both = self.cp.stack([values.min(), values.max()]).get()
        return int(both[0]), int(both[1])

    def finish(self) -> None:
        self.executor.stream.synchronize()

    def wait_all(self) -> None:
        with self.cp.cuda.Device(self.device_id):
            self.cp.cuda.runtime.deviceSynchronize()

    def before_reuse(self) -> None:
        if self.ring_sync == "device":  # any DALI kernel still reading the slot has finished
            with self.cp.cuda.Device(self.device_id):
                self.cp.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        with self._executors_lock:
            self._closed = True
            for executor in self._executors:
                executor.close()  # the kvikio file handles, the nvCOMP codecs

    def path(self, reader: Any) -> str:
        return _plan_path(reader, "cuda", self.support)


def _plan_path(reader: Any, backend: str, support: Any = None) -> str:
    problem = plan_problem(reader)
    if problem:
        return f"gpu: host read ({problem}), one copy to the device"
    kind, why = gpu_codec_kind(reader.layout)
    if backend == "host":
        return f"host-backend plan: {kind}" + (f" ({why})" if why else "")
    return describe_path(kind, why, support)
