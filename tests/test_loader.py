"""End to end on the CPU: real stores → real DALI pipelines → torch batches, row by row."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from tests.stores import csr_reference, write_anndata


def run_epoch(loader: dz.Loader, epoch: int = 0) -> dict[str, np.ndarray]:
    """All batches of one epoch, concatenated per output (sparse X densified for comparison;
    the GPU path's batches copied to the host)."""
    loader.set_epoch(epoch)
    parts: dict[str, list[np.ndarray]] = {}
    sizes = []
    for batch in loader:
        sizes.append(len(batch["index"]))
        for name, value in batch.items():
            if value.layout == torch.sparse_csr:
                value = value.to_dense()
            parts.setdefault(name, []).append(value.cpu().numpy())
    out = {name: np.concatenate(values) for name, values in parts.items()}
    out["sizes"] = np.array(sizes)
    return out


def sampler(**overrides) -> dz.ChunkSampler:
    settings = dict(chunk_size=32, preload_nchunks=4, batch_size=50, shuffle=True, seed=7)
    settings.update(overrides)
    return dz.ChunkSampler(**settings)


def assert_rows_match(got: dict[str, np.ndarray], reference: np.ndarray, n_obs: int) -> None:
    index = got["index"]
    assert np.array_equal(np.sort(index), np.arange(n_obs)), "every row exactly once"
    assert not np.array_equal(index, np.arange(n_obs)), "rows were shuffled"
    np.testing.assert_array_equal(got["X"], reference[index])


# --- CSR stores in every layout we promise --------------------------------------------------

CSR_CASES = [
    pytest.param(dict(zarr_format=3, codec="zstd", shard_chunks=8), id="v3-zstd-sharded"),
    pytest.param(dict(zarr_format=3, codec="none", shard_chunks=None), id="v3-raw"),
    pytest.param(dict(zarr_format=3, codec="blosc", shard_chunks=None), id="v3-blosc"),
    pytest.param(dict(zarr_format=2, codec="blosc", shard_chunks=None), id="v2-blosc"),
    pytest.param(dict(zarr_format=2, codec="zstd", shard_chunks=None), id="v2-zstd"),
]


@pytest.mark.parametrize("layout", CSR_CASES)
def test_csr_rows_equal_source(tmp_path: Path, layout: dict) -> None:
    path = synthetic.make_single_cell(
        tmp_path / "x.zarr", n_obs=1_237, n_features=97, chunk_elements=1_000, **layout
    )
    reference = csr_reference(path).toarray().astype(np.float32)
    loader = dz.Loader(dz.open_dataset(path), sampler(), obs=["cell_type"], return_index=True)
    got = run_epoch(loader)
    assert_rows_match(got, reference, 1_237)
    codes = zarr.open_group(path)["obs/cell_type/codes"][...]
    np.testing.assert_array_equal(got["cell_type"], codes[got["index"]])
    assert got["cell_type"].dtype == np.int64
    assert len(loader) == len(got["sizes"]) == -(-1_237 // 50)
    assert (got["sizes"][:-1] == 50).all()
    loader.close()


def test_csr_output_is_torch_sparse(sc_store: Path) -> None:
    reference = csr_reference(sc_store)
    loader = dz.Loader(
        dz.open_dataset(sc_store), sampler(batch_size=64), output="csr", return_index=True
    )
    loader.set_epoch(1)
    seen = []
    for batch in loader:
        x = batch["X"]
        assert x.layout == torch.sparse_csr and x.shape == (len(batch["index"]), 300)
        expected = reference[batch["index"].numpy()]
        np.testing.assert_array_equal(x.crow_indices().numpy(), expected.indptr)
        np.testing.assert_array_equal(x.col_indices().numpy(), expected.indices)
        np.testing.assert_array_equal(x.values().numpy(), expected.data)
        seen.append(batch["index"].numpy())
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(reference.shape[0]))
    loader.close()


def test_missing_chunks_are_fill_value(tmp_path: Path) -> None:
    """zarr skips empty chunks; a store with whole zero regions must still load them."""
    path = tmp_path / "holes.zarr"
    dense = np.random.default_rng(0).random((640, 5, 4), dtype=np.float32)
    dense[64:256] = 0.0  # three chunks of zeros: zarr writes no key for them
    array = zarr.create_array(
        path, shape=dense.shape, chunks=(64, 5, 4), dtype="f4", fill_value=0.0
    )
    array[...] = dense
    assert not (path / "c" / "2").exists(), "zarr should have skipped the empty chunk"
    got = run_epoch(dz.Loader(dz.open_dataset(path), sampler(chunk_size=40), return_index=True))
    assert_rows_match(got, dense, 640)


# --- dense arrays ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "zarr_format,codec,shard_chunks",
    [(3, "zstd", 4), (3, "blosc", None), (2, "zstd", None), (2, "none", None)],
)
def test_dense_nd_rows_equal_source(tmp_path: Path, zarr_format, codec, shard_chunks) -> None:
    path = synthetic.make_dense_cube(
        tmp_path / "cube.zarr",
        n_obs=333,
        shape=(3, 5, 7),
        chunk_obs=16,
        codec=codec,
        zarr_format=zarr_format,
        shard_chunks=shard_chunks,
    )
    reference = zarr.open_array(path)[...]
    loader = dz.Loader(
        dz.open_dataset(path), sampler(chunk_size=20, batch_size=30), return_index=True
    )
    got = run_epoch(loader)
    assert got["X"].shape[1:] == (3, 5, 7)
    assert_rows_match(got, reference, 333)


def _cube_loader(path: Path, **kw) -> dz.Loader:
    """A loader of the 25-row-chunked dense cubes below, with the global index."""
    return dz.Loader(dz.open_dataset(path), sampler(chunk_size=25), return_index=True, **kw)


def test_dense_float16_output_and_transform(tmp_path: Path) -> None:
    path = synthetic.make_dense_cube(tmp_path / "c.zarr", n_obs=200, shape=(6,), chunk_obs=25)
    reference = zarr.open_array(path)[...]

    def double(outputs: dict) -> dict:
        outputs["X"] = outputs["X"] * 2
        return outputs

    got = run_epoch(_cube_loader(path, dtype=torch.float16, transform=double))
    assert got["X"].dtype == np.float16
    np.testing.assert_allclose(got["X"], 2 * reference[got["index"]].astype(np.float16), rtol=1e-3)


def test_bfloat16_follows_a_transform_that_narrows_x(tmp_path: Path) -> None:
    """The bfloat16 conversion runs after the user's ``transform`` and takes X's shape from
    it, not from the store: a slice to 4 of 10 features stays 4 wide, every value exact."""
    path = synthetic.make_dense_cube(tmp_path / "c.zarr", n_obs=200, shape=(10,), chunk_obs=25)
    reference = torch.from_numpy(zarr.open_array(path)[...])

    def first_four(outputs: dict) -> dict:
        outputs["X"] = outputs["X"][:, :4]
        return outputs

    loader = _cube_loader(path, dtype=torch.bfloat16, transform=first_four)
    loader.set_epoch(0)
    rows = 0
    for batch in loader:
        x = batch["X"]
        assert x.dtype == torch.bfloat16 and x.shape[1:] == (4,)
        assert torch.equal(x, reference[batch["index"]][:, :4].to(torch.bfloat16))
        rows += x.shape[0]
    assert rows == 200
    loader.close()


# --- anndata-written stores and collections -------------------------------------------------


@pytest.mark.parametrize("zarr_format,shard", [(2, False), (3, False), (3, True)])
def test_anndata_written_store(tmp_path: Path, zarr_format: int, shard: bool) -> None:
    path = tmp_path / "ad.zarr"
    x = write_anndata(path, n_obs=900, n_features=40, zarr_format=zarr_format, shard=shard)
    import anndata as ad

    adata = ad.read_zarr(path)
    dataset = dz.open_dataset(path)
    loader = dz.Loader(dataset, sampler(), obs=["cell_type", "depth"], return_index=True)
    got = run_epoch(loader)
    assert_rows_match(got, x.toarray(), 900)
    names = np.array(loader.categories("cell_type"))
    np.testing.assert_array_equal(
        names[got["cell_type"]], adata.obs["cell_type"].to_numpy()[got["index"]]
    )
    np.testing.assert_array_equal(got["depth"], adata.obs["depth"].to_numpy()[got["index"]])


def test_collection_concatenates_and_merges_categories(tmp_path: Path) -> None:
    paths, blocks, labels = [], [], []
    for k, n in enumerate((300, 451, 77)):
        path = tmp_path / f"part{k}.zarr"
        x = write_anndata(path, n_obs=n, n_features=25, zarr_format=3, seed=k)
        import anndata as ad

        labels.append(ad.read_zarr(path).obs["cell_type"].astype(str).to_numpy())
        paths.append(path)
        blocks.append(x)
    reference = sp.vstack(blocks).toarray()
    dataset = dz.open_dataset(paths)
    assert isinstance(dataset, dz.Collection) and dataset.n_obs == 828
    loader = dz.Loader(dataset, sampler(chunk_size=16), obs=["cell_type"], return_index=True)
    got = run_epoch(loader, epoch=3)
    assert_rows_match(got, reference, 828)
    names = np.array(loader.categories("cell_type"))
    np.testing.assert_array_equal(names[got["cell_type"]], np.concatenate(labels)[got["index"]])


def test_an_opened_dataset_pickles_and_reads_the_same_batches(
    sc_store: Path, tmp_path: Path
) -> None:
    """An opened dataset goes to spawned processes by pickle (Lightning's
    ``strategy="ddp_spawn"`` after ``dm.setup()``, or ``ZarrDataModule(data=dataset)``):
    every dataset failed with "cannot pickle '_thread.lock' object" (the direct reader's
    lock). The copy reads the same rows."""
    import pickle

    dense = tmp_path / "dense.zarr"
    zarr.create_array(
        dense, data=np.arange(4_000, dtype=np.float32).reshape(400, 10), chunks=(64, 10)
    )
    csr = dz.open_dataset(sc_store)
    datasets = {
        "csr": csr,
        "dense": dz.open_dataset(dense),
        "subset": dz.Subset(csr, np.arange(0, 3_001, 3)),
        "collection": dz.open_dataset([sc_store, sc_store]),
        "features": dz.FeatureSubset(csr, [3, 1]),
    }
    for name, dataset in datasets.items():
        run_epoch(dz.Loader(dataset, sampler(), return_index=True))  # used before it travels
        copy = pickle.loads(pickle.dumps(dataset))
        got, want = (run_epoch(dz.Loader(d, sampler(), return_index=True)) for d in (copy, dataset))
        assert got.keys() == want.keys(), name
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=name)


