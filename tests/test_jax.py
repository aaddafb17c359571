"""JaxLoader: the torch Loader's batches as jax arrays, and dist_info="jax" across two real
JAX CPU processes (jax.distributed on localhost)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.planning import iter_batches

jax = pytest.importorskip("jax")
from jax.experimental import sparse as jsparse  # noqa: E402

from dali_zarr.jax_loader import JaxLoader  # noqa: E402
from tests.processes import child_env, free_port, start, wait_all  # noqa: E402

WORKER = Path(__file__).with_name("jax_worker.py")


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("jax") / "sc.zarr"
    return synthetic.make_single_cell(path, n_obs=777, n_features=32, chunk_elements=512)


def sampler(**overrides) -> dz.ChunkSampler:
    settings = dict(chunk_size=32, preload_nchunks=4, batch_size=50, shuffle=True, seed=11)
    settings.update(overrides)
    return dz.ChunkSampler(**settings)


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_same_batches_as_torch_loader(small_store: str, output: str) -> None:
    dataset = dz.open_dataset(small_store)
    kwargs = dict(obs=["cell_type"], return_index=True, output=output)
    jl = JaxLoader(dataset, sampler(), **kwargs)
    tl = dz.Loader(dataset, sampler(), **kwargs)
    orders = []
    for epoch in (0, 1):
        jl.set_epoch(epoch)
        tl.set_epoch(epoch)
        jax_batches = list(jl)  # all held at once: buffers must not be reused under us
        torch_batches = list(tl)
        assert len(jax_batches) == len(torch_batches) == len(jl) == -(-777 // 50)
        for a, b in zip(jax_batches, torch_batches, strict=True):
            assert set(a) == set(b) == {"X", "cell_type", "index"}
            if output == "csr":
                assert isinstance(a["X"], jsparse.BCSR) and a["X"].shape == (len(a["index"]), 32)
                # densified with scipy: BCSR.todense would compile anew for every nnz
                data, indices, indptr = (
                    np.asarray(v) for v in (a["X"].data, a["X"].indices, a["X"].indptr)
                )
                x = sp.csr_matrix((data, indices, indptr), shape=a["X"].shape).toarray()
                ref = b["X"].to_dense().numpy()
            else:
                assert isinstance(a["X"], jax.Array) and a["X"].dtype == np.float32
                x, ref = np.asarray(a["X"]), b["X"].numpy()
            np.testing.assert_array_equal(x, ref)
            np.testing.assert_array_equal(np.asarray(a["index"]), b["index"].numpy())
            np.testing.assert_array_equal(np.asarray(a["cell_type"]), b["cell_type"].numpy())
        index = np.concatenate([np.asarray(a["index"]) for a in jax_batches])
        assert np.array_equal(np.sort(index), np.arange(777))
        orders.append(index)
    assert not np.array_equal(orders[0], orders[1]), "set_epoch reshuffles"
    jl.close()
    tl.close()


def test_break_then_full_epoch_and_subset_ids(small_store: str) -> None:
    dataset = dz.open_dataset(small_store)
    rows = np.arange(5, 777, 3)
    loader = JaxLoader(dz.Subset(dataset, rows), sampler(batch_size=20), return_index=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    loader.set_epoch(1)
    index = np.concatenate([np.asarray(b["index"]) for b in loader])
    np.testing.assert_array_equal(np.sort(index), rows)  # parent ids, each exactly once
    loader.close()


def test_refuses_ids_jax_would_wrap(tmp_path: Path) -> None:
    path = synthetic.make_single_cell(tmp_path / "big.zarr", n_obs=100, n_features=32)
    big = zarr.open_group(path, mode="r+")["obs"].create_array("big", shape=(100,), dtype="i8")
    big[...] = np.arange(100, dtype=np.int64) << 33
    big.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    dataset = dz.open_dataset(path)
    if jax.config.read("jax_enable_x64"):
        pytest.skip("JAX runs with 64-bit integers here")
    with pytest.raises(dz.ConfigError, match=r"'big'.*jax_enable_x64"):
        JaxLoader(dataset, sampler(), obs=["big"])
    JaxLoader(dataset, sampler(), obs=["cell_type"], return_index=True).close()


def test_refuses_column_ids_jax_would_wrap(tmp_path: Path) -> None:
    """A CSR X wider than int32 (ids up to 3e9): JAX's 32-bit mode wrapped the BCSR's
    column ids (2**31 + 7 came as -2147483641) with no error."""
    if jax.config.read("jax_enable_x64"):
        pytest.skip("JAX runs with 64-bit integers here")
    width = 3_000_000_000
    root = zarr.open_group(tmp_path / "wide.zarr", mode="w")
    root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    x = root.create_group("X")
    x.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0",
                    "shape": [4, width]})  # fmt: skip
    x.create_array("data", data=np.arange(1, 5, dtype=np.float32))
    x.create_array("indices", data=np.array([5, 2**31 + 7, width - 1, 0], dtype=np.int64))
    x.create_array("indptr", data=np.arange(5, dtype=np.int64))
    for name, n in (("obs", 4), ("var", width)):
        frame = root.create_group(name)
        frame.attrs.update({"encoding-type": "dataframe", "encoding-version": "0.2.0",
                            "_index": "_index", "column-order": []})  # fmt: skip
        index = frame.create_array("_index", shape=(n,), chunks=(min(n, 10**6),), dtype="i8")
        index.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    dataset = dz.open_dataset(tmp_path / "wide.zarr")
    settings = dict(chunk_size=4, preload_nchunks=1, batch_size=4, shuffle=False)
    with pytest.raises(dz.ConfigError, match=r"column ids reach 2999999999.*jax_enable_x64"):
        JaxLoader(dataset, sampler(**settings), output="csr")


@pytest.mark.slow
def test_two_jax_processes_disjoint_equal_complete(tmp_path: Path) -> None:
    n_obs, batch = 1_001, 64
    data = synthetic.make_single_cell(
        tmp_path / "sc.zarr", n_obs=n_obs, n_features=32, chunk_elements=512
    )
    out = tmp_path / "out"
    out.mkdir()
    env = child_env(JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [
        start(
            [
                *(sys.executable, str(WORKER), "--data", data, "--out", str(out)),
                *("--port", str(port), "--process-id", str(i), "--batch-size", str(batch)),
            ],
            env=env,
        )
        for i in range(2)
    ]
    for code, stdout, stderr in wait_all(procs, timeout=180):
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    per_rank = (n_obs // 2) // batch
    assert [int(r["rank"]) for r in ranks] == [0, 1] and {int(r["world"]) for r in ranks} == {2}
    for epoch in range(2):
        a, b = (r[f"epoch{epoch}"] for r in ranks)
        assert [int(r["steps"][epoch]) for r in ranks] == [per_rank, per_rank]
        assert int(ranks[0]["len"]) == per_rank
        assert len(a) == len(b) == per_rank * batch
        assert not set(a.tolist()) & set(b.tolist()), "ranks overlap"
        assert len(np.unique(np.concatenate([a, b]))) == 2 * per_rank * batch
        for r, got in enumerate((a, b)):  # exactly the rows this rank's plan assigns
            planned = dz.DistributedSampler(
                dz.ChunkSampler(chunk_size=32, preload_nchunks=4, batch_size=batch, seed=5),
                dist_info=lambda r=r: (r, 2),
            ).plan_epoch(n_obs, epoch)
            # in the order the plan yields them
            np.testing.assert_array_equal(got, np.concatenate(list(iter_batches(planned))))
    assert set(ranks[0]["epoch0"].tolist()) != set(ranks[0]["epoch1"].tolist())


def test_a_jax_without_distributed_is_initialized_is_asked_another_way(monkeypatch) -> None:
    """JAX before 0.5.1 has no ``jax.distributed.is_initialized``: with jax imported, a
    multi-rank job that is not JAX's (``dist_info="env"``) crashed in the rank checks."""
    from dali_zarr import distributed

    monkeypatch.delattr(jax.distributed, "is_initialized")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not distributed.collectives_may_hang()
    assert not distributed.jax_world_is(1, 2)
    s = dz.DistributedSampler(sampler(), dist_info="env")
    assert (s.rank, s.world_size, s.exchange) == (1, 2, None)
    from jax._src import distributed as jax_distributed  # what such a JAX says instead

    monkeypatch.setattr(jax_distributed.global_state, "client", object())
    assert distributed.collectives_may_hang()
