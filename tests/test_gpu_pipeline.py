"""Host-side logic of the GPU graph, run with the NumPy backend (no GPU needed).

`GpuBatchSource` + `DeviceWindowReader` + `BufferRing` with `HostBackend` run the same
window plans, slot layouts, twin callbacks and ring recycling as on a GPU, with host arrays
in place of device buffers. The outputs are compared with the CPU path's `BatchSource`, and
the ring is checked never to overwrite a slot DALI may still read. The graph itself
(`build_gpu_pipeline`) is compared with the CPU pipeline by the ``gpu`` tests below.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

import dali_zarr as dz
from dali_zarr.data.dataset import StoreRun, sub_indptr
from dali_zarr.errors import ChunkReadError, ConfigError
from dali_zarr.graph.gpu_pipeline import (
    BufferRing,
    GpuBatchSource,
    RingClosed,
    gpu_source_names,
    gpu_status,
)
from dali_zarr.graph.source import BatchSource
from dali_zarr.graph.window_backends import RING_SYNC_ENV, HostBackend, ring_sync
from dali_zarr.synthetic import make_single_cell
from tests.stores import batch_info, epoch_outputs, has_cuda, needs_cuda

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _sampler(seed=0, chunk=32, preload=4, batch=48):
    return dz.ChunkSampler(
        chunk_size=chunk,
        preload_nchunks=preload,
        batch_size=batch,
        shuffle=True,
        drop_last=False,
        seed=seed,
    )


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "cube.zarr"
    rng = np.random.default_rng(0)
    data = rng.standard_normal((403, 3, 5)).astype(np.float32)
    data[40:80] = 0  # chunks equal to the fill value are not stored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.create_array(
            str(path), shape=data.shape, dtype="float32", chunks=(20, 3, 5), compressors=None
        )
        arr[...] = data
    return path


def _run_epochs(
    ds, *, output, obs=(), return_index=True, epochs=2, cut=None, plans=None, guesses=None, **kw
):
    """Serve every batch of ``epochs`` epochs from both sources; compare them as we go.

    DALI epoch ``e`` follows user epoch ``plans[e]`` (default ``e``); the GPU source is told
    to expect ``guesses[e]`` next (default: the right one), the CPU reference nothing.
    """
    plans = list(range(epochs)) if plans is None else list(plans)
    guesses = [*plans[1:], None] if guesses is None else list(guesses)
    cpu = BatchSource(ds, _sampler(), output=output, obs=list(obs), return_index=return_index)
    gpu = GpuBatchSource(
        ds,
        _sampler(),
        output=output,
        obs=list(obs),
        return_index=return_index,
        backend=HostBackend(),
        **kw,
    )
    history: list[tuple[int, list, list]] = []  # (serve count, live arrays, copies)
    served = 0
    for epoch, (plan, guess) in enumerate(zip(plans, guesses, strict=True)):
        if epoch and guesses[epoch - 1] is not None and not (cut is not None and epoch == 1):
            # the previous epoch ran to its end: it read this epoch's first windows ahead
            ahead = {k[1] for k in gpu._windows if k[0] == epoch}
            assert ahead == {(guesses[epoch - 1], ())}, f"no read-ahead for epoch {epoch}"
        cpu.bind_epoch(epoch, plan)
        gpu.bind_epoch(epoch, plan, next_epoch=guess)
        assert all(k[0] != epoch or k[1] == (plan, ()) for k in gpu._windows), "stale read-ahead"
        if cut is not None and epoch == 0:
            cpu.cut_epoch(0, cut)
            gpu.cut_epoch(0, cut)
        for it, want in epoch_outputs(cpu, gpu.device_source, epoch):
            # DALI may call the two sources in either order
            first, second = (
                (gpu.host_source, gpu.device_source)
                if it % 2
                else (gpu.device_source, gpu.host_source)
            )
            a = first(batch_info(epoch, it))
            b = second(batch_info(epoch, it))
            host, dev = (b, a) if first == gpu.device_source else (a, b)
            _compare(cpu, gpu, want, host, dev)
            served += 1
            history.append((served, [x[0] for x in dev], [x[0].copy() for x in dev]))
            # nothing DALI may still hold was overwritten: with prefetch_queue_depth=2 that is
            # the last 2 + 2 batches (the one being built, the queue, the one being consumed)
            for when, live, copies in history[-(2 + 2) :]:
                for x, c in zip(live, copies, strict=True):
                    np.testing.assert_array_equal(x, c, err_msg=f"batch {when} overwritten")
    gpu.close()
    cpu.close()
    return gpu, served


def _compare(cpu, gpu, want, host, dev):
    ref = dict(zip(cpu.names, [w[0] for w in want], strict=True))
    got = dict(zip(gpu.host_names, [h[0] for h in host], strict=True))
    got.update(zip(gpu.device_names, [d[0] for d in dev], strict=True))
    for name, value in ref.items():
        if name == "nnz_hint":
            assert got[name].shape == value.shape
            continue
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    if "batch_indptr" in got:  # the prefix sum of the batch rows' lengths
        np.testing.assert_array_equal(got["batch_indptr"], sub_indptr(got["indptr"], got["pos"]))
        assert got["nnz_hint"].shape == (got["batch_indptr"][-1], 0)


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_csr_source_matches_cpu_source(odd_csr_store, output):
    ds = dz.open_dataset(odd_csr_store)
    gpu, served = _run_epochs(ds, output=output, obs=["cell_type"])
    assert served > 2 * gpu.ring.n_slots  # slots were recycled
    # windows read ahead (raised to the 4 read threads) + DALI's queue depth + 3
    assert gpu.prefetch_windows == 4 and gpu.ring.n_slots == 4 + 2 + 3
    paths = gpu.read_paths()
    assert set(paths) == {"odd.zarr/X/data", "odd.zarr/X/indices"}
    assert all("zstd" in p for p in paths.values())


def test_dense_source_matches_cpu_source(dense_store):
    ds = dz.open_dataset(dense_store)
    gpu, _ = _run_epochs(ds, output="dense")
    assert next(iter(gpu.read_paths().values())) == "host-backend plan: none"  # uncompressed


@pytest.fixture(scope="module")
def other_csr_store(tmp_path_factory):
    """A second store over the same genes, with other cells and one store chunk size."""
    path = tmp_path_factory.mktemp("gpu") / "sc2.zarr"
    make_single_cell(path, n_obs=389, n_features=97, chunk_elements=300, seed=5)
    return path


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_collection_and_subsets_read_each_store_by_plan(odd_csr_store, other_csr_store, output):
    a, b = dz.open_dataset(odd_csr_store), dz.open_dataset(other_csr_store)
    joined = dz.Collection([a, dz.Subset(b, np.arange(0, b.n_obs, 3)), b])
    for ds in (joined, dz.Subset(joined, np.arange(50, joined.n_obs - 7))):
        gpu, _ = _run_epochs(ds, output=output, obs=["cell_type"])
        paths = gpu.read_paths()
        assert set(paths) == {
            f"{n}/X/{x}" for n in ("odd.zarr", "sc2.zarr") for x in ("data", "indices")
        }
        assert all(p.startswith("host-backend plan") for p in paths.values()), paths


def test_collection_of_dense_stores_reads_by_plan(dense_store):
    ds = dz.Collection([dz.open_dataset(dense_store), dz.open_dataset(dense_store)])
    gpu, _ = _run_epochs(dz.Subset(ds, np.arange(10, ds.n_obs, 2)), output="dense", epochs=1)
    assert list(gpu.read_paths().values()) == ["host-backend plan: none"]


def test_epoch_cut_short_frees_its_slots(odd_csr_store):
    ds = dz.open_dataset(odd_csr_store)
    gpu, _ = _run_epochs(ds, output="dense", epochs=3, cut=2, prefetch_windows=3)
    ring = gpu.ring
    assert ring.waits == 0, "the reader had to wait for a slot"
    assert ring.n_free + len(gpu._leases) == ring.n_slots  # every slot free or held once
    # epoch 0 was cut with windows read ahead and never served: none of them still holds a
    # slot, only the last epoch's most recent windows do
    assert gpu._leases and {lease.key[:2] for lease in gpu._leases} == {(2, (2, ()))}


@pytest.mark.parametrize(
    ("plans", "guesses"),
    [
        pytest.param([0, 1, 2], [1, 2, None], id="stepped"),
        pytest.param([0, 0, 0], [0, 0, None], id="same-plan-again"),
        pytest.param([0, 3, 3, 1], [1, 4, 1, 2], id="wrong-guesses"),
    ],
)
def test_next_epoch_read_ahead_never_serves_a_recycled_slot(odd_csr_store, plans, guesses):
    """Windows of the expected next epoch are read into ring slots while an epoch ends. A
    repeated plan is read again (its served windows' slots are recycled), a wrong guess is
    dropped, and every batch still equals the CPU source's, no slot DALI holds overwritten."""
    ds = dz.open_dataset(odd_csr_store)
    gpu, _ = _run_epochs(
        ds, output="dense", plans=plans, guesses=guesses, epochs=len(plans), prefetch_windows=3
    )
    assert gpu.ring.waits == 0, "read-ahead of the next epoch made the reader wait for a slot"


def test_ring_sync_switch(monkeypatch):
    monkeypatch.delenv(RING_SYNC_ENV, raising=False)
    assert ring_sync() == "device"  # the default until "none" has run on a GPU
    monkeypatch.setenv(RING_SYNC_ENV, " None ")
    assert ring_sync() == "none"
    monkeypatch.setenv(RING_SYNC_ENV, "stream")
    with pytest.raises(ConfigError, match="DALI_ZARR_RING_SYNC='stream': use 'device' or 'none'"):
        ring_sync()


def test_names_split():
    host, dev = gpu_source_names("csr", "csr", ["a"], True)
    assert host == ["pos", "nnz_hint", "batch_indptr", "obs:a", "index"]
    assert dev == ["data", "indices", "indptr"]
    assert gpu_source_names("dense", "dense", [], False) == (["pos"], ["values"])


def test_sub_indptr():
    indptr = np.array([0, 2, 2, 5, 9])
    assert sub_indptr(indptr, np.array([3, 1, 0, 2])).tolist() == [0, 4, 4, 6, 9]
    assert sub_indptr(indptr, np.zeros(0, np.int64)).tolist() == [0]


def test_ring_blocks_until_a_slot_is_released():
    import threading

    ring = BufferRing(2, HostBackend())
    a, b = ring.acquire(10), ring.acquire(1000)
    assert b.buf.size >= 1000
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(5)))
    t.start()
    t.join(0.2)
    assert not got and ring.waits >= 1
    ring.release(a)
    t.join(5)
    assert got and got[0].slot == a.slot
    # a slot the reclaim callback gives back (a window retired or dropped) is no wait
    waits = ring.waits
    c = ring.acquire(5, reclaim=lambda: ring.release(b))
    assert c.slot == b.slot and ring.waits == waits