# --- epochs, determinism, leaving a loop early ----------------------------------------------


def test_epochs_reshuffle_and_seed_reproduces(sc_store: Path) -> None:
    def order(epoch: int, seed: int) -> np.ndarray:
        loader = dz.Loader(dz.open_dataset(sc_store), sampler(seed=seed), return_index=True)
        return run_epoch(loader, epoch)["index"]

    first = order(0, seed=1)
    assert np.array_equal(first, order(0, seed=1))
    assert not np.array_equal(first, order(1, seed=1))
    assert not np.array_equal(first, order(0, seed=2))


def test_break_mid_epoch_then_next_epoch_is_complete(sc_store: Path) -> None:
    loader = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)
    loader.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    full = run_epoch(loader, epoch=1)
    assert np.array_equal(np.sort(full["index"]), np.arange(3_001))
    again = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)
    np.testing.assert_array_equal(run_epoch(again, epoch=1)["index"], full["index"])


def interrupt_dali_feed(after_outputs: int) -> None:
    """Raise SIGINT (Ctrl-C) on this thread once DALI has fed ``after_outputs`` more of the
    external source's outputs: where a real Ctrl-C lands while a batch is drawn."""
    import signal
    import sys

    fed = [0]

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_feed_input":
            fed[0] += 1
            if fed[0] > after_outputs:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        return None

    sys.settrace(trace)


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_a_ctrl_c_while_a_batch_is_drawn_leaves_the_next_loops_right(
    sc_store: Path, device: str, output: str
) -> None:
    """A Ctrl-C (or a signal handler's exception) that landed while DALI fed one batch's
    outputs left DALI's external sources one batch apart: every later loop, next epochs
    included, gave each batch's X with another batch's index (and rows twice, others never),
    without an error. The pipeline is now rebuilt at the next loop."""
    import sys

    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    reference = csr_reference(sc_store).toarray()
    loader = dz.Loader(
        dz.open_dataset(sc_store), sampler(), output=output, return_index=True, **where
    )
    loader.set_epoch(0)
    handed = 0
    with pytest.raises(KeyboardInterrupt):
        try:
            for i, _ in enumerate(loader):
                handed += 1
                if i == 3:
                    interrupt_dali_feed(after_outputs=1)
        finally:
            sys.settrace(None)
    assert loader.state_dict()["consumed"] == handed == 4
    for epoch in (1, 1, 0):
        got = run_epoch(loader, epoch)
        np.testing.assert_array_equal(got["X"], reference[got["index"]])
        assert np.array_equal(np.sort(got["index"]), np.arange(3_001)), "every row once"
        fresh = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)
        np.testing.assert_array_equal(got["index"], run_epoch(fresh, epoch)["index"])
    loader.close()


def test_a_ctrl_c_in_the_callback_is_not_raised_again_for_a_later_error(sc_store: Path) -> None:
    """A Ctrl-C that landed while the callback waited for a window was kept as the
    callback's error, and raised again two epochs later in place of a transform's own
    error: a crash reported as an interrupt (and taken as one by a handler that saves and
    exits on KeyboardInterrupt)."""
    import signal
    import time

    from nvidia.dali import fn

    dataset = dz.open_dataset(sc_store)
    read_rows, interrupt = dataset.read_rows, [True]

    def interrupted_once(ranges):  # the prefetch thread: the loop waits in the callback
        if interrupt[0]:
            interrupt[0] = False
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.5)
        return read_rows(ranges)

    dataset.read_rows = interrupted_once
    fail = [False]

    def check(x):
        if fail[0]:
            raise ValueError("the transform's own error")
        return x

    loader = dz.Loader(
        dataset,
        sampler(),
        return_index=True,
        transform=lambda n: {**n, "X": fn.python_function(n["X"], function=check)},
    )
    with loader:
        with pytest.raises(KeyboardInterrupt):
            run_epoch(loader, 0)
        assert len(run_epoch(loader, 1)["index"]) == 3_001  # goes on after it
        fail[0] = True
        with pytest.raises(BaseException) as raised:  # on the old code a KeyboardInterrupt
            run_epoch(loader, 2)
        assert not isinstance(raised.value, KeyboardInterrupt), repr(raised.value)
        assert "the transform's own error" in str(raised.value)


class _LockReleasedIntoCtrlC:
    """A loader's loop lock whose release, once armed, is where a real SIGINT lands: CPython
    delivers a pending signal after a C call such as a lock's release, here the one after a
    batch was drawn and before the loop got it."""

    def __init__(self, lock) -> None:
        self.lock, self.armed = lock, False

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc):
        import signal

        released = self.lock.__exit__(*exc)
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return released


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
@pytest.mark.parametrize("at", ["conversion", "lock release"])
def test_a_state_saved_on_ctrl_c_counts_only_batches_handed_out(
    sc_store: Path, device: str, at: str
) -> None:
    """A Ctrl-C (or a signal handler's SystemExit) that landed while a drawn batch became
    torch tensors left it counted in ``consumed`` though the loop never got it: a state
    saved in ``except KeyboardInterrupt`` resumed one batch later, and its rows were not
    delivered that epoch (in a tight loop, 5 of 60 random Ctrl-Cs). So did one landing as
    the loop lock was released after the draw (2 of 60)."""
    import signal
    import sys

    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}

    def make() -> dz.Loader:
        return dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True, **where)

    def interrupt_conversion(frame, event, arg):  # a Ctrl-C as the batch is converted
        if event == "call" and frame.f_code.co_name == "_to_batch":
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)

    whole = run_epoch(make())["index"]
    loader = make()
    loader._loop_lock = lock = _LockReleasedIntoCtrlC(loader._loop_lock)
    handed = []
    with pytest.raises(KeyboardInterrupt):
        try:
            for i, batch in enumerate(loader):
                handed.append(batch["index"].numpy())
                if i == 2 and at == "conversion":
                    sys.settrace(interrupt_conversion)
                lock.armed = i == 2 and at == "lock release"
        finally:
            sys.settrace(None)
    state = loader.state_dict()
    assert state["consumed"] == len(handed) == 3
    resumed = make()
    resumed.load_state_dict(state)
    rest = run_epoch(resumed)["index"]
    np.testing.assert_array_equal(np.concatenate([*handed, rest]), whole)
    loader.close()


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_close_lets_the_windows_and_ring_buffers_go(sc_store: Path, device: str) -> None:
    """close() promised to release the buffers, but the read-ahead cache, the last batches
    kept for DALI and (GPU path) the ring's slots stayed held as long as the closed loader
    was referenced, which Lightning does after teardown: 80-150 MB per loader of 40 MB
    windows. Once its pipeline is gone, nothing of a window outlives close()."""
    import weakref

    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    loader = dz.Loader(dz.open_dataset(sc_store), sampler(preload_nchunks=2), **where)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    source = loader._source
    held = [f.result() for f in source._windows.values() if f.done() and not f.exception()]
    arrays = [a for window in held for a in window.arrays if isinstance(a, np.ndarray)]
    arrays += [a for outputs in source._alive for a in outputs if isinstance(a, np.ndarray)]
    arrays += [b for b in getattr(getattr(source, "ring", None), "_bufs", []) if b is not None]
    assert len(arrays) >= 3
    refs = [weakref.ref(a.base if a.base is not None else a) for a in arrays]
    del held, arrays
    loader.close()
    source._pool.shutdown(wait=True)  # a window read in flight holds its memory until done
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs), "window memory outlived close()"


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_close_keeps_what_a_live_pipeline_may_read(sc_store: Path, device: str) -> None:
    """A second close() (an explicit one inside ``with``), or one after a Ctrl-C had dropped
    the pipeline, took "no pipeline held" for "no pipeline alive" while a generator of the
    loop still held it, and let go the batches DALI was handed and the ring's slots."""
    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    loader = dz.Loader(dz.open_dataset(sc_store), sampler(preload_nchunks=2), **where)
    loop = iter(loader)
    next(loop)
    source = loader._source
    kept = len(source._alive)
    slots = [b for b in getattr(getattr(source, "ring", None), "_bufs", []) if b is not None]
    assert kept > 0
    loader.close()
    loader.close()
    assert len(source._alive) == kept
    if slots:
        assert [b for b in source.ring._bufs if b is not None] == slots
    del loop


def test_closed_loader_refuses_to_iterate(sc_store: Path) -> None:
    with dz.Loader(dz.open_dataset(sc_store), sampler()) as loader:
        assert len(next(iter(loader))["X"]) == 50
    with pytest.raises(dz.ConfigError, match=r"Loader of .*sc.* was closed; create a new one"):
        list(loader)
    loader.close()  # closing twice is harmless


def test_next_epoch_read_ahead_follows_any_epoch_order(sc_store: Path) -> None:
    """The first windows of the epoch the loader expects next are read while an epoch ends;
    whether the guess was right (set_epoch stepping by one, or no set_epoch: the same plan
    again) or wrong (a jump, or stepping stopped), every epoch is its own plan."""
    loader = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)

    def reference(epoch: int) -> np.ndarray:
        fresh = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)
        return run_epoch(fresh, epoch)["index"]

    def iterate(epoch: int | None) -> np.ndarray:
        if epoch is not None:
            loader.set_epoch(epoch)
        return np.concatenate([batch["index"].numpy() for batch in loader])

    np.testing.assert_array_equal(iterate(0), reference(0))
    # epoch 0 stepped with set_epoch: epoch 1's first windows (DALI epoch 1) were read ahead
    ahead = [k for k in loader._source._windows if k[0] == 1]
    assert ahead and all(k[1] == (1, ()) for k in ahead)
    np.testing.assert_array_equal(iterate(1), reference(1))  # guessed right
    np.testing.assert_array_equal(iterate(5), reference(5))  # guessed 2
    np.testing.assert_array_equal(iterate(None), reference(5))  # guessed 6: no set_epoch now
    np.testing.assert_array_equal(iterate(None), reference(5))  # guessed 5, the same plan
    # ... and the next DALI epoch's first windows, of that same plan, are read ahead again
    ahead = {k[1] for k in loader._source._windows if k[0] == loader._dali_epoch + 1}
    assert ahead == {(5, ())}
    assert {k[1] for k in loader._source._windows} == {(5, ())}


