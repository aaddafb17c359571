"""The benchmark scripts run end to end at a tiny size, so they cannot rot between the runs
that matter (full size here, or on a lent GPU machine, where a broken script wastes the lease).

Their figures are not checked (speed is measured by running them, never asserted in tests):
only that every contender delivered the rows it was asked for and the reports were written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.processes import ROOT, run_ok

BENCHMARKS = ROOT / "benchmarks"
# the charts need matplotlib (the `bench` extra); without it the scripts say so and go on
CHARTS = importlib.util.find_spec("matplotlib") is not None


def run_script(name: str, *argv: object) -> str:
    return run_ok([sys.executable, str(BENCHMARKS / name), *(str(a) for a in argv)], timeout=600)


def test_gpu_throughput_smoke_run(tmp_path: Path) -> None:
    """``--smoke``: the GPU benchmark's every step on the CPU (GPU path on the host backend)."""
    batches, batch_size = 4, 128
    stdout = run_script(
        "gpu_throughput.py",
        "--smoke",
        *("--cells", 1500, "--genes", 700, "--nnz-per-cell", 40),
        *("--batch-size", batch_size, "--chunk-size", 32, "--preload-nchunks", 8),
        *("--batches", batches, "--warmup", 1, "--out", tmp_path),
        *("--stores", 3, "--panel", 50, "--configs", "pinned/c/none"),
    )
    assert "SMOKE RUN on the CPU" in stdout  # a smoke figure can't pass for a GPU one
    report = json.loads((tmp_path / "gpu_throughput.json").read_text())
    results = report["results"]
    each = "dali_zarr gpu, 3 stores, a 50-gene panel each"
    config = "dali_zarr gpu, reads pinned, nvCOMP c API, ring sync none"
    gpu_rows = (
        "dali_zarr gpu",
        config,
        "dali_zarr gpu, 3 stores",
        "dali_zarr gpu, 50-gene panel",
        each,
    )
    for name in (*gpu_rows, "dali_zarr cpu + .cuda()"):
        assert results[name]["rows"] == batches * batch_size, (name, results[name])
        assert results[name]["seconds"] > 0
    assert results["dali_zarr gpu, 50-gene panel"]["width"] == results[each]["width"] == 50
    assert all("mapped to the panel" in p for p in results[each]["paths"].values())
    for name in gpu_rows:  # each store's windows by byte plans, none read on the host
        paths = results[name]["paths"].values()
        assert paths and all("host-backend plan" in p for p in paths), results[name]["paths"]
    baseline = next(r for name, r in results.items() if name.startswith("baseline"))
    assert baseline["rows"] == batches * batch_size, baseline
    annbatch = next(r for name, r in results.items() if name.startswith("annbatch"))
    assert annbatch.get("skipped") or annbatch["rows"] == batches * batch_size, annbatch
    # GPU-only ceilings say why they are missing; the read ceiling is measured
    ceilings = report["ceilings"]
    assert [v for v, _ in ceilings.values()].count("smoke run") == 2, ceilings
    assert any(isinstance(v, float) and v > 0 for v, _ in ceilings.values()), ceilings
    assert (tmp_path / "gpu_throughput.png").exists() == CHARTS


