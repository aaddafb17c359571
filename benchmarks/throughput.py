"""Loader throughput: dali_zarr against annbatch, zarr-torch-dataset, a plain torch baseline
and the decode ceiling, on the same stores, on this machine, in one run (issue #5).

    python benchmarks/throughput.py                       # full size (~6-10 min on 2 cores)
    python benchmarks/throughput.py --n-obs 4000 --n-genes 2000 --cube-n 200 --reps 2

Two stores, written once and cached under ``<out>/stores/`` (keyed by their parameters):

* sparse: a single-cell-like AnnData store (``--n-obs`` cells x ``--n-genes`` genes, about
  ``--nnz-per-cell`` non-zeros per cell) written by anndata with its zarr v3 defaults (zstd,
  sharded) -- by anndata 0.13 in the annbatch environment when there is one;
* cube: a dense ``(--cube-n, 8, 180, 360)`` float32 array, zarr defaults (zstd), chunked
  ``(--cube-chunk, 8, 180, 360)`` on axis 0, not sharded.

Contenders (each a script in ``benchmarks/contenders/``, run in a subprocess that prints one
``RESULT {json}`` line; see their docstrings for exactly what they do):

* ``dali_zarr``: ``dz.Loader`` over ``dz.ChunkSampler``, ``output="csr"`` and ``"dense"``,
  CPU path (the GPU path too when CUDA is present);
* ``annbatch``: ``annbatch.Loader`` with the same chunk_size, preload_nchunks and batch_size,
  zarrs codec pipeline on, CSR as it comes and densified with ``.toarray()``; it runs in
  ``benchmarks/.venv-annbatch`` (Python 3.12, created here on first use);
* ``zarr_torch_dataset``: ``ZarrIterableDataset`` + ``ZarrDataLoader`` (dense cube only);
* ``torch_dataloader``: torch ``DataLoader`` + ``DistributedSampler`` indexing the zarr array
  row by row (``--baseline-batch-size`` rows a batch, ``--baseline-workers`` workers);
* ``ceiling``: read and decode every chunk of the epoch with ``os.pread`` + numcodecs on all
  cores and nothing else (for dense output from the sparse store: plus densifying).

Every contender runs ``--reps`` times, round-robin (the order rotates each repetition); a
measurement is ``--batches`` batches after ``--warmup`` (or fewer: the clock stops at the
first batch past ``--seconds``). The store is read once before the first measurement, so the
page cache is warm. Output: ``<out>/throughput.md`` (table: median rows/s, MB/s, ratio to
annbatch, % of the ceiling; the conditions), ``<out>/throughput.png``, ``<out>/throughput.json``
(every measurement).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "contenders"
ANNBATCH_ENV = HERE / ".venv-annbatch"
ANNBATCH_PYTHON = ANNBATCH_ENV / "bin" / "python"
ZTD_SITE = HERE / ".venv-zarr-torch-dataset"
ZTD_SPEC = "zarr-torch-dataset==0.0.9"
ANNBATCH_SPEC = "annbatch[zarrs]"
FAMILIES = ("dali_zarr", "annbatch", "zarr_torch_dataset", "torch_dataloader", "ceiling")
RUN_TIMEOUT_S = 900


# ---------------------------------------------------------------------------- environments


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_python312(explicit: str | None) -> str | None:
    """``explicit``, else the first Python 3.12 that runs: ``python3.12`` on PATH, then
    pyenv's. A pyenv shim is on PATH whether or not its version is active, and an inactive
    one exits with 127, so each candidate is run once before it is chosen."""
    if explicit:
        return explicit
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    for candidate in [shutil.which("python3.12"), *reversed(pyenv)]:
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    return None


def env_versions(python: str, packages: list[str]) -> dict[str, str] | None:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "out = {'python': sys.version.split()[0]}\n"
        f"for p in {packages!r}:\n"
        "    out[p] = m.version(p)\n"
        "print(json.dumps(out))"
    )
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def ensure_annbatch_env(python312: str | None) -> tuple[str | None, dict | str]:
    """``benchmarks/.venv-annbatch`` (Python 3.12 + annbatch + zarrs), made on first use."""
    python = str(ANNBATCH_PYTHON)
    wanted = ["annbatch", "anndata", "zarr", "zarrs", "numpy"]
    if os.path.exists(python) and (versions := env_versions(python, wanted)):
        return python, versions
    base = find_python312(python312)
    if base is None:
        return None, "no Python 3.12 found (annbatch needs it): pass --python312"
    log(f"creating {ANNBATCH_ENV} with {base} and installing {ANNBATCH_SPEC} (once) ...")
    try:
        subprocess.run([base, "-m", "venv", str(ANNBATCH_ENV)], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", ANNBATCH_SPEC],
            check=True,
            stdout=sys.stderr,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"could not install {ANNBATCH_SPEC} into {ANNBATCH_ENV}: {exc}"
    versions = env_versions(python, wanted)
    if versions is None:
        return None, f"{ANNBATCH_ENV} does not import annbatch/zarrs after installing"
    return python, versions


def ensure_ztd_site() -> tuple[str | None, str]:
    """zarr-torch-dataset, installed without dependencies into a ``pip --target`` folder."""
    marker = ZTD_SITE / "zarrdataset" / "__init__.py"
    if not marker.exists():
        log(f"installing {ZTD_SPEC} into {ZTD_SITE} (once) ...")
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(ZTD_SITE),
                ZTD_SPEC,
            ],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0 or not marker.exists():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
            return None, f"could not install {ZTD_SPEC}: {tail[0]}"
    meta = glob.glob(str(ZTD_SITE / "zarr_torch_dataset-*.dist-info"))
    version = Path(meta[0]).name.removesuffix(".dist-info").split("-")[1] if meta else "?"
    return str(ZTD_SITE), version


# ---------------------------------------------------------------------------------- stores


def run_script(python: str, script: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run a runner script (a file name in contenders/, or an absolute path); its last
    ``RESULT {json}`` line, or ``{"error": ...}``."""
    cmd = [python, str(RUNNERS / script), *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
    return {"error": f"exit {res.returncode}: {tail}"}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def array_meta(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "zarr.json").read_text())
    codecs = meta["codecs"]
    out = {"shape": meta["shape"], "dtype": meta["data_type"]}
    if codecs[0]["name"] == "sharding_indexed":
        conf = codecs[0]["configuration"]
        out["shard"] = meta["chunk_grid"]["configuration"]["chunk_shape"]
        out["chunk"] = conf["chunk_shape"]
        codecs = conf["codecs"]
    else:
        out["chunk"] = meta["chunk_grid"]["configuration"]["chunk_shape"]
    out["codecs"] = ", ".join(
        c["name"] + (f"(level {c['configuration']['level']})" if c["name"] == "zstd" else "")
        for c in codecs
        if c["name"] != "bytes"
    )
    return out