def test_drop_last_and_unshuffled(sc_store: Path) -> None:
    loader = dz.Loader(
        dz.open_dataset(sc_store), sampler(drop_last=True, shuffle=False), return_index=True
    )
    got = run_epoch(loader)
    assert (got["sizes"] == 50).all() and len(got["sizes"]) == 3_001 // 50
    np.testing.assert_array_equal(got["index"], np.arange(len(got["index"])))


# --- bad input ------------------------------------------------------------------------------


def test_corrupted_chunk_raises_with_chunk_key(tmp_path: Path) -> None:
    path = Path(
        synthetic.make_single_cell(
            tmp_path / "bad.zarr", n_obs=500, n_features=50, chunk_elements=512, shard_chunks=None
        )
    )
    chunk = path / "X" / "data" / "c" / "3"
    raw = bytearray(chunk.read_bytes())
    raw[8:40] = os.urandom(32)
    chunk.write_bytes(bytes(raw))
    loader = dz.Loader(dz.open_dataset(path), sampler(shuffle=False, batch_size=100))
    with pytest.raises(dz.ChunkReadError, match=r"X/data.*c/3"):
        for _ in loader:
            pass


def test_truncated_chunk_raises(tmp_path: Path) -> None:
    path = Path(
        synthetic.make_dense_cube(
            tmp_path / "t.zarr", n_obs=200, shape=(10,), chunk_obs=20, codec="none"
        )
    )
    chunk = path / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:13])
    loader = dz.Loader(dz.open_dataset(path), sampler(chunk_size=20, shuffle=False))
    with pytest.raises(dz.ChunkReadError, match=r"c/1/0"):
        for _ in loader:
            pass


@pytest.mark.parametrize("device", ["cpu", "gpu-path-on-host", "zarr-python"])
@pytest.mark.parametrize("shard_chunks", [None, 2], ids=["chunk-files", "shards"])
@pytest.mark.parametrize("kind", ["dangling-link", "dangling-folder", "named-pipe", "folder"])
def test_a_stored_file_that_is_no_file_is_named_not_read_as_fill(
    tmp_path: Path, kind: str, shard_chunks, device: str
) -> None:
    """A chunk or shard that is a dangling symbolic link (links to a volume not mounted)
    had read as the fill value, zeros, with no error; a named pipe blocked the read
    forever; a folder of chunks (``c/1``) that is a dangling link read as zeros too. All
    are refused, naming the chunk, on the CPU path, the GPU path's planning and the
    zarr-python reader (codecs the direct reader lacks, ``force_zarr``) alike."""
    from dali_zarr.graph.window_backends import HostBackend

    path = Path(
        synthetic.make_dense_cube(
            tmp_path / "t.zarr", n_obs=200, shape=(10,), chunk_obs=20, codec="zstd",
            shard_chunks=shard_chunks,
        )
    )  # fmt: skip
    target = path / "c" / "1" / "0"
    target.unlink()
    if kind == "dangling-link":
        target.symlink_to(tmp_path / "not-mounted" / "0")
    elif kind == "dangling-folder":
        target.parent.rmdir()
        target.parent.symlink_to(tmp_path / "not-mounted")
    elif kind == "folder":  # was called "not a regular file (a named pipe, socket or device?)"
        target.mkdir()
    else:
        os.mkfifo(target)
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device.startswith("gpu") else {}
    dataset = dz.open_dataset(path, force_zarr=device == "zarr-python")
    loader = dz.Loader(dataset, sampler(chunk_size=20, shuffle=False), **where)
    problem = {
        "dangling-link": "is a symbolic link to",
        "dangling-folder": r"folder '[^']*c/1' is a symbolic link to",
        "named-pipe": "not a regular file",
        "folder": "it is a folder, not a chunk file",
    }[kind]
    with pytest.raises(dz.ChunkReadError, match=rf"c/1/0.*{problem}"):
        for _ in loader:
            pass
    loader.close()


def test_a_dataset_without_observations_is_named(sc_store: Path) -> None:
    empty = dz.Subset(dz.open_dataset(sc_store), np.zeros(0, np.int64))
    with pytest.raises(dz.ConfigError, match=rf"{sc_store.name}.*no observations"):
        dz.Loader(empty, sampler())


def test_a_sampler_that_cannot_plan_the_dataset_names_it(tmp_path: Path) -> None:
    """A refusal of the plan (too many ranks for this dataset's chunks) names the dataset:
    with a train and a validation loader the user must know which one to change."""
    path = tmp_path / "small_val.zarr"
    zarr.create_array(str(path), shape=(20, 3), dtype="float32", chunks=(8, 3))[...] = 1.0
    ds = dz.open_dataset(path)
    ranks = dz.DistributedSampler(sampler(batch_size=4), dist_info=lambda: (0, 4))
    loader = dz.Loader(ds, ranks)
    for use in (len, lambda ld: next(iter(ld)), lambda ld: ld.plan()):
        with pytest.raises(dz.ConfigError, match=r"small_val\.zarr.*more ranks than chunks"):
            use(loader)
    loader.close()


def test_a_chunk_larger_than_the_dataset_is_not_refused_for_memory(tmp_path: Path) -> None:
    """chunk_size past n_obs (one chunk: the whole dataset) was refused as "a window of
    2**40 rows x 1,000 features" larger than memory, for a 100-row store: no window or
    batch holds more rows than the dataset has."""
    path = tmp_path / "hundred.zarr"
    values = np.arange(100 * 1000, dtype=np.float32).reshape(100, 1000)
    zarr.create_array(str(path), shape=values.shape, dtype="float32", chunks=(50, 1000))[...] = (
        values
    )
    huge = dz.ChunkSampler(chunk_size=2**40, preload_nchunks=1, batch_size=2**40, seed=0)
    with dz.Loader(dz.open_dataset(path), huge, return_index=True, num_threads=1) as loader:
        got = run_epoch(loader)
    assert got["sizes"].tolist() == [100]
    np.testing.assert_array_equal(got["X"], values[got["index"]])
    assert np.array_equal(np.sort(got["index"]), np.arange(100))


def test_a_zarr_store_object_opens_like_its_path(tmp_path: Path) -> None:
    """zarr.open takes a store object (LocalStore, FsspecStore with its credentials), so
    users hold them; open_dataset raised os.fspath's bare TypeError for one, and for a
    NumPy array given in place of a store."""
    values = np.arange(60, dtype="f4").reshape(15, 2, 2)
    zarr.create_array(tmp_path / "cube.zarr", data=values, chunks=(4, 2, 1))
    store = zarr.storage.LocalStore(tmp_path / "cube.zarr", read_only=True)
    dataset = dz.open_dataset(store)
    assert dataset.name == "cube.zarr" and dataset.feature_shape == (2, 2)
    assert list(dataset.read_paths().values()) == ["direct"]
    got = run_epoch(dz.Loader(dataset, sampler(chunk_size=4, batch_size=5), return_index=True))
    assert sorted(got["index"]) == list(range(15))
    np.testing.assert_array_equal(got["X"], values[got["index"]])
    with pytest.raises(dz.DatasetError, match=r"holds no Zarr array or group"):
        dz.open_dataset(zarr.storage.MemoryStore())
    with pytest.raises(dz.ConfigError, match=r"not a ndarray.*zarr.create_array"):
        dz.open_dataset(values)


def test_stores_without_a_folder_are_named_in_messages(tmp_path: Path) -> None:
    """A dataset in a zip file or in memory was named '<zarr node>', which told the user
    nothing in an error about its chunks; it is named by the zip file or the store's URL."""
    zipped = zarr.storage.ZipStore(tmp_path / "cube.zip", mode="w")
    zarr.create_array(zipped, shape=(6, 2), dtype="f4", chunks=(3, 2))[:] = 1
    zipped.close()
    assert dz.open_dataset(zarr.storage.ZipStore(tmp_path / "cube.zip", mode="r")).name == (
        "cube.zip"
    )
    memory = zarr.storage.MemoryStore()
    zarr.create_group(memory).create_array("X", shape=(6, 2), dtype="f4", chunks=(3, 2))
    assert dz.open_dataset(zarr.open_group(memory, mode="r")["X"]).name == "MemoryStore/X"


def test_open_dataset_errors(tmp_path: Path, sc_store: Path) -> None:
    with pytest.raises(dz.DatasetError, match="no such file"):
        dz.open_dataset(tmp_path / "nope.zarr")
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "plain_dir" / "notes.txt").write_text("hello")
    with pytest.raises(dz.DatasetError, match="not a Zarr store"):
        dz.open_dataset(tmp_path / "plain_dir")
    group = zarr.open_group(tmp_path / "grp.zarr", mode="w")
    group.create_array("a", shape=(4,), dtype="f4")
    with pytest.raises(dz.DatasetError, match=r"neither an AnnData store.*'a'"):
        dz.open_dataset(tmp_path / "grp.zarr")
    other = synthetic.make_single_cell(tmp_path / "other.zarr", n_obs=100, n_features=301)
    with pytest.raises(dz.DatasetError, match=r"features \(301,\).*\(300,\)"):
        dz.open_dataset([sc_store, other])
    with pytest.raises(dz.DatasetError, match="no column 'nope'"):
        dz.Loader(dz.open_dataset(sc_store), sampler(), obs=["nope"])