def test_gpu_profile_smoke_run(tmp_path: Path) -> None:
    """``gpu_profile.py --smoke``: the stage timers and the read-threads sweep, host backend."""
    stdout = run_script(
        "gpu_profile.py",
        "--smoke",
        *("--cells", 1500, "--genes", 300, "--nnz-per-cell", 20, "--batch-size", 64),
        *("--chunk-size", 16, "--preload-nchunks", 4, "--windows", 3, "--batches", 30),
        *("--read-threads", "1,3", "--configs", "pinned/c/none,kvikio/python/device/apart"),
        *("--out", tmp_path),
        *("--stores", 3, "--panel", 40, "--per-store-panels"),
    )
    assert "SMOKE RUN" in stdout and "as 3 stores, a 40-gene panel each" in stdout
    assert "FAILED" not in stdout
    for config in (
        "reads pinned, nvCOMP c API, ring sync none",
        # the default sync, a window's plans one at a time (DALI_ZARR_JOINT_PLANS=0)
        "reads kvikio, nvCOMP python API, ring sync device, a window's plans one at a time",
    ):
        part = stdout.split(f"== {config}")[1].split("==")[0]
        assert re.search(r"one reader: [\d.]+ ms per window", part), stdout
        assert re.search(r"read \+ decode \+ copy \(host backend\) +[\d.]+ ms", part), stdout
        # CSR rows straddle store chunks: the chunks at a run's ends are decoded whole
        extra = re.search(r"store chunk bytes read and decoded per byte used: ([\d.]+)", part)
        assert extra and float(extra.group(1)) > 1.0, stdout
        # a window of the 3-store collection: one plan per array, whatever stores it touches
        assert "byte plans run per window: 2.0" in part, stdout
        assert re.search(r"byte plans \(host\) +[\d.]+ ms", part), stdout
        assert re.search(r"panel ids mapped per store +[\d.]+ ms", part), stdout  # its launch
        for threads in (1, 3):
            assert f"loader, read_threads={threads}: " in part
            # where the reader threads' time went, timed without added syncs
            loader = part.split(f"loader, read_threads={threads}: ")[1]
            assert re.search(rf"reader threads: \d+ windows read, busy \d+% of {threads} x", loader)
            for stage in ("window read, in all", "byte plans (host)", "plan runs (host backend)"):
                assert re.search(rf"\n    {re.escape(stage)} +[\d.]+\n", loader), loader
        assert part.count("device memory: n/a (smoke run)") == 2, stdout
        assert part.count("(1,920 rows)") == 2  # each loader timed 30 full batches of 64 rows


def test_throughput_cube_run(tmp_path: Path) -> None:
    """The CPU benchmark on its dense cube, with the contenders that need no other venv."""
    run_script(
        "throughput.py",
        *("--stores", "cube", "--only", "dali_zarr,torch_dataloader,ceiling"),
        *("--cube-n", 48, "--cube-chunk", 4, "--cube-batch-size", 8),
        *("--cube-preload-nchunks", 4, "--reps", 1, "--batches", 3, "--warmup", 1),
        *("--seconds", 30, "--out", tmp_path),
    )
    report = json.loads((tmp_path / "throughput.json").read_text())
    ran = {c["key"]: c for c in report["contenders"]}
    assert {key.split("/")[1] for key in ran} == {"dali_zarr", "torch_dataloader", "ceiling"}
    table = (tmp_path / "throughput.md").read_text()
    row_bytes = 4 * np.prod(report["stores"]["cube"]["shape"][1:])  # float32 rows
    for key, contender in ran.items():
        assert not contender["errors"] and not contender["skipped"], (key, contender)
        (result,) = contender["results"]
        if "ceiling" in key:  # whole passes over the cube's 48 rows, not --batches batches
            assert result["rows"] > 0 and result["rows"] % 48 == 0, (key, result)
        else:  # every row of the 3 timed batches of 8, materialised
            assert result["batches"] == 3 and result["rows"] == 24, (key, result)
            assert result["bytes"] == 24 * row_bytes, (key, result)
        rate = result["rows"] / result["seconds"]
        assert result["rows_per_s"] == pytest.approx(rate), (key, result)
        assert f"| cube | {contender['label']} | dense | {rate:,.0f} |" in table, table
    assert (tmp_path / "throughput.png").exists() == CHARTS