def test_ring_keeps_its_slots_when_allocation_fails():
    """A slot whose buffer could not be grown (the device out of memory) goes back to the
    ring: a ring that lost slots would wait forever for windows only the consumer frees."""

    class OutOfMemoryOnce(HostBackend):
        fail = True

        def alloc(self, nbytes: int) -> np.ndarray:
            if nbytes > 100 and self.fail:
                self.fail = False
                raise MemoryError(f"out of memory allocating {nbytes} bytes")
            return super().alloc(nbytes)

    ring = BufferRing(2, OutOfMemoryOnce())
    ring.release(ring.acquire(10))
    with pytest.raises(MemoryError):
        ring.acquire(1000)
    assert ring.n_free == 2
    a, b = ring.acquire(1000), ring.acquire(1000)  # both slots still serve
    assert {a.slot, b.slot} == {0, 1} and min(a.buf.size, b.buf.size) >= 1000


def test_a_window_that_fails_to_read_waits_for_its_queued_work_before_its_slot_is_freed(
    tmp_path,
):
    """A corrupt chunk fails a window after some of its uploads and launches were queued
    into the slot; the slot goes back to the ring only after the backend has finished them
    (with ``DALI_ZARR_RING_SYNC=none`` nothing else would stop its next owner racing them)."""
    path = Path(
        make_single_cell(
            tmp_path / "bad.zarr", n_obs=300, n_features=40, chunk_elements=512, shard_chunks=None
        )
    )
    victim = sorted((path / "X" / "data" / "c").iterdir())[1]
    victim.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 40)  # a zstd magic, then garbage

    events: list[str] = []

    class Recording(HostBackend):
        def finish(self) -> None:
            events.append("finish")

    gpu = GpuBatchSource(dz.open_dataset(path), _sampler(), output="dense", obs=[],
                         return_index=False, backend=Recording())  # fmt: skip
    release = gpu.ring.release
    gpu.ring.release = lambda lease: (events.append("release"), release(lease))
    gpu.bind_epoch(0, 0)
    n_windows = gpu.plan(0).n_windows
    with pytest.raises(ChunkReadError, match=r"bad\.zarr/X/data"):
        for w in range(n_windows):
            gpu.read_window((0, (0, ()), w))
    assert events[-2:] == ["finish", "release"], events
    assert gpu.ring.n_free == gpu.ring.n_slots - len(gpu._leases)  # the failed slot is back
    gpu.close()