@pytest.mark.parametrize("dense", [False, True], ids=["csr-X", "dense-X"])
def test_obs_columns_that_cannot_be_batched_are_named_in_obs(tmp_path: Path, dense: bool) -> None:
    """Text, missing values and a wrong length fail naming ``<store>/obs/<column>`` (not a
    path under ``X``), whichever way X is stored."""
    import anndata as ad
    import pandas as pd

    n = 40
    obs = pd.DataFrame(
        {
            "donor": [f"d{i}" for i in range(n)],  # unique text: anndata keeps it text
            "age": pd.array([None, *range(1, n)], dtype="Int32"),  # one missing value
            "dose": np.arange(n, dtype=np.int64),
        },
        index=[f"c{i}" for i in range(n)],
    )
    x = sp.random(n, 12, density=0.3, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(X=x.toarray() if dense else x, obs=obs).write_zarr(tmp_path / "o.zarr")
    zarr.open_array(tmp_path / "o.zarr" / "obs" / "dose", mode="r+").resize((n - 1,))
    zarr.consolidate_metadata(tmp_path / "o.zarr")  # anndata's consolidated copy too
    ds = dz.open_dataset(tmp_path / "o.zarr")
    problems = {
        "donor": r"o.zarr/obs/donor: encoding 'string-array' cannot ride in a batch tensor",
        "age": r"o.zarr/obs/age: 1 missing values in a nullable column",
        "dose": r"o.zarr/obs/dose: has 39 values for 40 observations",
        "nope": r"o.zarr/obs: no column 'nope'; available columns: age, donor, dose",
    }
    for column, message in problems.items():
        with pytest.raises(dz.DatasetError, match=message):
            dz.Loader(ds, sampler(), obs=[column])


@pytest.mark.parametrize("dense", [False, True], ids=["csr-X", "dense-X"])
@pytest.mark.parametrize("device", ["cpu", "gpu-host-backend"])
def test_obs_columns_named_like_window_arrays_ride_beside_them(
    tmp_path: Path, dense: bool, device: str
) -> None:
    """Columns called ``pos``, ``data``, ``values``... (the callback's own outputs) are
    namespaced inside the graph: before, ``pos`` replaced the batch positions (wrong X, or
    a crash) and ``data`` the window's values."""
    import anndata as ad
    import pandas as pd

    from dali_zarr.graph.window_backends import HostBackend

    n = 70
    names = ["pos", "data", "indices", "indptr", "values", "nnz_hint", "batch_indptr"]
    obs = pd.DataFrame({c: np.arange(n) * (k + 2) for k, c in enumerate(names)},
                       index=[f"c{i}" for i in range(n)])  # fmt: skip
    x = sp.random(n, 9, density=0.4, format="csr", dtype=np.float32, random_state=1)
    ad.AnnData(X=x.toarray() if dense else x, obs=obs).write_zarr(tmp_path / "n.zarr")
    ds = dz.open_dataset(tmp_path / "n.zarr")
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    outputs = ["dense"] if dense else ["dense", "csr"]
    for output in outputs:
        loader = dz.Loader(ds, sampler(), output=output, obs=names, return_index=True, **where)
        got = run_epoch(loader)
        loader.close()
        np.testing.assert_array_equal(got["X"], x.toarray()[got["index"]])
        for k, column in enumerate(names):
            np.testing.assert_array_equal(got[column], got["index"] * (k + 2), err_msg=column)


def test_obs_columns_that_would_replace_x_or_index_are_refused(tmp_path: Path) -> None:
    write_anndata(tmp_path / "r.zarr", n_obs=30, n_features=8, zarr_format=3)
    ds = dz.open_dataset(tmp_path / "r.zarr")
    for obs, message in {
        ("depth", "depth"): r"obs column 'depth' is asked for twice",
        ("X",): r"obs column 'X' would replace the batch's own 'X'",
        ("X_indptr",): r"obs column 'X_indptr' would replace",
        ("index",): r"obs column 'index' would replace.*or pass return_index=False",
    }.items():
        with pytest.raises(dz.ConfigError, match=message):
            dz.Loader(ds, sampler(), obs=list(obs), return_index=True)


@pytest.mark.parametrize("stored", ["float32", "int32", "float64"])
def test_csr_output_values_take_the_dtype_asked_for(tmp_path: Path, stored: str) -> None:
    """``dtype=`` converts the CSR's values as it converts dense ``X`` (it was ignored: the
    values kept the stored dtype); float64 values are cast once, so they stay exact."""
    rng = np.random.default_rng(2)
    x = sp.random(80, 9, density=0.4, format="csr", dtype=np.float64, random_state=rng)
    x.data = x.data * 1000 + 1e-7 if stored == "float64" else np.round(x.data * 1000)
    x.data = x.data.astype(stored)
    path = tmp_path / f"{stored}.zarr"
    write_anndata_matrix(path, x)
    ds = dz.open_dataset(path)
    for dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
        loader = dz.Loader(ds, sampler(), output="csr", dtype=dtype, return_index=True)
        for batch in loader:
            assert batch["X"].layout == torch.sparse_csr and batch["X"].dtype == dtype
            want = torch.from_numpy(x[batch["index"].numpy()].toarray().astype(np.float64))
            torch.testing.assert_close(batch["X"].to_dense(), want.to(dtype), rtol=0, atol=0)
        loader.close()


def test_dense_float64_output_of_values_float32_cannot_hold_says_so(tmp_path: Path) -> None:
    """Dense X is computed in float32 (what ``transform`` sees): asking float64 of a float64
    or int32/int64 store warns that the values arrive rounded, and names the way round it."""
    import warnings

    x = sp.random(40, 6, density=0.5, format="csr", dtype=np.float64, random_state=3)
    warned = {"float64": True, "int32": True, "int64": True, "float32": False, "int16": False}
    for stored, warns in warned.items():
        path = tmp_path / f"{stored}.zarr"
        write_anndata_matrix(path, x.astype(stored))
        ds = dz.open_dataset(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dz.Loader(ds, sampler(), dtype="float64").close()
            dz.Loader(ds, sampler(), dtype="float64", output="csr").close()  # exact: no warning
        said = [str(w.message) for w in caught if "rounded to float32" in str(w.message)]
        assert len(said) == warns, (stored, said)
        if warns:
            assert said[0].startswith(f"{stored}.zarr/X: dense X is built in float32")


@pytest.mark.parametrize("device", ["cpu", "gpu-host-backend"])
def test_csr_batches_meet_torchs_invariants(tmp_path: Path, device: str) -> None:
    """Row pointers and column ids of one integer type, each row's ids increasing, also
    for a panel in another order than the store's (its rows kept the stored order, so
    sparse-sparse products came out wrong) and for uint16 column ids."""
    from dali_zarr.graph.window_backends import HostBackend

    x = sp.random(90, 30, density=0.3, format="csr", dtype=np.float32, random_state=5)
    write_anndata_matrix(tmp_path / "s.zarr", x)
    group = zarr.open_group(tmp_path / "s.zarr" / "X", mode="r+")
    narrow = group["indices"][...].astype(np.uint16)  # what anndata 0.13 may write
    del group["indices"]
    group.create_array("indices", data=narrow, chunks=(97,))
    zarr.consolidate_metadata(tmp_path / "s.zarr")
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    assert dz.open_dataset(tmp_path / "s.zarr").index_dtype == np.uint16
    panel = [f"{j}" for j in (9, 1, 5, 0, 22)]  # var names of anndata's default index
    for features in (None, panel):
        ds = dz.open_dataset(tmp_path / "s.zarr", features=features)
        want_x = x if features is None else x[:, [int(f) for f in features]]
        loader = dz.Loader(ds, sampler(), output="csr", return_index=True, **where)
        for batch in loader:
            X = batch["X"]
            crow, col = X.crow_indices(), X.col_indices()
            assert crow.dtype == col.dtype == torch.int32
            torch.sparse_csr_tensor(crow, col, X.values(), X.shape, check_invariants=True)
            want = torch.from_numpy(want_x[batch["index"].numpy()].toarray())
            torch.testing.assert_close(X.to_dense(), want, rtol=0, atol=0)
            # against a CSR of torch's own making: unsorted rows pair the wrong entries
            own = want.to_sparse_csr()
            torch.testing.assert_close((X * own).to_dense(), want * want, rtol=0, atol=0)
        loader.close()


def write_anndata_matrix(path: Path, x: sp.csr_matrix) -> None:
    import anndata as ad

    ad.AnnData(X=x).write_zarr(path)


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_collection_of_int64_and_uint64_column_ids(tmp_path: Path, output: str) -> None:
    """NumPy's common type of int64 and uint64 column ids is float64: the collection's
    windows reached the densify op with float column ids (a numba TypingError from inside
    DALI). Column ids are below the width, so the collection takes int64."""
    parts, want = [], []
    for i, ids in enumerate(("int64", "uint64")):
        x = sp.random(40, 20, density=0.3, format="csr", dtype=np.float32, random_state=i)
        path = tmp_path / f"s{i}.zarr"
        write_anndata_matrix(path, x)
        group = zarr.open_group(path / "X", mode="r+")
        retyped = group["indices"][...].astype(ids)
        del group["indices"]
        group.create_array("indices", data=retyped, chunks=(37,))
        zarr.consolidate_metadata(path)
        parts.append(path)
        want.append(x.toarray())
    ds = dz.open_dataset(parts)
    assert ds.index_dtype == np.int64
    reference = np.concatenate(want)
    loader = dz.Loader(ds, sampler(chunk_size=8, batch_size=10), output=output, return_index=True)
    seen = []
    for batch in loader:
        x = batch["X"].to_dense() if output == "csr" else batch["X"]
        if output == "csr":  # 64-bit stored ids give 64-bit CSR ids, small as they are
            assert batch["X"].crow_indices().dtype == batch["X"].col_indices().dtype
            assert batch["X"].col_indices().dtype == torch.int64
        np.testing.assert_array_equal(x.numpy(), reference[batch["index"].numpy()])
        seen.append(batch["index"].numpy())
    assert sorted(np.concatenate(seen).tolist()) == list(range(80))


def test_a_loop_replaced_by_a_newer_one_refuses_to_go_on(sc_store: Path) -> None:
    """Two generators share the one DALI pipeline: an older loop that went on would take
    the newer loop's batches, which would then miss rows. It fails instead, and the newer
    loop delivers every row."""
    loader = dz.Loader(dz.open_dataset(sc_store), sampler(), return_index=True)
    reference = run_epoch(loader)["index"]
    stale = iter(loader)
    next(stale)  # a peek, or a loop left early and kept
    fresh = iter(loader)
    first = next(fresh)
    with pytest.raises(dz.ConfigError, match="a newer loop over this loader has started"):
        next(stale)
    rows = np.concatenate([first["index"].numpy(), *(b["index"].numpy() for b in fresh)])
    np.testing.assert_array_equal(rows, reference)


def reading_through(inner, name: str, before_read: Callable[[], None] = lambda: None):
    """A user's own Dataset that reads through ``inner``, calling ``before_read()`` before
    each read: where a test starts another loop, or closes the loader, mid-batch."""
    from dali_zarr.data.dataset import Dataset

    class Through(Dataset):
        n_obs, layout = inner.n_obs, inner.layout
        feature_shape, dtype, index_dtype = inner.feature_shape, inner.dtype, inner.index_dtype

        def read_rows(self, ranges):
            before_read()
            return inner.read_rows(ranges)

        def obs_column(self, column):
            return inner.obs_column(column)

        def read_paths(self):
            return {name: "direct"}

    Through.name = name
    return Through()


def test_loops_in_two_threads_never_take_each_others_batches(sc_store: Path) -> None:
    """A loop started in another thread while this one drew a batch ran DALI from both
    threads: this loop got a batch of the newer loop's epoch, and the newer loop, run to its
    end without an error, missed those rows. The newer loop now waits for the batch being
    drawn, takes every row, and the older one is refused."""
    import threading

    inner = dz.open_dataset(sc_store)
    newer: dict[str, object] = {}
    armed = [False]

    def start_newer_loop() -> None:  # from inside a read of the older one
        if armed[0]:
            armed[0] = False
            thread = threading.Thread(
                target=lambda: newer.update(rows=[b["index"].numpy() for b in loader])
            )
            newer["thread"] = thread
            thread.start()
            thread.join(2)  # the race's chance (the fixed loader makes it wait)

    def build(dataset) -> dz.Loader:
        settings = sampler(chunk_size=25, preload_nchunks=2)  # a window per batch
        return dz.Loader(dataset, settings, return_index=True, prefetch_windows=0)

    reference = run_epoch(build(inner))["index"]
    loader = build(reading_through(inner, "gated", start_newer_loop))
    older = iter(loader)
    got = [next(older)["index"].numpy()]
    armed[0] = True
    with pytest.raises(dz.ConfigError, match="a newer loop over this loader has started"):
        for batch in older:
            got.append(batch["index"].numpy())
    newer["thread"].join()  # type: ignore[attr-defined]
    mine = np.concatenate(got)
    np.testing.assert_array_equal(mine, reference[: len(mine)])  # only its own epoch's rows
    np.testing.assert_array_equal(np.concatenate(newer["rows"]), reference)  # every row
    loader.close()


SIGNAL_STATE = """
import os, signal, sys
import dali_zarr as dz
from dali_zarr.data.dataset import Dataset

inner = dz.open_dataset(sys.argv[1])
saved = []


class Signalling(Dataset):  # a preemption signal arrives while a batch is being drawn
    name, n_obs, layout = "signalling", inner.n_obs, inner.layout
    feature_shape, dtype, index_dtype = inner.feature_shape, inner.dtype, inner.index_dtype

    def read_rows(self, ranges):
        os.kill(os.getpid(), signal.SIGUSR1)
        return inner.read_rows(ranges)

    def obs_column(self, name):
        return inner.obs_column(name)


sampler = dz.ChunkSampler(chunk_size=25, preload_nchunks=2, batch_size=50, seed=7)
if sys.argv[2] == "cpu":
    where = {}
else:
    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()}
loader = dz.Loader(Signalling(), sampler, prefetch_windows=0, **where)
signal.signal(signal.SIGUSR1, lambda *_: saved.append(loader.state_dict()["consumed"]))
n = sum(1 for _ in loader)
print(n, len(saved), saved == sorted(saved))
"""


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_a_state_saved_by_a_signal_handler_mid_batch_does_not_deadlock(
    sc_store: Path, device: str
) -> None:
    """A preemption handler (Lightning's SLURM requeue on SIGUSR1) saves the loader's state
    on the thread that is drawing a batch. state_dict() plans under the source's lock, which
    that thread held inside the DALI callback: the process hung for good, without its
    checkpoint. The locks it meets are reentrant now, and the states count the batches
    handed out (a hang is a failure here: the child runs under a timeout)."""
    import sys

    from tests.processes import run_ok

    out = run_ok([sys.executable, "-c", SIGNAL_STATE, str(sc_store), device], timeout=120)
    batches, saves, ordered = out.split()
    assert int(batches) == -(-3_001 // 50) and int(saves) > 0 and ordered == "True"


SIGNAL_RESUME = (
    SIGNAL_STATE.split("sampler = ")[0]
    + """
from nvidia.dali import fn


def noisy(outputs):
    outputs["noise"] = fn.random.uniform(range=[0.0, 1.0], shape=[2])
    return outputs


def make():
    sampler = dz.ChunkSampler(chunk_size=25, preload_nchunks=2, batch_size=50, seed=7)
    where = {} if sys.argv[2] == "cpu" else {"device": "gpu", "gpu_backend": HostBackend()}
    return dz.Loader(Signalling(), sampler, prefetch_windows=0, return_index=True,
                     transform=noisy, enable_checkpointing=True, **where)


if sys.argv[2] != "cpu":
    from dali_zarr.graph.window_backends import HostBackend
loader = make()
signal.signal(signal.SIGUSR1, lambda *_: saved.append(loader.state_dict()))
whole = [b["index"].cpu().numpy() for b in loader]
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
wrong = []
for state in saved[:5]:
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = [b["index"].cpu().numpy() for b in resumed]
    done = state["consumed"]
    if len(rest) != len(whole) - done or any(
        (a != b).any() for a, b in zip(rest, whole[done:])
    ):
        wrong.append((done, len(rest), len(whole) - done))
print(len(saved), wrong)
"""
)


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_a_state_saved_by_a_signal_handler_mid_batch_resumes_every_row(
    sc_store: Path, device: str
) -> None:
    """With enable_checkpointing=True, a state saved by a signal handler in the middle of a
    draw held DALI's checkpoint of an iterator that had already counted the batch being
    drawn, one past `consumed`: the resumed run skipped that batch (50 rows lost, no
    error). Such a state is now saved without DALI's checkpoint, at the exact position."""
    import sys

    from tests.processes import run_ok

    out = run_ok([sys.executable, "-c", SIGNAL_RESUME, str(sc_store), device], timeout=240)
    saves, wrong = out.strip().splitlines()[-1].split(" ", 1)
    assert int(saves) > 0 and wrong == "[]"


SIGNAL_NEXT_EPOCH = (
    SIGNAL_RESUME.split("def make():")[0]
    + """
armed = []
Signalling.read_rows = lambda self, ranges: (
    armed and os.kill(os.getpid(), signal.SIGUSR1), inner.read_rows(ranges))[1]


def make():
    sampler = dz.ChunkSampler(chunk_size=25, preload_nchunks=2, batch_size=50, seed=7)
    where = {} if sys.argv[2] == "cpu" else {"device": "gpu", "gpu_backend": HostBackend()}
    return dz.Loader(
        Signalling(), sampler, prefetch_windows=0, return_index=True, transform=noisy,
        enable_checkpointing=True, **where,
    )


if sys.argv[2] != "cpu":
    from dali_zarr.graph.window_backends import HostBackend
loader = make()
whole = []  # epoch 1's batches handed out so far
signal.signal(signal.SIGUSR1, lambda *_: saved.append((loader.state_dict(), len(whole))))
for k, _ in enumerate(loader):  # a loop left early: the next one drains DALI's prefetch
    if k == 2:
        break
loader.set_epoch(1)
armed.append(True)
for batch in loader:
    whole.append(batch["index"].cpu().numpy())
armed.clear()
wrong = []
for state, handed in saved[:4]:  # the resumed run must deliver what was not handed out
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = [b["index"].cpu().numpy() for b in resumed]
    # the loader counts a batch once next() returns it, before the loop body appends it:
    # a signal between the two saves one batch more than `whole` holds (it was handed out)
    done = state["consumed"]
    if (
        state["epoch"] != 1
        or done - handed not in (0, 1)
        or len(rest) != len(whole) - done
        or any((a != b).any() for a, b in zip(rest, whole[done:]))
    ):
        wrong.append((handed, done, len(rest)))
print(len(saved), wrong)
"""
)


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_a_state_saved_by_a_signal_handler_as_an_epoch_starts_loses_no_batch(
    sc_store: Path, device: str
) -> None:
    """The next loop marked its epoch as the run before it drained the batches DALI had
    prefetched past a loop left early, with the old loop's count still in place: a state
    a signal handler saved in that drain said epoch 1 at batch 3, and the resumed run
    skipped epoch 1's first 3 batches (no error). It now says batch 0."""
    import sys

    from tests.processes import run_ok

    out = run_ok([sys.executable, "-c", SIGNAL_NEXT_EPOCH, str(sc_store), device], timeout=240)
    saves, wrong = out.strip().splitlines()[-1].split(" ", 1)
    assert int(saves) > 0 and wrong == "[]"


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_a_loader_closed_while_it_draws_a_batch_says_so(sc_store: Path, device: str) -> None:
    """close() from another thread (a watchdog, a signal handler) while a batch was being
    read failed the loop with the reader's own error: "RuntimeError: cannot schedule new
    futures after shutdown" on the CPU path, RingClosed on the GPU path's. It is the
    closed loader's ConfigError now."""
    from dali_zarr.graph.window_backends import HostBackend

    armed = [False]

    def close_loader() -> None:  # from inside a read, as another thread may
        if armed[0]:
            armed[0] = False
            loader.close()

    closing = reading_through(dz.open_dataset(sc_store), "closing", close_loader)
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    loader = dz.Loader(closing, sampler(), **where)
    armed[0] = True  # the first window: read while the first next() waits for it
    with pytest.raises(dz.ConfigError, match=r"Loader of closing was closed"):
        next(iter(loader))


def test_big_endian_obs_columns_arrive_as_their_values(tmp_path: Path) -> None:
    """zarr v2 keeps a column's byte order (``>f8``, ``>i8``); DALI and torch read bytes as
    native, so the loader converts: batches carry the values, not byte-swapped garbage."""
    write_anndata(tmp_path / "be.zarr", n_obs=90, n_features=20, zarr_format=2)
    obs = zarr.open_group(tmp_path / "be.zarr" / "obs", mode="r+")
    depth = np.asarray(obs["depth"][...])
    for name, values in {
        "depth": depth.astype(">f8"),
        "count": np.arange(90, dtype=">i8") * 7,
    }.items():
        column = obs.create_array(name, shape=values.shape, dtype=values.dtype, overwrite=True)
        column[...] = values
        column.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    zarr.consolidate_metadata(tmp_path / "be.zarr")  # anndata's consolidated copy too
    ds = dz.open_dataset(tmp_path / "be.zarr")
    got = run_epoch(dz.Loader(ds, sampler(), obs=["depth", "count"], return_index=True))
    np.testing.assert_array_equal(got["depth"], depth[got["index"]])
    np.testing.assert_array_equal(got["count"], got["index"] * 7)


def test_categorical_codes_past_the_categories_are_refused(tmp_path: Path) -> None:
    """A code with no category would index past the merged category list (or name no
    label at all): the column is refused at open, naming its codes and the first bad row."""
    write_anndata(tmp_path / "cat.zarr", n_obs=60, n_features=20, zarr_format=3)
    codes = zarr.open_array(tmp_path / "cat.zarr" / "obs" / "cell_type" / "codes", mode="r+")
    codes[17] = 3  # three categories: B, NK, T
    ds = dz.open_dataset(tmp_path / "cat.zarr")
    with pytest.raises(
        dz.DatasetError,
        match=r"cat\.zarr/obs/cell_type/codes: 1 codes outside \[-1, 3\) "
        r"\(the first at row 17: 3\)",
    ):
        dz.Loader(ds, sampler(), obs=["cell_type"])


def test_csr_read_rows_refuses_ranges_outside_the_matrix(tmp_path: Path) -> None:
    """A negative range would index indptr from the end and return other rows."""
    write_anndata(tmp_path / "r.zarr", n_obs=20, n_features=10, zarr_format=3)
    ds = dz.open_dataset(tmp_path / "r.zarr")
    for bad in ([[-3, -1]], [[5, 25]], [[7, 5]]):
        with pytest.raises(ValueError, match=r"r\.zarr/X: range 0 .* is not within \[0, 20\]"):
            ds.read_rows(np.array(bad))
    assert ds.read_rows(np.zeros((0, 2), np.int64)).n_rows == 0


def test_bad_column_ids_are_refused(tmp_path: Path) -> None:
    """indices beyond the declared width would be written out of bounds: refuse loudly."""
    path = Path(synthetic.make_single_cell(tmp_path / "w.zarr", n_obs=200, n_features=50))
    group = zarr.open_group(path, mode="r+")
    group["X"].attrs["shape"] = [200, 10]
    with pytest.raises(dz.DatasetError, match=r"var has 50 names but .*X is 10 features wide"):
        dz.open_dataset(path)  # with a var index the width is checked at open
    del group["var"]  # without one, the ids are checked as they are read
    loader = dz.Loader(dz.open_dataset(path), sampler())
    with pytest.raises(dz.DatasetError, match=r"X/indices.*outside \[0, 10\)"):
        for _ in loader:
            pass


@pytest.mark.parametrize(
    ("shard_chunks", "force_zarr", "where"),
    [
        (None, False, r"chunk 'c/3' \(.*X/indices/c/3\)"),
        (2, False, r"inner chunk \(1,\) \(array chunk \(3,\)\) of shard 'c/1'"),
        (None, True, r"chunk \(3,\) of .*X/indices"),
    ],
    ids=["direct", "direct-sharded", "zarr-fallback"],
)
@pytest.mark.parametrize("bad", [40, -1])
def test_a_bad_column_id_is_named_by_element_row_and_chunk(
    tmp_path: Path, shard_chunks: int | None, force_zarr: bool, where: str, bad: int
) -> None:
    """One id past the matrix's width, or below 0 (the bound is one max() over the ids
    viewed unsigned): the error points at it (element, row, chunk)."""
    path = synthetic.make_single_cell(
        tmp_path / "one_bad.zarr", n_obs=300, n_features=40, density=0.2,
        chunk_elements=256, shard_chunks=shard_chunks,
    )  # fmt: skip
    group = zarr.open_group(path, mode="r+")
    indptr = group["X/indptr"][:]
    row = int(np.searchsorted(indptr, 3 * 256 + 10, side="right")) - 1  # a row in chunk 3
    element = int(indptr[row])
    assert element // 256 == 3 and indptr[row + 1] > element
    group["X/indices"][element] = bad
    ds = dz.open_dataset(path, force_zarr=force_zarr)
    assert ds.read_paths()["one_bad.zarr/X/indices"].startswith("zarr" if force_zarr else "direct")
    message = rf"column index {bad} is outside \[0, 40\): element {element:,} \(row {row:,} of "
    with pytest.raises(dz.DatasetError, match=message + rf".*X\), in {where}"):
        for _ in dz.Loader(ds, sampler(chunk_size=32, batch_size=64)):
            pass


def test_csc_store_refused(tmp_path: Path) -> None:
    import anndata as ad

    x = sp.random(20, 5, density=0.3, format="csc", dtype=np.float32)
    ad.AnnData(X=x).write_zarr(tmp_path / "csc.zarr")
    with pytest.raises(dz.DatasetError, match="CSC"):
        dz.open_dataset(tmp_path / "csc.zarr")


def test_force_zarr_path_gives_same_batches(sc_store: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.zarr"
    shutil.copytree(sc_store, copy)
    direct = dz.open_dataset(copy)
    fallback = dz.open_dataset(copy, force_zarr=True)
    assert set(direct.read_paths().values()) == {"direct"}
    assert all(v.startswith("zarr") for v in fallback.read_paths().values())
    a = run_epoch(dz.Loader(direct, sampler(), return_index=True), 2)
    b = run_epoch(dz.Loader(fallback, sampler(), return_index=True), 2)
    np.testing.assert_array_equal(a["index"], b["index"])
    np.testing.assert_array_equal(a["X"], b["X"])


def test_a_store_given_by_url_is_read_through_zarr(tmp_path: Path) -> None:
    """A URL opens through zarr's fsspec store (an anndata store put on fsspec's memory
    file system stands in for a bucket) and gives the local store's batches; ``file://``
    is a local store, read directly; a protocol whose package is missing says which."""
    import fsspec

    from dali_zarr.inspection import inspect_store

    local = tmp_path / "cells.zarr"
    write_anndata(local, n_obs=300, n_features=20, zarr_format=3)
    remote = f"memory://{tmp_path.name}/cells.zarr"
    fsspec.filesystem("memory").put(str(local), remote, recursive=True)
    try:
        want = run_epoch(dz.Loader(dz.open_dataset(local), sampler(), obs=["cell_type"],
                                   return_index=True))  # fmt: skip
        ds = dz.open_dataset(remote)
        assert ds.name == "cells.zarr/X"
        assert all(v.startswith("zarr") for v in ds.read_paths().values())
        got = run_epoch(dz.Loader(ds, sampler(), obs=["cell_type"], return_index=True))
        for key in ("index", "X", "cell_type"):
            np.testing.assert_array_equal(got[key], want[key])
        report = inspect_store(remote)
        assert report.kind == "anndata" and report.n_obs == 300
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)
    assert set(dz.open_dataset(local.as_uri()).read_paths().values()) == {"direct"}
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(dz.DatasetError, match=r"gs://bucket/cells\.zarr: .*gcsfs"):
            dz.open_dataset("gs://bucket/cells.zarr")


def test_device_auto_says_which_path(sc_store: Path, caplog) -> None:
    from dali_zarr.graph.gpu_pipeline import gpu_status

    usable, found = gpu_status()
    with caplog.at_level("INFO", logger="dali_zarr.loader"):
        loader = dz.Loader(dz.open_dataset(sc_store), sampler(), device="auto")
    assert loader.device == ("gpu" if usable else "cpu")
    assert loader.device_reason == found and f"{found} for device='auto'" in caplog.text
    if not usable:
        assert "CPU path" in found
        with pytest.raises(dz.ConfigError, match="device='gpu' but the GPU path is not usable"):
            dz.Loader(dz.open_dataset(sc_store), sampler(), device="gpu")


def test_dali_checkpointing_takes_unsigned_outputs(tmp_path: Path) -> None:
    """With ``enable_checkpointing`` batches leave through DALI's own iterator, whose type
    table has no uint16/32/64: bfloat16 (uint16 bits), uint16 column ids and unsigned obs
    columns failed with a KeyError. They arrive as without checkpointing."""
    import anndata as ad
    import pandas as pd

    rng = np.random.default_rng(2)
    x = sp.random(300, 40, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame({"plate": rng.integers(0, 70_000, 300).astype(np.uint32)})
    obs.index = obs.index.astype(str)
    path = tmp_path / "unsigned.zarr"
    ad.AnnData(X=x, obs=obs).write_zarr(path)
    group = zarr.open_group(str(path), mode="r+")
    ids = group["X/indices"][...]
    indices = group.create_array(
        "X/indices", shape=ids.shape, dtype="uint16", chunks=(500,), overwrite=True
    )
    indices[...] = ids.astype(np.uint16)  # not through group[...]: its stale consolidated view
    zarr.consolidate_metadata(str(path))  # wrote the old int32 layout, which this read back
    assert dz.open_dataset(path).index_dtype == np.uint16
    ds = dz.open_dataset(path)
    for output, dtype in (("dense", torch.bfloat16), ("csr", torch.bfloat16), ("csr", "float32")):
        kw = dict(output=output, dtype=dtype, obs=["plate"], return_index=True)
        plain = dz.Loader(ds, sampler(), **kw)
        checked = dz.Loader(ds, sampler(), **kw, enable_checkpointing=True)
        n = 0
        for a, b in zip(plain, checked, strict=True):
            assert a.keys() == b.keys() and a["plate"].dtype == torch.uint32
            for name in a:
                want, got = a[name], b[name]
                if want.layout == torch.sparse_csr:
                    want, got = want.to_dense(), got.to_dense()
                assert got.dtype == want.dtype, name
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
            n += 1
        assert n == len(plain) > 0
        assert checked.state_dict()["dali"] is not None
        plain.close()
        checked.close()


def test_a_sampler_unpickled_where_torch_distributed_is_not_set_up_exchanges_nothing(
    sc_store: Path,
) -> None:
    """A DistributedSampler whose ranks were checked (its flag travels with it when pickled,
    e.g. into a worker process) builds a Loader where torch.distributed is not initialized:
    the Loader asks this process's world, not the flag, and exchanges nothing."""
    import pickle

    from dali_zarr.planning.samplers import _restore_distributed

    checked = _restore_distributed(sampler(), 1, 2, 0, True, "chunks", "torch")
    again = pickle.loads(pickle.dumps(checked))
    assert again.ranks_checked and again.exchange == "torch"
    with dz.Loader(dz.open_dataset(sc_store), again) as loader:
        assert len(list(loader)) == len(loader) > 0
    # pickled before the exchange was named: a flag, read as torch's (or none)
    old = [_restore_distributed(sampler(), 1, 2, 0, True, "chunks", f) for f in (True, False)]
    assert [(s.exchange, s.ranks_checked) for s in old] == [("torch", True), (None, False)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_threads": 0}, "num_threads must be a whole number from 1 to 1024"),
        ({"num_threads": 100_000}, r"from 1 to 1024 \(DALI aborts the process.*got 100000"),
        ({"prefetch_queue_depth": 0}, "prefetch_queue_depth must be a positive integer"),
        ({"prefetch_windows": 1.5}, "prefetch_windows must be a non-negative integer"),
        ({"prefetch_windows": -1}, "prefetch_windows must be a non-negative integer, got -1"),
        ({"dtype": None}, "dtype=None is not offered"),
        ({"obs": "cell_type"}, r"obs='cell_type': pass a list of column names"),
    ],
)
@pytest.mark.parametrize("where", ["cpu", "gpu-path-on-host"])
def test_loader_options_out_of_range_are_refused_by_name(sc_store: Path, kwargs, message, where):
    """These failed inside DALI at the first batch (100,000 threads aborted the process), in
    the callback (prefetch_windows=1.5), were clamped (-1) or taken as float64 (dtype=None),
    or read obs='ct' as columns 'c' and 't'."""
    from dali_zarr.graph.window_backends import HostBackend

    path = {"device": "gpu", "gpu_backend": HostBackend()} if where != "cpu" else {}
    with pytest.raises(dz.ConfigError, match=message):
        dz.Loader(dz.open_dataset(sc_store), sampler(), **kwargs, **path)


@pytest.mark.parametrize("device_id", ["cuda:1", 1.7, True, -1])
def test_a_device_id_that_is_no_gpu_index_is_refused(sc_store: Path, device_id) -> None:
    """int(device_id) gave a bare ValueError for torch's spelling "cuda:1", took 1.7 and
    True as GPU 1, and passed -1 on to DALI (its "no GPU")."""
    from dali_zarr.graph.window_backends import HostBackend

    with pytest.raises(dz.ConfigError, match=r"device_id must be a GPU index.*device_id=1\)"):
        dz.Loader(
            dz.open_dataset(sc_store),
            sampler(),
            device="gpu",
            gpu_backend=HostBackend(),
            device_id=device_id,
        )
    with dz.Loader(
        dz.open_dataset(sc_store), sampler(), device="gpu", gpu_backend=HostBackend(),
        device_id=np.int64(0),
    ) as loader:  # fmt: skip
        assert loader.device_id == 0


@pytest.mark.parametrize("how", ["returns-nothing", "drops-a-csr-part"])
def test_a_transform_that_loses_outputs_is_named(sc_store: Path, how: str) -> None:
    """A transform may add, drop or rename outputs, but returning nothing failed with a
    TypeError, and one part of the batch CSR alone with a KeyError, from deep inside."""

    def forgets_return(o):
        o["X"] = o["X"] * 2.0

    def drops_indptr(o):
        del o["X_indptr"]
        return o

    transform = forgets_return if how == "returns-nothing" else drops_indptr
    output = "dense" if how == "returns-nothing" else "csr"
    message = (
        "transform returned NoneType"
        if how == "returns-nothing"
        else "returned X_data, X_indices without X_indptr"
    )
    with (
        dz.Loader(dz.open_dataset(sc_store), sampler(), transform=transform, output=output) as ld,
        pytest.raises(dz.ConfigError, match=message),
    ):
        next(iter(ld))


def test_a_transform_may_drop_and_rename_outputs(sc_store: Path) -> None:
    def renamed(o):
        return {"features": o["X"]}  # no index, X under another name

    with dz.Loader(dz.open_dataset(sc_store), sampler(), transform=renamed,
                   return_index=True) as ld:  # fmt: skip
        batch = next(iter(ld))
    assert list(batch) == ["features"] and batch["features"].dtype == torch.float32


def test_open_dataset_points_datasets_to_collection(sc_store: Path) -> None:
    panel = dz.open_dataset(sc_store, features=[0, 1])
    with pytest.raises(dz.ConfigError, match=r"not datasets .*dz.Collection"):
        dz.open_dataset([panel, panel])


def test_a_dataset_of_ones_own_needs_only_rows_and_obs(sc_store: Path) -> None:
    """Dataset.readers() (what check_unchanged watches) came in as an abstract method, so a
    subclass written against read_paths() stopped instantiating. It defaults to none."""
    inner = dz.open_dataset(sc_store)
    mine = reading_through(inner, "wrapped")
    mine.check_unchanged()  # nothing of its own to watch
    with dz.Loader(mine, sampler(), device="cpu") as loader:
        assert sum(len(b["X"]) for b in loader) == inner.n_obs


def test_canonical_csr_sums_the_ids_a_row_stores_twice():
    """A row storing a column id more than once (scipy allows it and sums them) came out
    with the repeats: an invalid torch CSR whose sparse-sparse products paired the wrong
    entries. Sorted rows now hold each id once, its values summed in stored order (an
    unstable sort had put them in another order on the CPU than on the GPU)."""
    import torch

    from dali_zarr.loader import canonical_csr

    rng = np.random.default_rng(0)
    col = rng.integers(0, 50, 5000)
    values = rng.standard_normal(5000).astype(np.float32)
    crow = np.array([0, 2500, 2500, 5000])
    for sort_rows in (True, False):
        x = canonical_csr(torch.from_numpy(crow), torch.from_numpy(col),
                          torch.from_numpy(values), n_features=50, sort_rows=sort_rows)  # fmt: skip
        want = sp.csr_matrix((values, col, crow), shape=(3, 50))
        want.sum_duplicates()
        np.testing.assert_array_equal(x.crow_indices().numpy(), want.indptr)
        np.testing.assert_array_equal(x.col_indices().numpy(), want.indices)
        np.testing.assert_allclose(x.values().numpy(), want.data, rtol=1e-5, atol=1e-5)


def assert_canonical_csr(X: torch.Tensor, want: np.ndarray) -> None:
    """``X`` is a valid torch CSR (each row's ids strictly increasing) holding ``want``, and
    a sparse-sparse product with it pairs the right entries."""
    torch.sparse_csr_tensor(
        X.crow_indices(), X.col_indices(), X.values(), X.shape, check_invariants=True
    )
    dense = torch.from_numpy(want)
    torch.testing.assert_close(X.to_dense(), dense, rtol=0, atol=0)
    own = dense.to_sparse_csr()
    torch.testing.assert_close((X * own).to_dense(), dense * dense, rtol=0, atol=0)
    torch.testing.assert_close((X * X).to_dense(), dense * dense, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "gpu-host-backend"])
@pytest.mark.parametrize("stored", ["float32", "bool"])
def test_a_column_id_a_row_stores_twice_comes_out_once(
    tmp_path: Path, device: str, stored: str
) -> None:
    """anndata writes a non-canonical scipy CSR as it is: dense X summed a row's repeated
    ids (as scipy does), but output="csr" handed the repeats on, so torch's invariants
    failed and X * X gave 1 + 4 where 9 was meant. They are summed into one entry now; a
    bool store's True twice is 1, as in scipy and the dense output (not 2)."""
    import anndata as ad

    from dali_zarr.graph.window_backends import HostBackend

    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 8, 60)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = rng.integers(0, 10, indptr[-1]).astype(np.int32)  # repeats within rows
    data = rng.integers(1, 5, indptr[-1]).astype(stored)
    x = sp.csr_matrix((data, indices, indptr), shape=(60, 10))
    assert not x.has_canonical_format
    ad.AnnData(X=x).write_zarr(tmp_path / "d.zarr")
    full = x.toarray().astype(np.float32)  # sums the repeats (bool: any)
    assert full.max() > 1 or stored == "bool"
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    ds = dz.open_dataset(tmp_path / "d.zarr")
    with dz.Loader(ds, sampler(chunk_size=16, batch_size=10), output="csr",
                   return_index=True, **where) as loader:  # fmt: skip
        seen = []
        for batch in loader:
            assert_canonical_csr(batch["X"], full[batch["index"].numpy()])
            seen.append(batch["index"].numpy())
    assert sorted(np.concatenate(seen)) == list(range(60))


def test_a_bool_csr_with_a_column_id_stored_twice_densifies_to_one(tmp_path: Path) -> None:
    """Dense X of a bool CSR adds a row's values up per column, as for numbers, so a column id
    stored twice (a non-canonical CSR) gave 2.0 where scipy's ``toarray()`` gives True."""
    import anndata as ad

    x = sp.csr_matrix(
        (np.array([True, True, True, False]), np.array([1, 1, 2, 0]), np.array([0, 3, 4])),
        shape=(2, 3),
    )
    path = tmp_path / "bool.zarr"
    ad.AnnData(X=sp.csr_matrix(np.zeros((2, 3), bool))).write_zarr(path)
    group = zarr.open_group(path, mode="a")["X"]
    for name in ("data", "indices", "indptr"):
        del group[name]
        values = getattr(x, name)
        group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=(10,))[...] = values
    zarr.consolidate_metadata(path)
    sampler = dz.ChunkSampler(chunk_size=2, preload_nchunks=1, batch_size=2, shuffle=False)
    with dz.Loader(dz.open_dataset(path), sampler, device="cpu") as loader:
        (batch,) = loader
    np.testing.assert_array_equal(batch["X"].numpy(), x.toarray().astype(np.float32))


