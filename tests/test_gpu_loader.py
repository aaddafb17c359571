"""``Loader(device="gpu")`` against ``Loader(device="cpu")``, batch for batch, same seed.

Two ways to run the GPU path:

* with ``gpu_backend=HostBackend()`` (here, in CI): the GPU path's two external sources,
  its window reader and byte plans, its ring of reused buffers handed to DALI without a copy,
  its graph and its dtype conversions run in a real DALI pipeline on DALI's CPU backend,
  with the CPU kernels in place of their CUDA twins (those are checked against the CPU
  kernels under the CUDA simulator in test_cuda_kernels.py);
* on a CUDA device (``gpu`` marker, skipped without one): kvikio reads, nvCOMP decode and
  the CUDA kernels, compared with the CPU path the same way.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.graph.gpu_pipeline import RingClosed
from dali_zarr.graph.window_backends import HostBackend
from tests.stores import csr_reference, needs_cuda, write, write_layout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N_OBS = 613

# (zarr format, codec, chunks per shard or None) of the stores compared
STORES = [
    pytest.param((3, "zstd", 8), id="v3-zstd-sharded"),
    pytest.param((3, "none", None), id="v3-raw"),
    pytest.param((3, "blosc", None), id="v3-blosc"),
    pytest.param((2, "lz4", None), id="v2-lz4"),
    pytest.param((2, "zstd", None), id="v2-zstd"),
]


def sampler(**overrides) -> dz.ChunkSampler:
    # small windows: an epoch has 16 windows, so the GPU path's ring (9 slots by default,
    # prefetch_windows + prefetch_queue_depth + 3) is reused
    settings = dict(chunk_size=16, preload_nchunks=3, batch_size=40, shuffle=True, seed=3)
    settings.update(overrides)
    return dz.ChunkSampler(**settings)


def csr_store(root: Path, fmt: int, codec: str, shard: int | None, seed: int = 0) -> Path:
    name = f"sc-{fmt}-{codec}-{shard}" + (f"-seed{seed}" if seed else "")
    return synthetic.make_single_cell(
        root / f"{name}.zarr",
        n_obs=N_OBS,
        n_features=83,
        zarr_format=fmt,
        codec=codec,
        chunk_elements=700,
        shard_chunks=shard,
        seed=seed,
    )


def dense_store(root: Path, fmt: int, codec: str, shard: int | None, dtype="float32") -> Path:
    path = root / f"cube-{fmt}-{codec}-{shard}-{dtype}.zarr"
    spec = ((N_OBS, 3, 7), dtype, (24, 3, 7), (24 * (shard or 1), 3, 7))
    write_layout(path, spec, fmt=fmt, codec=codec, sharded=shard is not None)
    return path


def gpu_kwargs(where: str) -> dict:
    if where == "host":
        return {"device": "gpu", "gpu_backend": HostBackend()}
    return {"device": "gpu", "device_id": 0}


def assert_same_batches(
    cpu: dz.Loader, gpu: dz.Loader, epochs=(0, 1), where="host", x_dtype=None
) -> int:
    """Every batch of ``epochs`` equal (values, dtype, order), ``X`` of ``x_dtype`` when
    given (both paths could agree on a wrong one); returns the batch count."""
    n = 0
    for epoch in epochs:
        cpu.set_epoch(epoch)
        gpu.set_epoch(epoch)
        assert len(gpu) == len(cpu) > 0
        for want, got in zip(cpu, gpu, strict=True):
            assert_batch_equal(want, got, where, gpu.device_id)
            assert x_dtype is None or want["X"].dtype == x_dtype, want["X"].dtype
            n += 1
    cpu.close()
    gpu.close()
    return n


def assert_batch_equal(want: dict, got: dict, where: str = "host", device_id=None) -> None:
    """Same names, values, dtypes and sparse structure; on the GPU, on ``device_id``."""
    assert want.keys() == got.keys()
    for name, value in want.items():
        other = got[name]
        if where == "cuda":
            assert other.is_cuda and other.device.index == device_id, name
        if value.layout == torch.sparse_csr:
            assert other.layout == torch.sparse_csr and other.shape == value.shape
            for part in ("crow_indices", "col_indices", "values"):
                a, b = getattr(value, part)(), getattr(other, part)().cpu()
                torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{name}.{part}")
            continue
        torch.testing.assert_close(other.cpu(), value, rtol=0, atol=0, equal_nan=True, msg=name)


def both(ds, where: str, **kw) -> tuple[dz.Loader, dz.Loader]:
    return dz.Loader(ds, sampler(), **kw), dz.Loader(ds, sampler(), **kw, **gpu_kwargs(where))


WHERE = [
    pytest.param("host", id="host-backend"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_cuda]),
]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_csr_store(tmp_path, where, store, output):
    ds = dz.open_dataset(csr_store(tmp_path, *store))
    cpu, gpu = both(ds, where, output=output, obs=["cell_type"], return_index=True)
    assert assert_same_batches(cpu, gpu, where=where) > 2 * 13


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("store", STORES)
def test_dense_store(tmp_path, where, store):
    ds = dz.open_dataset(dense_store(tmp_path, *store))
    cpu, gpu = both(ds, where, return_index=True)
    assert_same_batches(cpu, gpu, where=where)


@pytest.mark.gpu
@needs_cuda
def test_ring_slots_rewritten_without_device_sync(tmp_path, monkeypatch):
    """``DALI_ZARR_RING_SYNC=none``: recycled slots are rewritten with no device-wide wait
    (DALI's outputs are host-synchronised); over four epochs of 16 windows each on six
    reader threads the ring (11 slots) is reused many times, and every batch still equals
    the CPU's."""
    monkeypatch.setenv("DALI_ZARR_RING_SYNC", "none")
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    kw = dict(output="dense", obs=["cell_type"], return_index=True, read_threads=6)
    cpu = dz.Loader(ds, sampler(), **kw)
    gpu = dz.Loader(ds, sampler(), **kw, **gpu_kwargs("cuda"))
    assert gpu._source.backend.ring_sync == "none"
    assert gpu.plan().n_windows > gpu._source.ring.n_slots  # each epoch alone reuses slots
    assert assert_same_batches(cpu, gpu, epochs=(0, 1, 2, 3), where="cuda") > 4 * 13


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("read_threads", [1, 3, 6])
def test_windows_read_on_several_threads_arrive_in_order(tmp_path, where, read_threads):
    """Windows read at once (the GPU path's default is 4) change nothing in the batches."""
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    kw = dict(output="dense", obs=["cell_type"], return_index=True, read_threads=read_threads)
    reference = dz.Loader(ds, sampler(), output="dense", obs=["cell_type"], return_index=True)
    gpu = dz.Loader(ds, sampler(), **kw, **gpu_kwargs(where))
    assert gpu._source._pool._max_workers == read_threads
    assert gpu._source.prefetch_windows >= read_threads  # so that the reads can overlap
    assert assert_same_batches(reference, gpu, where=where) > 2 * 13
    cpu_threads = dz.Loader(ds, sampler(), **kw)
    reference = dz.Loader(ds, sampler(), output="dense", obs=["cell_type"], return_index=True)
    assert assert_same_batches(reference, cpu_threads) > 2 * 13


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
@pytest.mark.parametrize("where", ["cpu", "host"])
def test_read_threads_must_be_a_positive_integer(tmp_path, bad, where):
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    kw = {} if where == "cpu" else gpu_kwargs(where)
    with pytest.raises(dz.ConfigError, match="read_threads must be a positive integer, got"):
        dz.Loader(ds, sampler(), read_threads=bad, **kw)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("stored", ["float16", "int16", "float64"])
def test_dense_stored_dtypes_arrive_as_float32(tmp_path, where, stored):
    ds = dz.open_dataset(dense_store(tmp_path, 3, "zstd", 4, dtype=stored))
    cpu, gpu = both(ds, where, return_index=True)
    assert_same_batches(cpu, gpu, epochs=(2,), where=where, x_dtype=torch.float32)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "float64"])