def test_closing_the_ring_ends_a_reader_waiting_for_a_slot():
    import threading

    ring = BufferRing(1, HostBackend())
    ring.acquire(10)  # held by a window the (stopped) consumer never retires
    errors = []

    def wait_for_a_slot():
        try:
            ring.acquire(10)
        except RingClosed as e:
            errors.append(e)

    t = threading.Thread(target=wait_for_a_slot, daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive() and ring.waits >= 1
    ring.close()
    t.join(5)
    assert not t.is_alive() and errors, "the waiting reader did not end when the ring closed"
    with pytest.raises(RingClosed, match="loader was closed"):
        ring.acquire(10)


def test_closing_the_source_ends_a_read_blocked_on_the_ring(odd_csr_store):
    """A window read that waits for a slot held by batches the consumer will never retire
    (training stopped) ends when the source closes, instead of keeping its thread, and
    Python's exit that joins it, waiting forever."""
    ds = dz.open_dataset(odd_csr_store)
    gpu = GpuBatchSource(ds, _sampler(), output="dense", obs=[], return_index=False,
                         backend=HostBackend())  # fmt: skip
    gpu.bind_epoch(0, 0)
    held = [gpu.ring.acquire(1) for _ in range(gpu.ring.n_slots)]
    assert len(held) == gpu.ring.n_slots and gpu.ring.n_free == 0
    future = gpu._schedule((0, (0, ()), 0))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.3)  # waiting for a slot
    gpu.close()
    with pytest.raises(RingClosed):
        future.result(timeout=5)