def test_integer_and_bool_categories_are_named_as_text(tmp_path: Path) -> None:
    """``categories()`` names every category as text (README "Use"), integers and bools too,
    and a batch's codes index them."""
    import anndata as ad
    import pandas as pd

    obs = pd.DataFrame(
        {"batch": pd.Categorical([3, 1, 3, 1]), "ok": pd.Categorical([True, False, True, True])},
        index=[f"c{i}" for i in range(4)],
    )
    ad.AnnData(X=np.ones((4, 2), np.float32), obs=obs).write_zarr(tmp_path / "cats.zarr")
    sampler = dz.ChunkSampler(chunk_size=4, preload_nchunks=1, batch_size=4, shuffle=False)
    ds = dz.open_dataset(tmp_path / "cats.zarr")
    with dz.Loader(ds, sampler, obs=["batch", "ok"], device="cpu") as loader:
        (batch,) = loader
        assert loader.categories("batch") == ("1", "3")
        assert loader.categories("ok") == ("False", "True")
    assert [loader.categories("batch")[c] for c in batch["batch"]] == ["3", "1", "3", "1"]
    assert [loader.categories("ok")[c] for c in batch["ok"]] == ["True", "False", "True", "True"]


def test_date_and_float32_categories_are_named_as_pandas_prints_them(tmp_path: Path) -> None:
    """Date categories were named by their stored unit: anndata 0.12 writes nanoseconds,
    which came out as integers, so a collection beside a store with microseconds (anndata
    0.13) gave one date two codes; float32 categories were named by their float64 value
    (``0.10000000149011612``). Both are named as pandas prints them now, and merge."""
    import anndata as ad
    import pandas as pd

    days = pd.to_datetime(
        ["2021-05-05", "2020-01-01 00:00:00.5", "2021-05-05", "1969-12-31"], format="ISO8601"
    )
    obs = pd.DataFrame(
        {"day": pd.Categorical(days), "dose": pd.Categorical(np.float32([0.1, 0.5, 0.1, 0.5]))},
        index=[f"c{i}" for i in range(4)],
    )
    adata = ad.AnnData(X=np.ones((4, 2), np.float32), obs=obs)
    for name in ("ns.zarr", "us.zarr"):
        adata.write_zarr(tmp_path / name)
    group = zarr.open_group(tmp_path / "us.zarr", mode="r+")["obs"]
    # the other store: dates in microseconds (as anndata 0.13 writes them), doses in float64
    for column, values in (
        ("day", group["day/categories"][...].astype("datetime64[us]")),
        ("dose", np.array([0.1, 0.5])),
    ):
        assert group[f"{column}/categories"].dtype != values.dtype  # 0.12's: ns and float32
        del group[f"{column}/categories"]
        group.create_array(f"{column}/categories", data=values).attrs.update(
            {"encoding-type": "array", "encoding-version": "0.2.0"}
        )
    zarr.consolidate_metadata(tmp_path / "us.zarr")
    names = {"day": tuple(str(d) for d in days.unique().sort_values())}
    names["dose"] = ("0.1", "0.5")
    for stores in (["ns.zarr"], ["us.zarr"], ["ns.zarr", "us.zarr"]):
        ds = dz.open_dataset([tmp_path / s for s in stores])
        for column in ("day", "dose"):
            assert ds.categories(column) == names[column], (stores, column)
            got = np.array(names[column])[ds.obs_column(column).values]
            want = [str(np.float32(v)) if column == "dose" else str(v) for v in obs[column]]
            assert got.tolist() == want * len(stores), (stores, column)