def test_throughput_sparse_run(tmp_path: Path) -> None:
    """The CPU benchmark on its single-cell store (written here by the main environment's
    anndata: the annbatch environment is made only when annbatch runs): our loader's CSR
    and dense outputs, the torch baseline and both ceilings deliver what they report."""
    run_script(
        "throughput.py",
        *("--stores", "sparse", "--only", "dali_zarr,torch_dataloader,ceiling"),
        *("--n-obs", 600, "--n-genes", 300, "--nnz-per-cell", 20),
        *("--chunk-size", 16, "--preload-nchunks", 4, "--batch-size", 32),
        *("--baseline-batch-size", 32, "--reps", 1, "--batches", 3, "--warmup", 1),
        *("--seconds", 30, "--out", tmp_path),
    )
    report = json.loads((tmp_path / "throughput.json").read_text())
    ran = {c["key"]: c for c in report["contenders"]}
    assert set(ran) == {
        "sparse/dali_zarr/csr/cpu",
        "sparse/dali_zarr/dense/cpu",
        "sparse/torch_dataloader/dense",
        "sparse/ceiling/csr",
        "sparse/ceiling/dense",
    }, sorted(ran)
    store = report["stores"]["sparse"]
    assert store["n_obs"] == 600 and store["nnz"] > 0, store
    table = (tmp_path / "throughput.md").read_text()
    for key, contender in ran.items():
        assert not contender["errors"] and not contender["skipped"], (key, contender)
        (result,) = contender["results"]
        if "ceiling" in key:  # whole passes over the store's 600 rows
            assert result["rows"] > 0 and result["rows"] % 600 == 0, (key, result)
        else:  # the 3 timed batches of 32 rows
            assert result["batches"] == 3 and result["rows"] == 96, (key, result)
        if key.endswith("dense/cpu") or "torch_dataloader" in key:  # 96 float32 rows
            assert result["bytes"] == 96 * 300 * 4, (key, result)
        rate = result["rows"] / result["seconds"]
        assert result["rows_per_s"] == pytest.approx(rate), (key, result)
        output = "csr" if "/csr" in key else "dense"
        row = f"| sparse | {contender['label']} | {output} | {rate:,.0f} |"
        assert row in table, table


def test_feature_selection_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "fs.json"
    stdout = run_script(
        "feature_selection.py",
        *("--cells", 1_200, "--genes", 300, "--panel", 40, "--batch-size", 64),
        *("--chunk-size", 64, "--preload-nchunks", 4, "--batches", 3, "--reps", 1),
        *("--store", tmp_path / "fs.zarr", "--json", out),
    )
    assert "| features=panel |" in stdout and "x every-gene" in stdout
    # the clock starts past the windows read ahead (a window of 4 chunks of 64 rows is 4
    # batches: the one consumed, 2 read ahead, DALI's 2 queued batches), not after 1 batch
    assert "runs of 3 batches after 14\n" in stdout, stdout
    rates = json.loads(out.read_text())["rows_per_s"]
    assert set(rates) == {"every gene, then x[:, panel] in torch", "features=panel"}
    assert all(len(v) == 1 and v[0] > 0 for v in rates.values())


def test_gpu_profile_over_inner_chunk_sizes(tmp_path: Path) -> None:
    """``--inner-chunks``: one synthetic store per size (same shard size), each profiled; the
    header names the chunk size the store really has, and the stores are cached by size."""
    import zarr

    argv = (
        *("--smoke", "--cells", 600, "--genes", 200, "--nnz-per-cell", 20, "--batch-size", 32),
        *("--chunk-size", 16, "--preload-nchunks", 4, "--windows", 2, "--batches", 8),
        *("--read-threads", "1", "--configs", "pinned/c", "--out", tmp_path),
        *("--inner-chunks", "512,2048", "--call-mb", "1,3"),
    )
    stdout = run_script("gpu_profile.py", *argv)
    assert "FAILED" not in stdout
    for size, shown in ((512, "512"), (2048, "2,048")):
        store = tmp_path / "stores" / f"synthetic_n600_g200_k20_c{size}.zarr"
        data = zarr.open_array(str(store / "X" / "data"), mode="r")
        assert data.chunks == (size,) and data.shards == (32 * 65_536,)  # shards alike
        header = f"store {store}: 600 rows, inner chunks of {shown} elements"
        parts = stdout.split(header)[1:]
        # --call-mb: each store profiled once per call size, in the order given
        assert [p.split("\n")[1] for p in parts] == [
            f"nvCOMP calls of at most {mb} MiB of decoded bytes" for mb in (1, 3)
        ], stdout
        for part in parts:
            part = part.split("SMOKE RUN")[0]
            assert re.search(r"one reader: [\d.]+ ms per window", part), stdout
            assert "loader, read_threads=1: " in part, stdout