def test_output_dtypes(tmp_path, where, dtype):
    want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    cpu, gpu = both(ds, where, dtype=dtype)
    assert_same_batches(cpu, gpu, epochs=(0,), where=where, x_dtype=want)
    cpu, gpu = both(ds, where, dtype=dtype, output="csr")  # the CSR's values too
    assert_same_batches(cpu, gpu, epochs=(0,), where=where, x_dtype=want)
    cube = dz.open_dataset(dense_store(tmp_path, 3, "none", None))
    cpu, gpu = both(cube, where, dtype=dtype)
    assert_same_batches(cpu, gpu, epochs=(0,), where=where, x_dtype=want)


@pytest.mark.parametrize("where", WHERE)
def test_bfloat16_after_a_transform_that_narrows_x(tmp_path, where):
    def first_four(outputs: dict) -> dict:
        outputs["X"] = outputs["X"][:, :4]
        return outputs

    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    cpu, gpu = both(ds, where, dtype=torch.bfloat16, transform=first_four)
    assert_same_batches(cpu, gpu, epochs=(0,), where=where, x_dtype=torch.bfloat16)


def test_bfloat16_rounds_like_torch(tmp_path):
    """The bfloat16 op (CPU; its CUDA twin is checked in test_cuda_kernels) rounds to nearest
    even, as torch does: compare with torch's own conversion of the float32 batch."""
    path = tmp_path / "odd.zarr"
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((300, 11)) * 1e3).astype(np.float32)
    data[0, :5] = [np.inf, -np.inf, np.nan, 3.4e38, -0.0]
    write(path, data, chunks=(32, 11))
    ds = dz.open_dataset(path)
    f32 = dz.Loader(ds, sampler(), return_index=True)
    b16 = dz.Loader(ds, sampler(), return_index=True, dtype=torch.bfloat16)
    for a, b in zip(f32, b16, strict=True):
        assert b["X"].dtype == torch.bfloat16
        torch.testing.assert_close(
            b["X"], a["X"].to(torch.bfloat16), rtol=0, atol=0, equal_nan=True
        )