def _cached_store(
    args, name: str, what: str, python: str, writer_args: list[str], describe
) -> tuple[Path, dict]:
    """Write a store once with ``stores.py`` (in ``python``) and cache it with a JSON sidecar.

    ``describe(path, made)`` adds the layout figures the report needs to the writer's output.
    """
    path = Path(args.out) / "stores" / name
    sidecar = path.with_suffix(".json")
    if sidecar.exists() and path.exists():
        return path, json.loads(sidecar.read_text())
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing the {what} {path} (once; cached) ...")
    t = time.perf_counter()
    made = run_script(
        python, "stores.py", [*writer_args[:1], "--path", str(path), *writer_args[1:]], timeout=3600
    )
    if "error" in made:
        raise SystemExit(f"could not write the {what}: {made['error']}")
    info = {**made, "seconds_to_write": round(time.perf_counter() - t, 1), **describe(path, made)}
    sidecar.write_text(json.dumps(info, indent=1))
    return path, info


def ensure_sparse_store(args, writer_python: str) -> tuple[Path, dict]:
    def describe(path: Path, made: dict) -> dict:
        x = path / "X"
        return {
            "data": array_meta(x / "data"),
            "indices": array_meta(x / "indices"),
            "stored_bytes": du(x / "data") + du(x / "indices"),
            "decoded_bytes": made["nnz"] * 8,  # float32 data + int32 indices
        }

    name = f"sparse_n{args.n_obs}_g{args.n_genes}_k{args.nnz_per_cell:g}_s{args.seed}.zarr"
    writer_args = [
        "sparse",
        "--n-obs",
        str(args.n_obs),
        "--n-genes",
        str(args.n_genes),
        "--nnz-per-cell",
        str(args.nnz_per_cell),
        "--seed",
        str(args.seed),
    ]
    return _cached_store(args, name, "sparse store", writer_python, writer_args, describe)