def test_gpu_profile_runs_on_a_dense_anndata_store(tmp_path: Path) -> None:
    """``--store`` with a dense ``X``: the header's chunk note had opened ``X/data``, which
    only a CSR store has, and the profile failed before measuring anything."""
    import zarr

    store = tmp_path / "dense.zarr"
    group = zarr.open_group(str(store), mode="w")
    group.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    x = group.create_array("X", shape=(600, 50), chunks=(64, 50), dtype="float32")
    x[...] = np.random.default_rng(0).random((600, 50), dtype=np.float32)
    stdout = run_script(
        "gpu_profile.py",
        *("--smoke", "--store", store, "--batch-size", 32, "--chunk-size", 16),
        *("--preload-nchunks", 4, "--windows", 2, "--batches", 8, "--read-threads", 1),
        *("--configs", "pinned/c", "--out", tmp_path / "out"),
    )
    assert f"store {store}: 600 rows, inner chunks of 64 x 50 elements" in stdout, stdout
    assert "loader, read_threads=1: " in stdout and "FAILED" not in stdout, stdout


def test_gpu_profile_inner_chunks_refuses_a_given_store(monkeypatch) -> None:
    """``--inner-chunks`` with ``--store`` profiled the given store once per size, each
    header naming the same chunks: refused, as is a size that is not positive."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_profile = importlib.import_module("gpu_profile")
    assert gpu_profile.parse_args(["--inner-chunks", "512,2048"]).inner_chunks == [512, 2048]
    assert gpu_profile.parse_args(["--call-mb", "32, 512"]).call_mb == [32, 512]
    refused = (["--inner-chunks", "512", "--store", "x.zarr"], ["--inner-chunks", "0"])
    for argv in (*refused, ["--call-mb", "0"]):
        with pytest.raises(SystemExit):
            gpu_profile.parse_args(argv)


def test_gpu_profile_stage_timers_are_removed_after_part_one(monkeypatch) -> None:
    """The profile's stage timers (a device sync after each stage) must not stay on the
    reader for its loader runs and later configs: they had, so the ring-sync comparison was
    timed with a device-wide sync per array and window."""
    import argparse

    import dali_zarr.graph.device_window as device_window
    from dali_zarr.graph.window_backends import HostBackend
    from dali_zarr.io import nvcomp_batched

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_profile = importlib.import_module("gpu_profile")
    backend = HostBackend()
    names = ("run_plans", "remap_columns", "keep_panel_rows", "select_columns", "run_plan")
    before = {name: getattr(backend, name) for name in names}
    plans, slices = device_window.window_plans, nvcomp_batched.call_slices
    with gpu_profile.stage_timers(argparse.Namespace(smoke=True), backend) as totals:
        assert device_window.window_plans is not plans
        assert all(getattr(backend, name) != before[name] for name in names)
        # the decode calls are counted where the executor splits a plan (both nvCOMP APIs)
        sizes = np.full(10, 100)
        assert nvcomp_batched.call_slices(sizes, cap=250) == slices(sizes, cap=250)
        assert (totals["decode calls"], totals["decode call chunks"]) == (5, 10)
    assert device_window.window_plans is plans and nvcomp_batched.call_slices is slices
    assert {name: getattr(backend, name) for name in names} == before


def test_gpu_profile_thread_timers_count_every_thread_and_are_removed(monkeypatch) -> None:
    """Part 2's thread timers wrap the stages of every reader thread (class and module
    attributes, not one executor's), sum them across threads, and leave nothing behind."""
    import threading

    from dali_zarr.graph import device_window
    from dali_zarr.graph.window_backends import HostBackend

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_profile = importlib.import_module("gpu_profile")
    before = (HostBackend.__dict__["run_plan"], device_window.window_plans)
    with gpu_profile.thread_timers() as totals:
        assert device_window.window_plans is not before[1]
        threads = [
            threading.Thread(target=device_window.window_plans, args=([],), kwargs={"out_rows": 0})
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert totals["calls: byte plans (host)"] == 3 and totals["byte plans (host)"] > 0
    assert (HostBackend.__dict__["run_plan"], device_window.window_plans) == before


def test_gpu_throughput_config_rows_put_the_switches_back(monkeypatch) -> None:
    """A ``--configs`` row sets the GPU path's switches for itself only: the rows measured
    after it (the collection, the panel, the CPU path) run with the user's own settings."""
    from dali_zarr.graph.window_backends import JOINT_PLANS_ENV, RING_SYNC_ENV
    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_throughput = importlib.import_module("gpu_throughput")
    monkeypatch.setenv(READS_ENV, "kvikio")
    for key in (nvcomp_batched.ENV_SWITCH, RING_SYNC_ENV, JOINT_PLANS_ENV):
        monkeypatch.delenv(key, raising=False)
    config = gpu_throughput.parse_config("pinned/c/none/apart")
    keys = (READS_ENV, nvcomp_batched.ENV_SWITCH, RING_SYNC_ENV, JOINT_PLANS_ENV)
    with pytest.raises(RuntimeError, match="the row failed"), gpu_throughput.config_env(*config):
        assert [os.environ.get(k) for k in keys] == ["pinned", "1", "none", "0"]
        raise RuntimeError("the row failed")  # a failed contender restores them too
    assert os.environ[READS_ENV] == "kvikio"
    assert not {nvcomp_batched.ENV_SWITCH, RING_SYNC_ENV, JOINT_PLANS_ENV} & set(os.environ)
    assert gpu_throughput.parse_config(" kvikio/python ") == (
        "kvikio", "python", "device", "joint",
    )  # fmt: skip
    assert gpu_throughput.parse_config("pinned/c/none") == ("pinned", "c", "none", "joint")
    # --inner-chunk: every contender on a synthetic store of that chunk size, none given
    assert gpu_throughput.parse_args(["--inner-chunk", "16384"]).inner_chunk == 16384
    for argv in (["--inner-chunk", "0"], ["--inner-chunk", "512", "--store", "x.zarr"]):
        with pytest.raises(SystemExit):
            gpu_throughput.parse_args(argv)
    for bad in ("gds/c", "kvikio/c/device/some", "kvikio/c/device/joint/more", "kvikio"):
        with pytest.raises(SystemExit, match=f"'{bad}' is not READS/API"):
            gpu_throughput.parse_config(bad)


def test_gpu_check_script_parses_and_prints_its_header() -> None:
    """``scripts/gpu_check.sh`` runs only on lent GPU machines, where a syntax error would
    waste the session's few device minutes: CI parses it, and its usage is its header."""
    import subprocess

    script = ROOT / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    usage = subprocess.run(["bash", str(script), "help"], capture_output=True, text=True)
    assert usage.returncode == 2, usage
    header = [line for line in script.read_text().splitlines()[1:] if line.startswith("#")]
    header = header[
        : header.index("# gpu_demo.txt/.jsonl, gpu_profile.txt. Stores stay in $DZ_BENCH_DIR.") + 1
    ]
    assert usage.stdout.splitlines() == header, usage.stdout
    extra = subprocess.run(["bash", str(script), "extra"], capture_output=True, text=True)
    assert extra.returncode == 0 and "annbatch==" in extra.stdout, extra


def test_gpu_check_demo_step_trains_under_torchrun(tmp_path: Path) -> None:
    """``gpu_check.sh demo`` (the DDP demo on a lent GPU) with its GPU choices overridden
    (one rank, ``--device cpu`` last): the torchrun call, the store it writes and the
    per-epoch log it sends back work, so a GPU session does not find them broken."""
    import subprocess

    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "DZ_BENCH_DIR": str(tmp_path / "bench"),
        "DZ_NPROC": "1",
        "DZ_DEMO_ARGS": "--device cpu --n-obs 2000 --n-features 50 --epochs 2",
    }
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "demo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "bench" / "demo.zarr").is_dir()
    epochs = [json.loads(line) for line in (tmp_path / "out" / "gpu_demo.jsonl").open()]
    assert [e["epoch"] for e in epochs] == [0, 1], epochs
    assert (tmp_path / "out" / "gpu_demo.txt").read_text() == run.stdout