# float16 ties (2049 lies halfway between 2048 and 2050), values float32 would round onto a
# tie (2049 + 1e-9), float16's extremes; float64 so that each store dtype can hold them
HALF_TIES = [2049, 2051, 4097, -2049, 1 + 2**-11, 2049 + 1e-9, 65519.99, 65520, 2**-25, 3 * 2**-26]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("stored", ["float32", "float64", "int32"])
def test_float16_is_rounded_once_to_nearest_even_on_both_paths(tmp_path, where, stored):
    """float16 output is NumPy's ``astype(float16)`` of the value the path holds: of the
    stored value for CSR values, of the float32 X for dense X. DALI's CPU cast rounded
    ties away from zero (2049 -> 2050) where its GPU cast gives 2048, so the two paths
    differed; now both run our op, the same arithmetic (its CUDA twin: test_cuda_kernels)."""
    import anndata
    import scipy.sparse as sp

    rng = np.random.default_rng(5)
    dense = np.zeros((200, 12))
    dense[rng.random(dense.shape) < 0.4] = rng.choice(HALF_TIES, 1)[0]
    dense[:, :10] = np.resize(np.array(HALF_TIES), (200, 10))
    dense = dense.astype(stored)
    path = tmp_path / f"ties-{stored}.zarr"
    anndata.AnnData(X=sp.csr_matrix(dense)).write_zarr(path)
    ds = dz.open_dataset(path)
    small = sampler(chunk_size=8, batch_size=16)
    for output in ("dense", "csr"):
        paths = [{}, gpu_kwargs(where)]
        for kwargs in paths:
            loader = dz.Loader(
                ds, small, output=output, dtype=torch.float16, return_index=True, **kwargs
            )
            for batch in loader:
                rows = dense[batch["index"].cpu().numpy()]
                if output == "dense":  # X is built in float32, then made float16
                    want = rows.astype(np.float32).astype(np.float16)
                    got = batch["X"].cpu().numpy()
                else:
                    want = rows[rows != 0].astype(np.float16)
                    got = batch["X"].values().cpu().numpy()
                assert got.dtype == np.float16
                np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
            loader.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_outputs_take_what_a_transform_made(tmp_path, where, dtype):
    """The half conversions run after ``transform``, so they take X as the transform left
    it: another dtype (float64, or int32 CSR values halved), another shape (an N-D cube
    flattened, or cropped to fewer dimensions). They had assumed the store's float32 and
    feature shape: a crash, or rows silently regrouped (a (2, 3, 4) cube cropped to (3, 4)
    came back as half as many (2, 3, 4) rows). float32, the default, holds too: a transform
    that made X float64 had passed it through as float64."""
    from nvidia.dali import fn, types

    def to_float64(o):
        o["X"] = fn.cast(o["X"], dtype=types.FLOAT64)
        return o

    def flatten(o):
        o["X"] = fn.reshape(o["X"], shape=[-1, 3 * 7])
        return o

    def crop(o):
        o["X"] = o["X"][:, 0]
        return o

    def halve_values(o):  # float32 of int32, exactly: DALI's math.log gave other float32s
        o["X_data"] = o["X_data"] * 0.5  # on the GPU than on the CPU (H200, 2026-11-26)
        return o

    cube_path = dense_store(tmp_path, 3, "zstd", 4)
    cube = dz.open_dataset(cube_path)
    reference = torch.from_numpy(zarr.open_array(str(cube_path))[...])
    counts = csr_store(tmp_path, 3, "zstd", 8)
    _retype(counts, "data", "int32")
    for ds, transform, output, want in (
        (cube, to_float64, "dense", lambda rows: rows),
        (cube, flatten, "dense", lambda rows: rows.reshape(len(rows), -1)),
        (cube, crop, "dense", lambda rows: rows[:, 0]),
        (dz.open_dataset(counts), halve_values, "csr", None),
    ):
        cpu, gpu = both(ds, where, dtype=dtype, transform=transform, output=output,
                        return_index=True)  # fmt: skip
        if want is not None:  # the CPU path against torch's conversion of the reference
            for batch in cpu:
                expected = want(reference[batch["index"]]).to(dtype)
                assert batch["X"].dtype == dtype, transform.__name__
                assert torch.equal(batch["X"], expected), transform.__name__
        assert_same_batches(cpu, gpu, epochs=(0,), where=where, x_dtype=dtype)