def test_default_device_is_the_local_rank(monkeypatch):
    """torchrun's LOCAL_RANK, else srun's SLURM_LOCALID (srun had put every rank of a node on
    GPU 0); a process that sees one GPU takes it; a rank past the visible GPUs is refused."""
    from dali_zarr.graph.gpu_pipeline import default_device_id

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert default_device_id(visible=4) == 0
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert default_device_id(visible=4) == 2
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's wins
    assert default_device_id(visible=4) == 3
    assert default_device_id(visible=0) == 3  # no count to hold it to (the path says why)
    assert default_device_id(visible=1) == 0  # CUDA_VISIBLE_DEVICES set per rank
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=3 .* sees 2 GPU.*=0,1.*device_id="):
        default_device_id(visible=2)
    # srun --ntasks-per-node=4 --gpus-per-task=2: every task sees its own 2 GPUs
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "a100:2")
    assert default_device_id(visible=2) == 0
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")  # inherited, GPUs not bound: all 4 seen
    assert default_device_id(visible=4) == 3
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")  # 4 tasks sharing 2 GPUs: refused, not doubled
    with pytest.raises(ConfigError, match=r"SLURM_LOCALID=3 .* sees 2 GPU"):
        default_device_id(visible=2)
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='x' is not an integer.*device_id="):
        default_device_id(visible=2)