def test_gpu_throughput_annbatch_worker_runs_without_dali_zarr(tmp_path: Path, monkeypatch) -> None:
    """The annbatch worker runs in annbatch's own environment (``--annbatch-python``,
    ``benchmarks/.venv-annbatch``), which need not have dali_zarr or its dependencies: its
    timing loop computed the warm-up with dali_zarr's planning code, so the annbatch row was
    always skipped with ``ModuleNotFoundError`` there. The parent now passes the warm-up."""
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['dali_zarr'] = None  # as in an environment without it\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "import gpu_throughput as g\n"
        "args = g.parse_args(['--worker', 'annbatch', '--smoke', '--store', 'x.zarr',\n"
        "    '--warmup', '7', '--batches', '3', '--batch-size', '64'])\n"
        "seen = []\n"
        "result = g.timed(args, iter(range(100)), lambda b: seen.append(b) or 64)\n"
        "print(len(seen), result['rows'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["10", "192"], run.stdout  # the 7 given, then 3 timed
    # the parent hands the worker the warm-up its own contenders get
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_throughput = importlib.import_module("gpu_throughput")
    sizes = ["--batch-size", "64", "--chunk-size", "16", "--preload-nchunks", "8"]
    parent = gpu_throughput.parse_args(["--smoke", "--warmup", "2", *sizes])
    # a window of 8 x 16 rows is 2 batches: past the window consumed, the GPU path's 4 read
    # ahead (its read threads) and DALI's 2 queued batches
    assert gpu_throughput.warmup_batches(parent) == 12