def test_obs_errors_of_a_collection_name_the_part(tmp_path: Path) -> None:
    """Stores are named by their folder's name, so run1/cells.zarr beside run2/cells.zarr
    gave errors that named neither; the part's position in the collection is named too."""
    for run, columns in (("run1", ["depth"]), ("run2", [])):
        (tmp_path / run).mkdir()
        write_anndata(tmp_path / run / "cells.zarr", n_obs=20, n_features=4, zarr_format=3)
        group = zarr.open_group(tmp_path / run / "cells.zarr", mode="r+")["obs"]
        if "depth" not in columns:
            del group["depth"]
            zarr.consolidate_metadata(tmp_path / run / "cells.zarr")
    ds = dz.open_dataset([tmp_path / "run1" / "cells.zarr", tmp_path / "run2" / "cells.zarr"])
    with pytest.raises(dz.DatasetError, match=r"cells.zarr/X \(part 1\): .*no column 'depth'"):
        ds.obs_column("depth")


@pytest.mark.parametrize("device", ["cpu", "gpu-host"])
def test_csr_output_through_a_transform_takes_the_dtype_asked_for(
    sc_store: Path, device: str
) -> None:
    """``output="csr"``, ``dtype="float64"`` and a transform (even one that changes
    nothing) gave float32 values: NumPy takes ``None == np.dtype("float64")`` as true, and
    None stood for the values' unknown dtype after a transform, so the cast was skipped."""
    from dali_zarr.graph.window_backends import HostBackend

    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    reference = csr_reference(sc_store).toarray()
    for transform in (None, lambda outputs: outputs):
        loader = dz.Loader(
            dz.open_dataset(sc_store), sampler(), output="csr", dtype="float64",
            return_index=True, transform=transform, **where,
        )  # fmt: skip
        with loader:
            batch = next(iter(loader))
        x = batch["X"].cpu()
        assert x.values().dtype == torch.float64, (transform, x.values().dtype)
        np.testing.assert_array_equal(x.to_dense().numpy(), reference[batch["index"].cpu()])