def _retype(path: Path, name: str, dtype: str) -> None:
    """Re-write array ``X/<name>`` of a store with another dtype (same values)."""
    import zarr

    group = zarr.open_group(str(path), mode="r+")
    old = group[f"X/{name}"]
    values = old[...]
    # the codec the store had (zarr's default for v2 is Blosc, which the GPU path decodes on
    # the host: a test of device reads would fail for the rewrite, not for the dtype)
    new = group.create_array(
        f"X/{name}",
        shape=values.shape,
        dtype=dtype,
        chunks=(500,),
        compressors=old.compressors,
        overwrite=True,
    )
    new[...] = values.astype(dtype)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_collections_and_subsets_read_by_plan(tmp_path, where, output):
    """Every store of a collection (and of subsets of one) is read through its own byte
    plans, each window's rows from several stores placed in window order."""
    a = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    b = dz.open_dataset(csr_store(tmp_path, 2, "lz4", None))
    joined = dz.Collection([a, dz.Subset(b, np.arange(0, N_OBS, 2)), b])
    for ds in (joined, dz.Subset(joined, np.arange(3, joined.n_obs - 5, 2))):
        cpu, gpu = both(ds, where, output=output, return_index=True, obs=["cell_type"])
        paths = gpu.read_paths()
        assert len(paths) == 4 and not any("host read" in p for p in paths.values()), paths
        assert_same_batches(cpu, gpu, epochs=(1, 2), where=where)