def test_gpu_benchmarks_warm_up_past_the_gpu_paths_read_ahead(tmp_path: Path, monkeypatch) -> None:
    """The GPU path reads ``max(prefetch_windows, read_threads)`` windows ahead, not the
    CPU path's 2: gpu_throughput's warm-up (and gpu_profile's fixed ``--warmup`` per
    ``read_threads`` value) stopped short of it, so with 8 read threads (or
    ``--prefetch-windows 4``) the clock started with windows read that the timed interval
    did not pay for, more of them the more threads. Each warm-up is now past the read-ahead
    the source itself reports."""
    import dali_zarr as dz
    from dali_zarr.graph.gpu_pipeline import GpuBatchSource
    from dali_zarr.graph.window_backends import HostBackend
    from dali_zarr.synthetic import make_single_cell

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_throughput = importlib.import_module("gpu_throughput")
    gpu_profile = importlib.import_module("gpu_profile")
    store = make_single_cell(tmp_path / "s.zarr", n_obs=400, n_features=30, density=0.2)
    sizes = ["--batch-size", "64", "--chunk-size", "16", "--preload-nchunks", "8"]
    per_window = 2  # 8 chunks of 16 rows, batches of 64
    for prefetch, threads in ((2, None), (2, 8), (4, 4), (6, 1)):
        argv = ["--smoke", "--warmup", "2", "--prefetch-windows", str(prefetch), *sizes]
        args = gpu_throughput.parse_args(
            argv + ([] if threads is None else ["--read-threads", str(threads)])
        )
        source = GpuBatchSource(
            dz.open_dataset(store),
            gpu_throughput.sampler(args),
            output="dense",
            obs=[],
            return_index=False,
            prefetch_windows=prefetch,
            **({} if threads is None else {"read_threads": threads}),
            backend=HostBackend(),
        )
        ahead = source.prefetch_windows  # windows read beyond the one consumed
        source.close()
        past = (ahead + 1) * per_window + 2  # and DALI's queue of 2 batches
        assert gpu_throughput.warmup_batches(args) == past, (prefetch, threads, ahead)
        if prefetch == 2 and threads is not None:  # gpu_profile's loaders: the default prefetch
            profile_args = gpu_profile.parse_args(["--smoke", "--warmup", "2", *sizes])
            assert gpu_profile.loader_warmup(profile_args, threads) == past, threads
    # throughput.py on a CUDA machine: its GPU rows (and the others, alike) past the GPU
    # path's default read-ahead; without CUDA past the CPU path's 2 windows
    throughput = importlib.import_module("throughput")
    cpu_args = throughput.parse_args(["--stores", "sparse", "--warmup", "2", *sizes])
    envs = {"annbatch_python": None, "annbatch_why": "-", "ztd_site": None, "ztd_why": "-"}
    default_ahead = GpuBatchSource.__init__.__kwdefaults__["read_threads"]
    for cuda, ahead in ((False, 2), (True, max(2, default_ahead))):
        contenders = throughput.build_contenders(cpu_args, envs, cuda)
        chunked = [c for c in contenders if c.family in ("dali_zarr", "annbatch")]
        assert len(chunked) == (6 if cuda else 4)
        assert {c.settings["warmup"] for c in chunked} == {(ahead + 1) * per_window + 2}
        # and the report's conditions say the warm-up the run used
        envs_run = {**envs, "main_versions": {"python": "3"}}
        said = "\n".join(throughput.conditions(cpu_args, {}, envs_run, (0,), (0,), 1.0, cuda))
        assert f"at least {ahead + 1} windows + 2 batches" in said, said