def test_arguments_of_the_wrong_kind_are_refused_by_name(sc_store: Path) -> None:
    """A path for the dataset, None (or torch's sampler) for the sampler, obs that are not
    column names, an epoch that is not a whole number and a state that is not a dict failed
    with raw AttributeErrors and TypeErrors, or (set_epoch(1.5), set_epoch(True)) ran
    another epoch than asked."""
    ds = dz.open_dataset(sc_store)
    with pytest.raises(dz.ConfigError, match="open_dataset"):
        dz.Loader(str(sc_store), sampler())
    with pytest.raises(dz.ConfigError, match="ChunkSampler"):
        dz.Loader(ds, None)
    with pytest.raises(dz.ConfigError, match="ChunkSampler"):
        dz.Loader(ds, torch.utils.data.DistributedSampler(range(10), num_replicas=1, rank=0))
    for obs in (5, [5], ["cell_type", None]):  # a bare TypeError, or a KeyError deep down
        with pytest.raises(dz.ConfigError, match=r"obs=.*obs column names \(strings\)"):
            dz.Loader(ds, sampler(), obs=obs)
    loader = dz.Loader(ds, sampler())
    for epoch in ("1", 1.5, True, -1):
        with pytest.raises(dz.ConfigError, match="epoch"):
            loader.set_epoch(epoch)
    loader.set_epoch(np.int64(2))
    assert loader.epoch == 2 and type(loader.epoch) is int
    for state in (None, "state", 3):
        with pytest.raises(dz.ConfigError, match="load_state_dict takes a dict"):
            loader.load_state_dict(state)
    loader.close()