@pytest.mark.parametrize("where", WHERE)
def test_collection_of_like_stores_reads_each_array_by_one_plan(tmp_path, where):
    """Stores written alike (other cells) share one plan per array and window; the
    batches still match the CPU path's, row for row."""
    paths = [csr_store(tmp_path, 3, "zstd", 8, seed=s) for s in (1, 2, 3)]
    joined = dz.Collection([dz.open_dataset(p) for p in paths])
    ds = dz.Subset(joined, np.arange(2, joined.n_obs - 1, 2))
    for output in ("dense", "csr"):
        cpu, gpu = both(ds, where, output=output, return_index=True, obs=["cell_type"])
        assert len(gpu.read_paths()) == 6
        assert_same_batches(cpu, gpu, epochs=(0, 1), where=where)
    # which plans each window ran: one per array, however many stores it touched
    windows: list[list[str]] = []
    local = threading.local()

    class Recording(HostBackend):
        def run_plan(self, plan, reader, out) -> None:
            local.__dict__.setdefault("ran", []).append(plan.name)
            super().run_plan(plan, reader, out)

        def finish(self) -> None:
            windows.append(local.__dict__.pop("ran", []))

    loader = dz.Loader(ds, sampler(), device="gpu", gpu_backend=Recording())
    assert sum(1 for _ in loader) > 0
    loader.close()
    arrays = [[name.rsplit("/", 1)[1] for name in ran] for ran in windows]
    assert windows and all(sorted(a) == ["data", "indices"] for a in arrays), windows
    assert any(" + " in name for ran in windows for name in ran), windows


@pytest.mark.parametrize("where", WHERE)
def test_dense_collection_read_by_plan(tmp_path, where):
    a, b = dense_store(tmp_path, 3, "zstd", 4), dense_store(tmp_path, 2, "lz4", None)
    joined = dz.Collection([dz.open_dataset(a), dz.open_dataset(b)])
    cpu, gpu = both(dz.Subset(joined, np.arange(1, joined.n_obs, 3)), where)
    assert not any("host read" in p for p in gpu.read_paths().values())
    assert_same_batches(cpu, gpu, epochs=(0,), where=where)


@pytest.mark.parametrize("where", WHERE)
def test_collection_with_a_store_that_has_no_plan(tmp_path, where):
    """A store whose chunks split its rows (no byte plan) among planned ones: its pieces of
    each window are read on the host and copied into place, the others' by plan."""
    planned = dense_store(tmp_path, 3, "zstd", 4)
    split = tmp_path / "split.zarr"
    data = np.random.default_rng(1).standard_normal((N_OBS, 3, 7)).astype(np.float32)
    write(split, data, chunks=(24, 3, 4))  # a row spans two chunks
    joined = dz.Collection([dz.open_dataset(p) for p in (planned, split, planned)])
    cpu, gpu = both(dz.Subset(joined, np.arange(1, joined.n_obs, 2)), where, return_index=True)
    paths = gpu.read_paths()
    assert sum("host read" in p for p in paths.values()) == 1, paths
    assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_collection_of_stores_with_other_index_dtypes_widens_on_the_device(tmp_path, where, output):
    """Big stores have int64 column ids, small ones int32 (scipy picks by nnz): a window of
    both is int64, and the int32 store's ids are widened by its plan's final copy, not
    read on the host."""
    a_path = csr_store(tmp_path, 3, "zstd", None)
    b_path = csr_store(tmp_path, 2, "zstd", None)
    _retype(b_path, "indices", "int64")
    joined = dz.open_dataset([a_path, b_path, a_path])
    assert joined.index_dtype == np.int64 and joined.parts[0].index_dtype == np.int32
    cpu, gpu = both(joined, where, output=output, return_index=True)
    paths = gpu.read_paths()
    assert len(paths) == 4 and not any("host read" in p for p in paths.values()), paths
    assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0