def ensure_cube_store(args) -> tuple[Path, dict]:
    def describe(path: Path, made: dict) -> dict:
        return {
            "array": array_meta(path),
            "stored_bytes": du(path) - (path / "zarr.json").stat().st_size,
            "decoded_bytes": math.prod(made["shape"]) * 4,  # float32
        }

    name = f"cube_n{args.cube_n}_c{args.cube_chunk}_s{args.seed}.zarr"
    writer_args = [
        "cube",
        "--n",
        str(args.cube_n),
        "--chunk",
        str(args.cube_chunk),
        "--seed",
        str(args.seed),
    ]
    return _cached_store(args, name, "dense cube", sys.executable, writer_args, describe)


def warm_page_cache(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


# ------------------------------------------------------------------------------ contenders


@dataclass
class Contender:
    key: str  # unique, e.g. "sparse/dali_zarr/csr/cpu"
    family: str
    label: str
    store: str  # "sparse" | "cube"
    output: str  # "csr" | "dense"
    script: str
    python: str
    settings: dict[str, Any]
    ref: str | None = None  # key of the annbatch contender to compare with
    ceiling: str | None = None  # key of the ceiling to compare with
    results: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    errors: list[str] = field(default_factory=list)


def _at_least_one(text: str) -> int:
    """argparse type: a whole number >= 1 (0 timed batches divided by zero at the end)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def steady_warmup(
    warmup: int,
    *,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    windows_ahead: int = 2,
) -> int:
    """Batches to consume before the clock starts: at least ``warmup``, and past what our
    loader reads ahead when it starts (``windows_ahead`` windows beyond the current one:
    ``prefetch_windows``, 2 by default, and on the GPU path at least ``read_threads``, 4 by
    default; plus DALI's queue of 2 batches). With 2 warm-up batches its clock started with
    up to two windows read already, batches the timed interval did not pay for (a window is
    2 batches at full size: 24 timed batches are 12 windows, so up to 2 of them free).
    annbatch gets the same warm-up."""
    from dali_zarr.planning.partition import window_rows_of

    per_window = window_rows_of(chunk_size, preload_nchunks, batch_size) // batch_size
    return max(warmup, (windows_ahead + 1) * per_window + 2)


def gpu_windows_ahead(prefetch_windows: int = 2, read_threads: int | None = None) -> int:
    """Windows the GPU path reads ahead of the one consumed: ``prefetch_windows``, raised to
    its read threads (``GpuBatchSource``)."""
    from dali_zarr.graph.gpu_pipeline import DEFAULT_READ_THREADS

    return max(prefetch_windows, DEFAULT_READ_THREADS if read_threads is None else read_threads)


def deepest_read_ahead(cuda: bool) -> int:
    """Windows our loader reads ahead in this run, at most: the GPU path's where it runs,
    else the CPU path's (``prefetch_windows``, 2); every chunked loader warms up past it."""
    return gpu_windows_ahead() if cuda else 2


def build_contenders(args, envs: dict[str, Any], cuda: bool) -> list[Contender]:
    py = sys.executable
    ab_py = envs["annbatch_python"]
    measure = {"warmup": args.warmup, "max_batches": args.batches, "max_seconds": args.seconds}
    # the cores this process may use (affinity, a container's quota), not the node's count:
    # more threads than cores would only contend, and the ceiling would read lower
    from dali_zarr.distributed import cpu_share

    ceil = {"min_seconds": 1.0, "threads": cpu_share()}
    out: list[Contender] = []

    def add(c: Contender) -> None:
        if c.family in args.only and c.store in args.stores:
            out.append(c)

    for store, sizes in (
        (
            "sparse",
            dict(
                chunk_size=args.chunk_size,
                preload_nchunks=args.preload_nchunks,
                batch_size=args.batch_size,
            ),
        ),
        (
            "cube",
            dict(
                chunk_size=args.cube_chunk_size,
                preload_nchunks=args.cube_preload_nchunks,
                batch_size=args.cube_batch_size,
            ),
        ),
    ):
        outputs = ("csr", "dense") if store == "sparse" else ("dense",)
        # the chunked loaders (ours, annbatch) all warm up past our deepest read-ahead
        warmup = steady_warmup(args.warmup, **sizes, windows_ahead=deepest_read_ahead(cuda))
        sizes_measure = {**sizes, **measure, "warmup": warmup}
        ref = {o: f"{store}/annbatch/{o}" for o in outputs}
        ceiling = {"csr": f"{store}/ceiling/csr", "dense": f"{store}/ceiling/dense"}
        for device in ("cpu", "gpu") if cuda else ("cpu",):
            for o in outputs:
                add(
                    Contender(
                        f"{store}/dali_zarr/{o}/{device}",
                        "dali_zarr",
                        f"dali_zarr {o.upper() if o == 'csr' else o}"
                        + (" (GPU)" if device == "gpu" else ""),
                        store,
                        o,
                        "dali_zarr_runner.py",
                        py,
                        {**sizes_measure, "output": o, "device": device},
                        # annbatch runs on the CPU here: no ratio for the GPU rows
                        ref[o] if device == "cpu" else None,
                        ceiling[o],
                    )
                )
        for o in outputs:
            how = "CSR" if o == "csr" else ("dense, .toarray()" if store == "sparse" else "dense")
            c = Contender(
                f"{store}/annbatch/{o}",
                "annbatch",
                f"annbatch ({how})",
                store,
                o,
                "annbatch_runner.py",
                ab_py or "",
                {**sizes_measure, "output": o},
                ref[o],
                ceiling[o],
            )
            if ab_py is None:
                c.skipped = envs["annbatch_why"]
            add(c)
        if store == "cube":
            c = Contender(
                "cube/zarr_torch_dataset/dense",
                "zarr_torch_dataset",
                "zarr-torch-dataset (1st epoch)",
                store,
                "dense",
                "zarr_torch_dataset_runner.py",
                py,
                {
                    "batch_size": sizes["batch_size"],
                    "num_workers": args.baseline_workers,
                    "site": envs["ztd_site"],
                },
                ref["dense"],
                ceiling["dense"],
            )
            if envs["ztd_site"] is None:
                c.skipped = envs["ztd_why"]
            add(c)
        bsize = args.baseline_batch_size if store == "sparse" else sizes["batch_size"]
        add(
            Contender(
                f"{store}/torch_dataloader/dense",
                "torch_dataloader",
                f"torch DataLoader + DistributedSampler ({args.baseline_workers} workers)",
                store,
                "dense",
                "torch_dataloader_runner.py",
                py,
                {
                    **measure,
                    "batch_size": bsize,
                    "num_workers": args.baseline_workers,
                    # past what its workers prefetch (DataLoader's prefetch_factor: 2 each),
                    # as the others' warm-up is past their read-ahead (it was 1 batch)
                    "warmup": max(args.warmup, 2 * args.baseline_workers + 1),
                },
                ref["dense"],
                ceiling["dense"],
            )
        )
        if store == "sparse":
            add(
                Contender(
                    "sparse/ceiling/csr",
                    "ceiling",
                    "ceiling: read + decode",
                    store,
                    "csr",
                    "ceiling.py",
                    py,
                    {**ceil, "kind": "csr"},
                )
            )
            add(
                Contender(
                    "sparse/ceiling/dense",
                    "ceiling",
                    "ceiling: read + decode + densify",
                    store,
                    "dense",
                    "ceiling.py",
                    py,
                    {**ceil, "kind": "dense", "batch_size": args.batch_size},
                )
            )
        else:
            add(
                Contender(
                    "cube/ceiling/dense",
                    "ceiling",
                    "ceiling: read + decode",
                    store,
                    "dense",
                    "ceiling.py",
                    py,
                    {**ceil, "kind": "cube"},
                )
            )
    return out


# --------------------------------------------------------------------------------- running


def progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="run", desc="throughput", file=sys.stderr)
    except ImportError:

        class Plain:
            n = 0

            def set_postfix_str(self, s: str) -> None:
                log(f"[{self.n + 1}/{total}] {s}")

            def update(self, k: int) -> None:
                self.n += k

            def close(self) -> None:
                pass

        return Plain()


def run_all(contenders: list[Contender], stores: dict[str, Path], reps: int) -> None:
    runnable = [c for c in contenders if c.skipped is None]
    bar = progress(reps * len(runnable))
    for rep in range(reps):
        shift = rep % max(1, len(runnable))
        for c in runnable[shift:] + runnable[:shift]:
            bar.set_postfix_str(f"rep {rep + 1}/{reps}: {c.store} {c.label}")
            if c.skipped is None:
                res = run_script(
                    c.python,
                    c.script,
                    ["--store", str(stores[c.store]), "--settings", json.dumps(c.settings)],
                    timeout=RUN_TIMEOUT_S,
                )
                if "skipped" in res:
                    c.skipped = res["skipped"]
                elif "error" in res:
                    c.errors.append(res["error"])
                    log(f"\n{c.key} failed (rep {rep + 1}): {res['error']}")
                else:
                    res["rep"] = rep
                    res["rows_per_s"] = res["rows"] / res["seconds"]
                    c.results.append(res)
            bar.update(1)
    bar.close()


# --------------------------------------------------------------------------------- reports


def median_rate(c: Contender | None) -> float | None:
    if c is None or not c.results:
        return None
    return statistics.median(r["rows_per_s"] for r in c.results)


def fmt_int(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def mem_total_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "?"


def table(contenders: list[Contender], infos: dict[str, dict]) -> list[str]:
    by_key = {c.key: c for c in contenders}
    lines = [
        "| store | contender | output | rows/s (median) | min–max | MB/s stored | MB/s decoded "
        "| × annbatch | % of ceiling | runs |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c in contenders:
        if c.skipped is not None or not c.results:
            why = c.skipped or (c.errors[-1].splitlines()[-1] if c.errors else "no result")
            lines.append(
                f"| {c.store} | {c.label} | {c.output} | skipped: {why} |  |  |  |  |  |  |"
            )
            continue
        rate = median_rate(c)
        info = infos[c.store]
        per_row_stored = info["stored_bytes"] / info["n_obs"]
        per_row_decoded = info["decoded_bytes"] / info["n_obs"]
        rates = [r["rows_per_s"] for r in c.results]
        ref = median_rate(by_key.get(c.ref)) if c.ref else None
        ceil = median_rate(by_key.get(c.ceiling)) if c.ceiling and c.family != "ceiling" else None
        lines.append(
            f"| {c.store} | {c.label} | {c.output} | {fmt_int(rate)} "
            f"| {fmt_int(min(rates))}–{fmt_int(max(rates))} "
            f"| {fmt_int(rate * per_row_stored / 1e6)} | {fmt_int(rate * per_row_decoded / 1e6)} "
            f"| {'–' if not ref else f'{rate / ref:.2f}×'} "
            f"| {'–' if not ceil else f'{100 * rate / ceil:.0f} %'} | {len(c.results)} |"
        )
    return lines


def targets(contenders: list[Contender]) -> list[str]:
    """Issue #5's targets for the CPU path on the sparse store."""
    by_key = {c.key: c for c in contenders}
    out = []
    for o, need_ratio in (("csr", 1.8), ("dense", 1.2)):
        ours = median_rate(by_key.get(f"sparse/dali_zarr/{o}/cpu"))
        ref = median_rate(by_key.get(f"sparse/annbatch/{o}"))
        ceil = median_rate(by_key.get(f"sparse/ceiling/{o}"))
        if ours is None:
            continue
        parts = []
        if ref:
            ok = "met" if ours / ref >= need_ratio else "NOT met"
            parts.append(f"{ours / ref:.2f}× annbatch (target ≥ {need_ratio}×: {ok})")
        if ceil:
            ok = "met" if ours / ceil >= 0.8 else "NOT met"
            parts.append(f"{100 * ours / ceil:.0f} % of the ceiling (target ≥ 80 %: {ok})")
        if parts:
            out.append(f"- dali_zarr {o.upper() if o == 'csr' else o} (CPU): " + "; ".join(parts))
    return out


def conditions(args, infos, envs, load_before, load_after, seconds, cuda=False) -> list[str]:
    ahead = deepest_read_ahead(cuda)  # as build_contenders warms up
    lines = [
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores "
        f"({len(os.sched_getaffinity(0))} usable), {mem_total_gib()} RAM, "
        f"Linux {platform.release()}; load average before/after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f}"
        + (" (the machine was shared: numbers are noisy)" if load_before[0] > 0.5 else ""),
        f"- Run: {time.strftime('%Y-%m-%d %H:%M %Z')}, {args.reps} repetitions round-robin, "
        f"{seconds / 60:.1f} min; measurement = {args.batches} batches after {args.warmup} "
        f"warm-up (dali_zarr and annbatch: at least {ahead + 1} windows + 2 batches, past any "
        f"read-ahead; torch DataLoader: at least {2 * args.baseline_workers + 1}, past its "
        f"workers' prefetch; clock stops at the first batch past {args.seconds:g} s); page "
        "cache warm (every store file read once before the first measurement)",
    ]
    if "sparse" in infos:
        s = infos["sparse"]
        d = s["data"]
        lines.append(
            f"- Sparse store: {s['n_obs']:,} cells × {s['n_genes']:,} genes, "
            f"{s['nnz'] / s['n_obs']:,.0f} non-zeros per cell (float32 data, int32 indices), "
            f"written by {s['writer']} with its defaults: zarr v3, {d['codecs']}, "
            + (f"shards of {d['shard'][0]:,} elements, " if "shard" in d else "not sharded, ")
            + f"inner chunks of {d['chunk'][0]:,} elements "
            f"(≈ {d['chunk'][0] / (s['nnz'] / s['n_obs']):,.0f} cells); X/data + X/indices "
            f"{s['stored_bytes'] / 1e6:,.0f} MB stored, {s['decoded_bytes'] / 1e6:,.0f} MB decoded"
        )
        lines.append(
            f"- Sparse settings: chunk_size {args.chunk_size}, preload_nchunks "
            f"{args.preload_nchunks}, batch_size {args.batch_size}, shuffled; plain baseline: "
            f"batch_size {args.baseline_batch_size}, {args.baseline_workers} workers"
        )
    if "cube" in infos:
        c = infos["cube"]
        a = c["array"]
        lines.append(
            f"- Dense cube: ({c['n_obs']:,}, {', '.join(map(str, c['shape'][1:]))}) float32, "
            f"written by {c['writer']} with its defaults: zarr v3, {a['codecs']}, chunks "
            f"({', '.join(map(str, a['chunk']))}), not sharded; "
            f"{c['stored_bytes'] / 1e6:,.0f} MB stored, {c['decoded_bytes'] / 1e6:,.0f} MB decoded"
        )
        lines.append(
            f"- Cube settings: chunk_size {args.cube_chunk_size}, preload_nchunks "
            f"{args.cube_preload_nchunks}, batch_size {args.cube_batch_size} (all contenders)"
        )
    main_v = envs["main_versions"]
    lines.append(
        f"- dali_zarr, torch baseline, ceiling, zarr-torch-dataset: Python {main_v['python']}, "
        + ", ".join(f"{k} {v}" for k, v in main_v.items() if k != "python")
        + (f", zarr-torch-dataset {envs['ztd_version']}" if envs["ztd_site"] else "")
    )
    if envs["annbatch_python"]:
        ab = envs["annbatch_versions"]
        lines.append(
            f"- annbatch: Python {ab['python']} ({ANNBATCH_ENV.name}), "
            + ", ".join(f"{k} {v}" for k, v in ab.items() if k != "python")
            + "; zarrs codec pipeline on; CPU only (no cupy)"
        )
    return lines


NOTES = [
    "MB/s stored: compressed bytes of the store's X (data + indices, or the cube's chunks) "
    "per second at that row rate; MB/s decoded: the same rows decoded (float32 values + int32 "
    "column ids; for the cube float32 values).",
    "× annbatch: against annbatch measured in this run, same store and output (dense against "
    "its `.toarray()`). % of ceiling: CSR output against read + decode; dense output from the "
    "sparse store against read + decode + densify; the cube against read + decode.",
    "dali_zarr and annbatch read whole chunks of chunk_size rows and shuffle inside windows of "
    "preload_nchunks chunks; the baseline reads row by row; zarr-torch-dataset's number is its "
    "first epoch (it reads every chunk into worker memory first, then serves later epochs "
    "from memory).",
]


def chart(contenders: list[Contender], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    stores = [s for s in ("sparse", "cube") if any(c.store == s and c.results for c in contenders)]
    if not stores:
        return "no results: no chart"
    fig, axes = plt.subplots(
        len(stores), 1, figsize=(9, 1.2 + 0.5 * len(contenders)), squeeze=False
    )
    for ax, store in zip(axes[:, 0], stores, strict=True):
        cs = [c for c in contenders if c.store == store and c.results]
        labels = [f"{c.label} [{c.output}]" for c in cs]
        rates = [median_rate(c) for c in cs]
        lo = [r - min(x["rows_per_s"] for x in c.results) for r, c in zip(rates, cs, strict=True)]
        hi = [max(x["rows_per_s"] for x in c.results) - r for r, c in zip(rates, cs, strict=True)]
        colors = [
            "#76b900"
            if c.family == "dali_zarr"
            else "#999999"
            if c.family == "ceiling"
            else "#4477aa"
            for c in cs
        ]
        y = range(len(cs))
        ax.barh(list(y), rates, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("rows/s (median of repetitions; bars: min–max)")
        ax.set_title(f"{store} store", fontsize=10)
        for yi, r, h in zip(y, rates, hi, strict=True):
            ax.text(r + h, yi, f"  {r:,.0f}", va="center", fontsize=7)
        ax.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
        ax.set_xlim(0, max(r + h for r, h in zip(rates, hi, strict=True)) * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("stores")
    g.add_argument("--n-obs", type=int, default=100_000, help="cells in the sparse store")
    g.add_argument("--n-genes", type=int, default=20_000, help="genes in the sparse store")
    g.add_argument("--nnz-per-cell", type=float, default=1500, help="mean non-zeros per cell")
    g.add_argument("--cube-n", type=int, default=1024, help="observations in the dense cube")
    g.add_argument("--cube-chunk", type=int, default=4, help="cube chunk length on axis 0")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("loader settings (all contenders)")
    g.add_argument("--chunk-size", type=int, default=256)
    g.add_argument("--preload-nchunks", type=int, default=32)
    g.add_argument("--batch-size", type=int, default=4096)
    g.add_argument("--cube-chunk-size", type=int, default=None, help="default: --cube-chunk")
    g.add_argument("--cube-preload-nchunks", type=int, default=16)
    g.add_argument("--cube-batch-size", type=int, default=32)
    g.add_argument(
        "--baseline-batch-size",
        type=int,
        default=256,
        help="batch size of the row-by-row torch baseline on the sparse store",
    )
    g.add_argument(
        "--baseline-workers",
        type=int,
        default=2,
        help="DataLoader workers (baseline and zarr-torch-dataset)",
    )
    g = p.add_argument_group("measurement")
    g.add_argument("--reps", type=_at_least_one, default=3, help="repetitions of every contender")
    g.add_argument(
        "--batches", type=_at_least_one, default=24, help="batches timed per measurement"
    )
    g.add_argument("--seconds", type=float, default=10.0, help="time cap per measurement")
    g.add_argument("--warmup", type=int, default=2, help="batches before the clock starts")
    g.add_argument(
        "--only",
        default=",".join(FAMILIES),
        help=f"comma-separated contenders to run, of: {', '.join(FAMILIES)}",
    )
    g.add_argument("--stores", default="sparse,cube", help="comma-separated: sparse, cube")
    g.add_argument(
        "--python312",
        default=None,
        help="Python 3.12 for annbatch's environment (default: python3.12 on PATH, "
        "then ~/.pyenv/versions/3.12*)",
    )
    g.add_argument("--out", default=str(HERE / "out"), help="output folder (stores cached here)")
    args = p.parse_args(argv)
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.stores = {s.strip() for s in args.stores.split(",") if s.strip()}
    if bad := args.only - set(FAMILIES):
        p.error(f"--only: unknown {sorted(bad)}; use {', '.join(FAMILIES)}")
    if bad := args.stores - {"sparse", "cube"}:
        p.error(f"--stores: unknown {sorted(bad)}")
    args.cube_chunk_size = args.cube_chunk_size or args.cube_chunk
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    envs: dict[str, Any] = {
        "annbatch_python": None,
        "annbatch_why": "not requested",
        "ztd_site": None,
        "ztd_why": "not requested",
        "ztd_version": None,
    }
    envs["main_versions"] = env_versions(
        sys.executable, ["dali-zarr", "nvidia-dali-cuda120", "torch", "zarr", "numcodecs", "numpy"]
    ) or {"python": platform.python_version()}
    # annbatch's environment also writes the sparse store (anndata 0.13) where it exists;
    # it is made only for annbatch itself, so a run without annbatch needs no Python 3.12
    needs_ab = "annbatch" in args.only or ("sparse" in args.stores and ANNBATCH_PYTHON.exists())
    if needs_ab:
        py, res = ensure_annbatch_env(args.python312)
        if py:
            envs["annbatch_python"], envs["annbatch_versions"] = py, res
        else:
            envs["annbatch_why"] = res
            log(f"annbatch: {res}")
    if "zarr_torch_dataset" in args.only and "cube" in args.stores:
        site, res = ensure_ztd_site()
        envs["ztd_site"], envs["ztd_version"], envs["ztd_why"] = site, res, res
        if site is None:
            log(f"zarr-torch-dataset: {res}")

    stores: dict[str, Path] = {}
    infos: dict[str, dict] = {}
    if "sparse" in args.stores:
        stores["sparse"], infos["sparse"] = ensure_sparse_store(
            args, envs["annbatch_python"] or sys.executable
        )
    if "cube" in args.stores:
        stores["cube"], infos["cube"] = ensure_cube_store(args)
    for path in stores.values():
        warm_page_cache(path)

    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    contenders = build_contenders(args, envs, cuda)
    load_before = os.getloadavg()
    t_run = time.perf_counter()
    run_all(contenders, stores, args.reps)
    load_after = os.getloadavg()

    note = chart(contenders, out / "throughput.png")
    md = [
        "# Loader throughput",
        "",
        "`"
        + " ".join(["python benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)])
        + "`",
        "",
        *table(contenders, infos),
        "",
        *targets(contenders),
        "",
        "Conditions:",
        "",
        *conditions(args, infos, envs, load_before, load_after, time.perf_counter() - t_run, cuda),
        "",
        "Notes:",
        "",
        *(f"- {n}" for n in NOTES),
    ]
    if note:
        md += [f"- {note}"]
    else:
        md += ["", "![throughput](throughput.png)"]
    (out / "throughput.md").write_text("\n".join(md) + "\n")
    (out / "throughput.json").write_text(
        json.dumps(
            {
                "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                "stores": infos,
                "environments": envs,
                "contenders": [
                    {
                        "key": c.key,
                        "label": c.label,
                        "python": c.python,
                        "settings": c.settings,
                        "results": c.results,
                        "skipped": c.skipped,
                        "errors": c.errors,
                    }
                    for c in contenders
                ],
            },
            indent=1,
        )
    )
    print("\n".join(md))
    written = [out / "throughput.md", out / "throughput.json"]
    written += [out / "throughput.png"] if note is None else []  # no chart without matplotlib
    log(f"\nwrote {', '.join(map(str, written))} in {(time.perf_counter() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