def test_the_bare_pipeline_of_readme_yields_the_loaders_batch(sc_store: Path) -> None:
    """README: ``dz.build_pipeline`` builds the bare DALI pipeline. Over a BatchSource with
    no epoch bound it yields no batch (a StopIteration on its first run, with no word of
    why); bound as README says, its first batch is the Loader's."""
    from dali_zarr.graph.source import BatchSource

    ds = dz.open_dataset(sc_store)
    source = BatchSource(ds, sampler(), output="dense", obs=["cell_type"], return_index=True)
    source.bind_epoch(0, 1)  # DALI's epoch 0 serves the sampler's epoch 1
    pipe, names = dz.build_pipeline(source)
    pipe.build()
    got = {name: out.as_array()[0] for name, out in zip(names, pipe.run(), strict=True)}
    source.close()
    with dz.Loader(ds, sampler(), obs=["cell_type"], return_index=True) as loader:
        loader.set_epoch(1)
        want = next(iter(loader))
    for name in ("X", "cell_type", "index"):
        np.testing.assert_array_equal(got[name], want[name].numpy())


def test_text_obs_columns_and_the_obs_index_point_to_return_index(tmp_path: Path) -> None:
    """Asking for the obs index (``obs_names``, e.g. cell barcodes) was refused with "convert
    it to a categorical column", although it is no column of obs; per-cell text is what
    ``return_index=True`` serves. A nullable boolean with missing values was said to miss
    "integers"."""
    import anndata as ad
    import pandas as pd

    n = 40
    obs = pd.DataFrame(
        {
            "donor": [f"d{i}" for i in range(n)],
            "doublet": pd.array([None, *([True, False] * 20)][:n], dtype="boolean"),
        },
        index=pd.Index([f"c{i}" for i in range(n)], name="barcode"),
    )
    x = sp.random(n, 12, density=0.3, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(X=x, obs=obs).write_zarr(tmp_path / "o.zarr")
    ds = dz.open_dataset(tmp_path / "o.zarr")
    problems = {
        "barcode": r"o.zarr/obs/barcode: is the obs index \(obs_names\).*return_index=True",
        "donor": r"o.zarr/obs/donor: encoding 'string-array' cannot ride.*return_index=True",
        "doublet": r"o.zarr/obs/doublet: 1 missing values in a nullable column "
        r"\(the first at row 0\); batches cannot carry missing booleans",
    }
    for column, message in problems.items():
        with pytest.raises(dz.DatasetError, match=message):
            dz.Loader(ds, sampler(), obs=[column])


@pytest.mark.parametrize("device", ["cpu", "gpu-host-backend"])
def test_csr_rows_stored_unsorted_come_out_sorted(tmp_path: Path, device: str) -> None:
    """anndata writes a CSR's column ids as scipy holds them: after ``adata[:, genes]`` in
    another order than var's (a model's gene order) each row's ids are unsorted on disk.
    Only a reordered panel sorted its batches, so output="csr" broke torch's CSR invariants
    there and sparse-sparse products paired the wrong entries, silently."""
    import anndata as ad
    import pandas as pd

    from dali_zarr.graph.window_backends import HostBackend

    x = sp.random(90, 30, density=0.3, format="csr", dtype=np.float32, random_state=4)
    names = [f"g{j}" for j in range(30)]
    adata = ad.AnnData(X=x, var=pd.DataFrame(index=names))
    order = list(np.random.default_rng(0).permutation(30))
    written = adata[:, [names[j] for j in order]].copy()  # what anndata's users write
    assert not written.X.has_sorted_indices
    written.write_zarr(tmp_path / "u.zarr")
    stored = zarr.open_group(tmp_path / "u.zarr")["X/indices"][...]
    assert np.any(np.diff(stored[: written.X.indptr[1]]) < 0), "row 0 is stored unsorted"
    where = {"device": "gpu", "gpu_backend": HostBackend()} if device != "cpu" else {}
    full = written.X.toarray()
    for features in (None, [2, 7, 11]):  # a panel in stored order sorts nothing itself
        ds = dz.open_dataset(tmp_path / "u.zarr", features=features)
        want_x = full if features is None else full[:, features]
        loader = dz.Loader(ds, sampler(), output="csr", return_index=True, **where)
        for batch in loader:
            assert_canonical_csr(batch["X"], want_x[batch["index"].numpy()])
        loader.close()