@pytest.mark.parametrize(
    ("panels", "output"),
    [(False, "dense"), (True, "dense"), (True, "csr")],
    ids=["whole-stores", "unlike-panels", "unlike-panels-csr-output"],
)
def test_bad_column_id_names_the_store_in_a_collection(tmp_path, panels, output):
    import zarr

    a_path = csr_store(tmp_path, 3, "zstd", None)
    b_path = csr_store(tmp_path, 2, "zstd", None)
    indices = zarr.open_array(f"{b_path}/X/indices", mode="r+")
    indices[5] = 83  # one past the last of 83 genes
    parts = [dz.open_dataset(p) for p in (a_path, b_path)]
    if panels:  # checked by the kernel that maps each store's ids to its panel
        parts = [dz.FeatureSubset(parts[0], [5, 1, 80]), dz.FeatureSubset(parts[1], [1, 5, 80])]
    # unlike panels of stores of one gene order: stacked by position, as asked
    joined = dz.Collection(parts, check_var_names=not panels)
    loader = dz.Loader(joined, sampler(), output=output, **gpu_kwargs("host"))
    paths = loader.read_paths().values()
    assert all(("mapped to the panel" in p) == panels and "host read" not in p for p in paths)
    row = int(np.searchsorted(zarr.open_array(f"{b_path}/X/indptr")[:], 5, side="right")) - 1
    named = rf"sc-2-zstd-None.zarr/X/indices: column index 83 .*: element 5 \(row {row} of "
    with pytest.raises(dz.DatasetError, match=named + r".*sc-2-zstd-None.zarr/X\), in .*chunk"):
        for _ in loader:
            pass
    loader.close()


def test_transform_runs_after_our_ops(tmp_path):
    from nvidia.dali import math as dali_math

    def log1p(outputs: dict) -> dict:
        outputs["X"] = dali_math.log(outputs["X"] + 1.0)
        return outputs

    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    cpu, gpu = both(ds, "host", transform=log1p, dtype=torch.float16)
    assert_same_batches(cpu, gpu, epochs=(0,))


def test_resume_mid_epoch_and_leaving_a_loop_early(tmp_path):
    """state_dict / load_state_dict, and a loop left early (DALI has prefetched into slots
    of the ring) followed by the next epoch, give the CPU path's batches."""
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    first = dz.Loader(ds, sampler(), return_index=True, **gpu_kwargs("host"))
    first.set_epoch(1)
    for k, _ in enumerate(first):
        if k == 6:
            break
    state = first.state_dict()
    first.set_epoch(2)  # the loop left early: the rest of epoch 1 is dropped, epoch 2 is whole
    epoch_2 = list(first)
    first.close()
    cpu = dz.Loader(ds, sampler(), return_index=True)
    cpu.set_epoch(2)
    want = list(cpu)
    assert len(epoch_2) == len(want) > 0
    for a, b in zip(want, epoch_2, strict=True):
        assert_batch_equal(a, b)

    resumed = dz.Loader(ds, sampler(), return_index=True, **gpu_kwargs("host"))
    resumed.load_state_dict(state)
    got = list(resumed)
    cpu.set_epoch(1)
    want = list(cpu)[7:]
    assert len(got) == len(want) > 0
    for a, b in zip(want, got, strict=True):
        assert_batch_equal(a, b)


@pytest.mark.parametrize("where", WHERE)
def test_closing_mid_epoch_releases_the_loader(tmp_path, where):
    """A ``with`` block left mid-epoch closes the loader (reader threads, ring, pipeline);
    iterating it again is refused with an error, not a hang; a new loader gives the batches
    the CPU path gives."""
    import gc
    import weakref

    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    with dz.Loader(ds, sampler(), return_index=True, **gpu_kwargs(where)) as loader:
        kept = []
        for batch in loader:
            kept.append(batch)
            if len(kept) == 3:
                break
        pipeline = weakref.ref(loader._pipe)
    gc.collect()
    assert pipeline() is None, "the closed loader still holds its DALI pipeline"
    assert all(b["X"].shape[0] > 0 and torch.isfinite(b["X"]).all() for b in kept)  # readable
    with pytest.raises(RingClosed):
        loader._source.ring.acquire(1)
    with pytest.raises(dz.ConfigError, match="was closed; create a new one"):
        next(iter(loader))
    # a generator still held when the loader closes stops with the same error
    held = dz.Loader(ds, sampler(), return_index=True, **gpu_kwargs(where))
    running = iter(held)
    next(running)
    held.close()
    with pytest.raises(dz.ConfigError, match="was closed; create a new one"):
        next(running)
    cpu = dz.Loader(ds, sampler(), return_index=True)
    again = dz.Loader(ds, sampler(), return_index=True, **gpu_kwargs(where))
    assert_same_batches(cpu, again, epochs=(0,), where=where)