def test_gpu_status_says_why():
    usable, line = gpu_status()
    assert not usable or has_cuda(), "the GPU path cannot be usable without CUDA"
    if usable:
        assert line.startswith("dali_zarr: GPU path (reads: ") and "decode: " in line
    else:
        assert line.startswith("dali_zarr: CPU path (") and line.endswith(")")
        assert len(line) > len("dali_zarr: CPU path ()"), "no reason given"


@pytest.fixture(scope="module")
def half_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "half.zarr"
    data = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.create_array(str(path), shape=data.shape, dtype="float16", chunks=(20, 6))
        arr[...] = data
    return path


@pytest.mark.parametrize(
    ("store", "output"),
    [
        ("odd_csr_store", "dense"),
        ("odd_csr_store", "csr"),
        ("dense_store", "dense"),
        ("half_store", "dense"),
        ("odd_csr_store+features", "dense"),
        ("odd_csr_store+features", "csr"),
        ("half_store+features", "dense"),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_graph_declares(request, monkeypatch, store, output, dtype):
    """The GPU graph's wiring, declared without a device: the GPU ops are stand-ins that
    check every input is on the GPU and types/ndims match the inputs."""
    from nvidia.dali import fn, types

    from dali_zarr.graph import cuda_kernels
    from dali_zarr.graph.gpu_pipeline import build_gpu_pipeline

    store, _, selected = store.partition("+")
    ds = dz.open_dataset(request.getfixturevalue(store), features=[5, 0, 2] if selected else None)
    calls, out_dtypes = [], []

    def numba_function(*inputs, run_fn, setup_fn, out_types, in_types, outs_ndim, ins_ndim,
                       device, blocks, threads_per_block):  # fmt: skip
        assert device == "gpu" and len(blocks) == 3 and len(threads_per_block) == 3
        assert len(inputs) == len(in_types) == len(ins_ndim)
        assert len(out_types) == len(outs_ndim)
        assert all(node.device == "gpu" for node in inputs), run_fn.__name__
        calls.append(run_fn.__name__)
        out_dtypes.append(out_types)
        outs = [fn.copy(inputs[0]) for _ in out_types]
        return outs[0] if len(outs) == 1 else outs

    monkeypatch.setattr(cuda_kernels, "numba_function", numba_function)

    class DeclaredOnDevice(HostBackend):
        on_device = True  # declare the CUDA graph; nothing runs

    src = GpuBatchSource(
        ds, _sampler(), output=output, obs=[], return_index=True, backend=DeclaredOnDevice()
    )
    _, names = build_gpu_pipeline(src, device_id=0, dtype=dtype)
    want = ["X_data", "X_indices", "X_indptr"] if output == "csr" else ["X"]
    assert names == [*want, "index"]
    op = {"csr": "gather_csr_rows", "dense": "gather_dense_rows"}[ds.layout]
    if ds.layout == "csr" and output == "dense":
        op = "densify_csr_shared"
    assert calls[0] == op
    # a panel is kept on the device by the window reader's maps: the graph gathers, or
    # densifies, windows already in the panel's columns
    assert src.reader.stores is not None
    assert (src.reader.panel_maps is not None) == bool(selected)
    if ds.dtype == np.float16:  # float16 rows are gathered as their bits, cast after
        assert out_dtypes[0] == [types.UINT16]
    elif ds.layout == "dense":
        assert out_dtypes[0] == [types.FLOAT]
    # bfloat16 is our op for dense X and for a CSR's values alike
    assert ("float32_bits_to_bfloat16_bits" in calls) == (dtype == "bfloat16")
    # float16 too: our op on the GPU, as on the CPU (DALI's casts round differently there)
    half16 = {"to_float16_bits", "float32_bits_to_float16_bits"}
    assert bool(half16 & set(calls)) == (dtype == "float16")
    # after a transform the halves take X's run-time shape (a CPU node of a GPU node's shape)
    calls.clear()
    build_gpu_pipeline(src, device_id=0, dtype=dtype, transform=lambda outputs: outputs)
    assert bool(half16 & set(calls)) == (dtype == "float16")
    src.close()


def test_setup_functions_give_batch_shapes():
    from dali_zarr.graph import cuda_kernels as K

    outs = [[[0]], [[0]], [[0]]]
    K._csr_batch_shapes(outs, [[[17, 0]], [[6]], [[5]]])  # nnz_hint, batch_indptr, pos
    assert outs == [[[17]], [[17]], [[6]]]
    out2 = [[[0, 0]]]
    K._same_shape_2d(out2, [[[4, 9]]])  # the CPU op's setup too (kernels._same_shape_2d)
    assert out2 == [[[4, 9]]]


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("output", ["dense", "csr"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_pipeline_matches_cpu_pipeline(odd_csr_store, output, dtype):
    import torch

    from dali_zarr.graph.gpu_pipeline import build_gpu_pipeline
    from dali_zarr.graph.iterator import DaliEpochIterator

    ds = dz.open_dataset(odd_csr_store)
    cpu_src = BatchSource(ds, _sampler(), output=output, obs=["cell_type"], return_index=True)
    cpu_src.bind_epoch(0, 0)
    cpu_pipe, cpu_names = dz.build_pipeline(cpu_src)
    gpu_src = GpuBatchSource(
        ds, _sampler(), output=output, obs=["cell_type"], return_index=True, device_id=0
    )
    gpu_src.bind_epoch(0, 0)
    gpu_pipe, gpu_names = build_gpu_pipeline(gpu_src, device_id=0, dtype=dtype)
    assert sorted(cpu_names) == sorted(gpu_names)
    for (a,), (b,) in zip(
        DaliEpochIterator(cpu_pipe, cpu_names), DaliEpochIterator(gpu_pipe, gpu_names), strict=True
    ):
        for name in cpu_names:
            want = torch.from_dlpack(a[name])
            got = torch.from_dlpack(b[name])
            if name in ("X", "X_data") and dtype == "bfloat16":  # bits, as the loader gets
                got = got.view(torch.bfloat16)
            assert got.is_cuda
            if name in ("X", "X_data") and dtype != "float32":  # the CPU pipe's are float32
                want = want.to(getattr(torch, dtype))
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=name)


def test_panel_selection_builds_each_panels_map(odd_csr_store):
    """Pure: every panel (one, or one per store) gets its map, found by the identity of a
    run's ``columns``. CSR maps take stored columns to panel columns, dropped ones to
    ``n_kept``, which densify skips; dense maps list the stored columns a row keeps."""
    from dali_zarr.graph.device_window import panel_selection

    store = dz.open_dataset(odd_csr_store)
    a = np.array([-1, 0, -1, 1, 2])  # stored column -> panel column
    b = np.array([2, -1, 1, 0, -1])
    assert panel_selection([(store, None)], "csr", 5) is None
    maps = panel_selection([(store, a), (store, b)], "csr", 3)
    np.testing.assert_array_equal(maps.table, [3, 0, 3, 1, 2, 2, 3, 1, 0, 3])
    runs = [StoreRun(store, np.zeros((1, 2), np.int64), c) for c in (b, a, b)]
    offsets, widths = maps.of_runs(runs)  # widths: the stored widths ids are checked against
    assert offsets.tolist() == [5, 0, 5] and widths.tolist() == [5, 5, 5]
    maps = panel_selection([(store, a), (store, a)], "csr", 3)  # one panel: one map
    assert maps.table.tolist() == [3, 0, 3, 1, 2] and maps.where == {id(a): (0, 5)}
    maps = panel_selection([(store, a), (store, b)], "dense", 3)  # panel order
    assert maps.table.tolist() == [1, 3, 4, 3, 2, 0]
    offsets, _ = maps.of_runs(runs)
    assert offsets.tolist() == [3, 0, 3]