def test_gpu_throughput_runs_annbatch_where_it_has_torch(tmp_path: Path, monkeypatch) -> None:
    """``benchmarks/.venv-annbatch`` is made by ``throughput.py`` for the CPU benchmark,
    without torch or cupy: preferred over an interpreter that imports annbatch (which has
    torch, being the one running the GPU benchmark), it skipped the annbatch row with
    "No module named 'torch'" on every machine where the CPU benchmark had run."""
    import subprocess

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_throughput = importlib.import_module("gpu_throughput")
    own = tmp_path / "venv" / "bin" / "python"  # the CPU benchmark's environment, no torch
    own.parent.mkdir(parents=True)
    own.symlink_to(sys.executable)
    monkeypatch.setattr(gpu_throughput, "ANNBATCH_ENV", tmp_path / "venv")
    args = gpu_throughput.parse_args(["--smoke"])
    if importlib.util.find_spec("annbatch") is None:
        assert gpu_throughput.annbatch_python(args) == str(own)  # the only one there is
        site = tmp_path / "site"  # annbatch importable here, as on the GPU machines
        (site / "annbatch").mkdir(parents=True)
        (site / "annbatch" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
    chosen = gpu_throughput.annbatch_python(args)
    assert chosen == sys.executable, chosen
    has_torch = subprocess.run([chosen, "-c", "import torch"], capture_output=True)
    assert has_torch.returncode == 0
    given = gpu_throughput.parse_args(["--smoke", "--annbatch-python", "/x/python"])
    assert gpu_throughput.annbatch_python(given) == "/x/python"


def test_benchmarks_refuse_sizes_they_cannot_measure(monkeypatch) -> None:
    """Sizes that measured nothing ended in tracebacks after the store was written:
    ``io_read.py`` with an array shorter than its ranges (numpy's "high <= 0") or no windows
    (IndexError), ``gpu_profile.py --windows 0`` (ZeroDivisionError per config); and
    ``gpu_throughput.py --batches 0`` reported 0 rows/s. Each is now an argument error."""
    import subprocess

    for argv, says in (
        (["--mb", "0.2"], "--mb 0.2 holds 50,000 elements, too few for ranges of up to"),
        (["--mb", "1", "--windows", "0"], "--windows and --ranges must be at least 1"),
    ):
        run = subprocess.run(
            [sys.executable, str(BENCHMARKS / "io_read.py"), *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2 and says in run.stderr, run.stderr
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for script, argv in (
        ("gpu_profile", ["--windows", "0"]),
        ("gpu_profile", ["--batches", "0"]),
        ("gpu_throughput", ["--batches", "0"]),
    ):
        with pytest.raises(SystemExit):
            importlib.import_module(script).parse_args(["--smoke", *argv])


def test_cpu_profile_runs_and_counts_the_bytes_the_reads_decode(
    tmp_path: Path, monkeypatch
) -> None:
    """The script runs on a CSR store, and its decoded-bytes count (from the chunk geometry)
    is what the reader really decodes over an epoch's windows: counted here at the zstd
    calls while the windows are read."""
    from dali_zarr import synthetic
    from dali_zarr.io import codecs

    store = synthetic.make_single_cell(
        tmp_path / "s.zarr", n_obs=600, n_features=100, density=0.1, chunk_elements=1024
    )
    argv = ("--chunk-size", 16, "--preload-nchunks", 4, "--batch-size", 32)
    stdout = run_script("cpu_profile.py", store, *argv, "--windows", 3, "--batches", 5)
    for line in ("read a window (64 rows)", "hand out a batch (csr", "hand out a batch (dense"):
        assert line in stdout, stdout
    assert re.search(r"decoded per epoch: .* \((\d+\.\d+)x; chunks of 1,024 elements\)", stdout)

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    cpu_profile = importlib.import_module("cpu_profile")
    import dali_zarr as dz

    args = cpu_profile.argparse.Namespace(chunk_size=16, preload_nchunks=4, batch_size=32)
    dataset = dz.open_dataset(store)
    decoded, used = cpu_profile.decoded_bytes(dataset, args)
    plan = cpu_profile.sampler(args).plan_epoch(dataset.n_obs, 0)
    counted = [0]
    prefix, whole = codecs._zstd_prefix_into, codecs._Zstd.decode_into

    def count_prefix(buf, target):
        counted[0] += target.size
        return prefix(buf, target)

    def count_whole(self, buf, out):
        counted[0] += out.nbytes
        return whole(self, buf, out)

    # counted on the way through: the real decode still runs
    monkeypatch.setattr(codecs, "_zstd_prefix_into", count_prefix)
    monkeypatch.setattr(codecs._Zstd, "decode_into", count_whole)
    rows = [dataset.read_rows(plan.window(w).row_ranges) for w in range(plan.n_windows)]
    assert used == sum(r.data.nbytes + r.indices.nbytes for r in rows)
    assert decoded == counted[0] and decoded > used  # 16-row ranges in ~100-row chunks


def test_gpu_throughput_baseline_batches_have_the_loaders_batch_size(monkeypatch) -> None:
    """The baseline read batch_size // chunk_size whole blocks: 4,000-row batches beside
    the loaders' 4,096 (and a batch smaller than a block read a whole block)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    blocks = importlib.import_module("gpu_throughput").baseline_blocks
    assert blocks(4096, 1000, 10**6) == [1000] * 4 + [96]
    assert blocks(4096, 1024, 10**6) == [1024] * 4
    assert blocks(100, 1000, 10**6) == [100]
    assert blocks(4096, 1000, 2500) == [1000, 1000, 500]  # a store smaller than a batch