def test_device_choice_is_reported(tmp_path, caplog):
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    with caplog.at_level("INFO", logger="dali_zarr.loader"):
        host = dz.Loader(ds, sampler(), **gpu_kwargs("host"))
    assert host.device == "gpu" and "host backend" in host.device_reason
    assert set(host.read_paths().values()) == {"host-backend plan: zstd"}
    assert "read paths" in caplog.text
    cpu = dz.Loader(ds, sampler(), device="cpu")
    assert cpu.device == "cpu" and cpu.device_id is None
    with pytest.raises(dz.ConfigError, match="bfloat16"):
        dz.Loader(ds, sampler(), dtype="int8")


@pytest.mark.gpu
@needs_cuda
def test_cuda_read_paths_name_gds_or_compat_and_nvcomp(tmp_path):
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))
    from dali_zarr.io.gpu import probe_gpu, read_method

    loader = dz.Loader(ds, sampler(), device="auto")
    assert loader.device == "gpu" and loader.device_id == 0
    support = probe_gpu()
    for path in loader.read_paths().values():
        assert path.startswith("gpu: ")
        # a zstd store: nvCOMP decodes where it is installed (read by kvikio, or by pread
        # into pinned memory without kvikio or when asked), else a host decode, said so
        if not support.nvcomp:
            assert "host read and decode (nvCOMP unavailable)" in path
            continue
        assert "nvCOMP zstd" in path
        if read_method(support) == "kvikio":
            assert "kvikio GDS" in path or "kvikio compat" in path
        else:
            assert "pread into pinned memory" in path
    print(f"GPU read paths: {loader.read_paths()}; {loader.device_reason}")


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_float16_csr_data_is_widened(tmp_path, where, output):
    path = csr_store(tmp_path, 3, "zstd", None)
    _retype(path, "data", "float16")
    ds = dz.open_dataset(path)
    assert ds.dtype == np.float16
    cpu, gpu = both(ds, where, output=output, return_index=True)
    paths = gpu.read_paths()  # widened by the plan's final copy, not read on the host
    assert len(paths) == 2 and not any("host read" in p for p in paths.values()), paths
    assert assert_same_batches(cpu, gpu, epochs=(0,), where=where) == len(cpu) > 0
    ref = dz.Loader(ds, sampler(), output="dense", return_index=True)
    dense = csr_reference(path).astype(np.float32).toarray()
    rows = 0
    for batch in ref:
        np.testing.assert_array_equal(batch["X"].numpy(), dense[batch["index"].numpy()])
        rows += len(batch["index"])
    assert rows > 0


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("shape", [(3, 0), (1, 0), (0,)], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_of_no_elements_keep_their_shape(tmp_path, where, shape, dtype):
    """An array shaped (n, 3, 0) delivers (batch, 3, 0) batches of every row on both
    paths: DALI cannot infer a reshape's -1 extent from a zero volume (a raw reshape error
    before), so the row count comes from the batch's own shape."""
    path = tmp_path / "empty_rows.zarr"
    chunks = (24, *(max(1, n) for n in shape))  # zarr's chunk grid needs no zero extent
    zarr.create_array(path, shape=(N_OBS, *shape), chunks=chunks, dtype="float32")
    ds = dz.open_dataset(path)
    cpu, gpu = both(ds, where, return_index=True, dtype=dtype)
    seen = []
    for batch in cpu:
        assert tuple(batch["X"].shape) == (len(batch["index"]), *shape)
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(N_OBS))
    assert_same_batches(cpu, gpu, epochs=(0, 1), where=where, x_dtype=getattr(torch, dtype))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("layout", ["csr", "dense"])
def test_each_rank_of_a_distributed_sampler_gets_the_cpu_paths_batches(tmp_path, where, layout):
    """Under torchrun every rank's loader reads its own shard of the windows. No test had
    run the GPU path with a DistributedSampler, so a rank's share of the window reads
    (byte plans of its chunks only, its ring, its batch starts) was only ever checked at
    rank 0 of 1. Three ranks of one store, each against the CPU path's batches for the same
    rank: equal batch for batch, the same number of batches on every rank, and the ranks'
    rows disjoint."""
    path = (
        csr_store(tmp_path, 3, "zstd", 8)
        if layout == "csr"
        else dense_store(tmp_path, 3, "zstd", 4)
    )
    ds = dz.open_dataset(path)
    world, counts, seen = 3, set(), []
    for rank in range(world):

        def ranked(rank=rank) -> dz.DistributedSampler:
            return dz.DistributedSampler(sampler(), dist_info=lambda: (rank, world))

        cpu = dz.Loader(ds, ranked(), return_index=True)
        gpu = dz.Loader(ds, ranked(), return_index=True, **gpu_kwargs(where))
        gpu.set_epoch(1)
        seen.append(np.concatenate([b["index"].cpu().numpy() for b in gpu]))
        counts.add(assert_same_batches(cpu, gpu, where=where))
    assert len(counts) == 1
    per_epoch = counts.pop() // 2  # assert_same_batches ran epochs 0 and 1
    union = np.concatenate(seen)
    assert len(np.unique(union)) == len(union)  # disjoint within the epoch
    # complete batches of 40 on every rank: 613 rows leave 600, 5 batches a rank
    assert per_epoch == 5 and len(union) == world * per_epoch * 40


@pytest.mark.parametrize("where", WHERE)
def test_an_elastic_resume_gives_each_new_rank_the_cpu_paths_batches(tmp_path, where):
    """Two ranks stop three batches into epoch 1 and three ranks resume from both states
    (an elastic restart, as after a lost node): each new rank replans the rest of the
    epoch. On the GPU path that remainder is read by byte plans of the new ranks' windows,
    which no test had run. Each new rank equals the CPU path's batches, and no row of the
    epoch arrives twice."""
    ds = dz.open_dataset(csr_store(tmp_path, 3, "zstd", 8))

    def ranked(rank: int, world: int) -> dz.DistributedSampler:
        return dz.DistributedSampler(sampler(), dist_info=lambda: (rank, world))

    states, before = [], []
    for rank in range(2):
        old = dz.Loader(ds, ranked(rank, 2), return_index=True, **gpu_kwargs(where))
        old.set_epoch(1)
        n_old = len(old)  # batches of epoch 1 per old rank
        for k, batch in enumerate(old):
            before.append(batch["index"].cpu().numpy())
            if k == 2:
                break
        states.append(old.state_dict())
        old.close()
    after, counts = [], set()
    for rank in range(3):
        cpu = dz.Loader(ds, ranked(rank, 3), return_index=True)
        gpu = dz.Loader(ds, ranked(rank, 3), return_index=True, **gpu_kwargs(where))
        cpu.load_state_dict(states)
        gpu.load_state_dict(states)
        want, got = list(cpu), list(gpu)
        cpu.close()
        gpu.close()
        assert len(got) == len(want) > 0
        for a, b in zip(want, got, strict=True):
            assert_batch_equal(a, b, where, gpu.device_id)
        counts.add(len(got))
        after += [b["index"].cpu().numpy() for b in got]
    assert len(counts) == 1  # equal batch counts on the new ranks
    rows = np.concatenate(before + after)
    assert len(np.unique(rows)) == len(rows)
    assert len(np.concatenate(before)) == 2 * 3 * 40
    # every row still owed, but for fewer than a batch per new rank (equal batch counts)
    owed = 2 * n_old * 40 - 2 * 3 * 40
    assert 0 <= owed - len(rows[2 * 3 * 40 :]) < 3 * 40
