"""The GPU kernels' indexing, checked without a GPU.

1. Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), in a child process: the
   variable must be set before ``numba.cuda`` is first imported, and DALI's numba plugin
   imports it, so it cannot be set in the pytest process. The child runs every kernel of
   ``dali_zarr.graph.cuda_kernels`` on randomized windows (empty rows, duplicate column ids,
   last partial batch, int32/int64 column ids, float32/float64/int data, several launch
   shapes so that grid-stride loops wrap) and compares with the CPU kernels of
   ``dali_zarr.graph.kernels`` (their Python functions compiled with ``numba.njit``) and with
   scipy/numpy/torch. It prints one ``RESULT {json}`` line: per group, cases run and failures.
2. In this process: every kernel compiles to PTX for the argument types DALI passes
   (C-contiguous arrays of the op's dtypes), so typing errors the simulator cannot see
   (it runs the kernels as plain Python) are caught too. Skipped where libNVVM is missing.
3. ``gpu`` tests run the real ops in DALI GPU pipelines against the CPU ops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.processes import ROOT, child_env
from tests.stores import needs_cuda

GROUPS = [
    "densify",
    "densify_panel",
    "gather_csr",
    "gather_dense",
    "select_columns",
    "bfloat16",
    "float16",
    "copy_segments",
    "zstd_frame_ends",
    "remap_columns",
    "keep_panel_rows",
    "cuda_backend",
]


# ---------------------------------------------------------------------------- the child


def _random_csr(rng, n_rows: int, n_cols: int, data_dtype, index_dtype):
    lengths = rng.integers(0, 9, n_rows)
    lengths[rng.random(n_rows) < 0.3] = 0  # empty rows
    lengths[0] = 0
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    nnz = int(indptr[-1])
    indices = rng.integers(0, n_cols, nnz)
    for r in np.flatnonzero(lengths >= 2)[::3]:  # force duplicate column ids in some rows
        a = indptr[r]
        indices[a + 1] = indices[a]
    if nnz:
        indices[-1] = n_cols - 1  # the last column is hit
    data = rng.integers(1, 20, nnz)  # integer values: float sums are exact in any order
    return data.astype(data_dtype), indices.astype(index_dtype), indptr


def _batches(rng, n_rows: int):
    """Shuffled positions: full window, last partial batch, one row, no row."""
    perm = rng.permutation(n_rows).astype(np.int64)
    return [perm, perm[: n_rows // 3 + 1], perm[:1], perm[:0]]


LAUNCHES = [(1, 1), (3, 4), (2, 32)]  # (blocks, threads): grid-stride wraps in each


def _launches(case: int, batch: int):
    """Every launch shape for the first case's full batch, one (rotating) for the others:
    the simulator runs each thread as a Python thread, so every launch costs ~0.3 s."""
    return LAUNCHES if case == batch == 0 else [LAUNCHES[(case + batch) % len(LAUNCHES)]]


def _worker() -> dict:
    import numba
    import scipy.sparse as sp
    import torch
    from numba import cuda

    assert numba.config.ENABLE_CUDASIM, "the worker must run under the CUDA simulator"
    from dali_zarr.data.dataset import sub_indptr
    from dali_zarr.graph import cuda_kernels as K
    from dali_zarr.graph import kernels
    from dali_zarr.io.gpu import copy_segments_cpu
    from dali_zarr.planning.partition import concat_aranges, run_offsets

    cpu_densify = numba.njit(kernels._densify_csr_rows)
    cpu_gather = numba.njit(kernels._gather_csr_rows)
    cpu_dense = numba.njit(kernels._gather_dense_rows)
    cpu_select = numba.njit(kernels._select_row_columns)
    jitted: dict = {}
    eq = np.testing.assert_array_equal

    def run(fn, launch, *args):
        kernel = jitted.get(fn) or jitted.setdefault(fn, cuda.jit(fn))
        dev = [cuda.to_device(np.ascontiguousarray(a)) for a in args]
        kernel[launch](*dev)
        return [d.copy_to_host() for d in dev]

    results = {g: {"cases": 0, "failures": []} for g in GROUPS}

    def check(group, name, case, *args):
        results[group]["cases"] += 1
        try:
            case(*args)
        except Exception as e:  # collect every failure, not only the first
            results[group]["failures"].append(f"{name}: {type(e).__name__}: {e}"[:2000])

    def densify(fn, launch, pos, csr, n_cols, want, cpu):
        out = np.full((len(pos), n_cols), np.nan, np.float32)  # garbage where not written
        got = run(fn, launch, out, pos, *csr)[0]
        eq(got, want)
        eq(got, cpu)

    def select(launch, stored, maps, row_maps, width):
        """``stored``: each row as stored (widths differ), laid end to end."""
        flat = np.concatenate(stored)
        row_starts = run_offsets(np.array([len(row) for row in stored], np.int64))[:-1]
        want = np.stack([row[maps[m : m + width]] for row, m in zip(stored, row_maps, strict=True)])
        out = np.zeros((len(stored), width), flat.dtype)
        got = run(K.select_row_columns, launch, out, flat, row_starts, row_maps, maps)[0]
        eq(got, want)
        ref = np.zeros_like(out)
        cpu_select(ref, flat, row_starts, row_maps, maps)
        eq(ref, want)

    def gather(launch, pos, csr, window):
        data, indices, indptr = csr
        bptr = sub_indptr(indptr, pos)
        nnz = int(bptr[-1])
        hint = np.empty((nnz, 0), np.uint8)
        outs = [np.full(nnz, 99, data.dtype), np.full(nnz, 77, indices.dtype)]
        outs.append(np.full(len(pos) + 1, -1, np.int64))
        got = run(K.gather_csr_rows, launch, *outs, hint, bptr, pos, *csr)[:3]
        ref = [np.empty(nnz, data.dtype), np.empty(nnz, indices.dtype)]
        ref.append(np.empty(len(pos) + 1, np.int64))
        cpu_gather(*ref, hint, bptr, pos, *csr)
        for g, r in zip(got, ref, strict=True):
            eq(g, r)
            assert g.dtype == r.dtype
        rows = sp.csr_matrix(tuple(got), shape=(len(pos), window.shape[1]))
        eq(rows.toarray(), window[pos].toarray().astype(rows.dtype))
        # rows cut short in place (a panel kept on the device): each row's first entries
        short = (indptr[pos + 1] - indptr[pos]) // 2
        sptr = np.concatenate([[0], np.cumsum(short)]).astype(np.int64)
        keep = concat_aranges(indptr[pos], short)
        hint = np.empty((int(sptr[-1]), 0), np.uint8)
        outs = [np.full(len(keep), 99, data.dtype), np.full(len(keep), 77, indices.dtype)]
        outs.append(np.full(len(pos) + 1, -1, np.int64))
        got = run(K.gather_csr_rows, launch, *outs, hint, sptr, pos, *csr)[:3]
        for g, r in zip(got, (data[keep], indices[keep], sptr), strict=True):
            eq(g, r)
        cpu_gather(*outs, hint, sptr, pos, *csr)
        for g, r in zip(outs, (data[keep], indices[keep], sptr), strict=True):
            eq(g, r)

    def dense(launch, pos, values, ref):
        out = np.full((len(pos), values.shape[1]), np.nan, np.float32)
        got = run(K.gather_dense_rows, launch, out, pos, values)[0]
        eq(got, values[pos].astype(np.float32))
        eq(got, ref.astype(np.float32))

    def bf16(launch, x, want16):
        out = np.zeros(x.shape, np.uint16)
        got = run(K.float32_bits_to_bfloat16_bits, launch, out, x.view(np.uint32))[0]
        nan = np.isnan(x)
        eq(got[~nan], want16.view(np.uint16)[~nan])
        back = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()
        assert np.isnan(back[nan]).all()

    cpu_f16 = numba.njit(kernels._to_float16_bits)
    cpu_fast = numba.njit(kernels._float32_bits_to_float16_bits)

    def f16(launch, x):
        # NumPy rounds once from the value; torch's .half() agrees for float32 and integers,
        # and narrows float64 through float32 (twice rounded), which is why it is not used
        want = x.astype(np.float16).view(np.uint16)
        if x.dtype != np.float64:
            torch_half = torch.from_numpy(x.copy()).half().view(torch.int16).numpy()
            eq(want[~np.isnan(x.astype(np.float64))], torch_half.view(np.uint16)[~np.isnan(x)])
        out = np.zeros(x.shape, np.uint16)
        got = run(K.to_float16_bits, launch, out, x)[0]
        nan = np.isnan(x.astype(np.float64))
        eq(got[~nan], want[~nan])
        assert ((got[nan] & 0x7FFF) > 0x7C00).all()  # NaN stays NaN
        cpu = np.zeros(x.shape, np.uint16)
        cpu_f16(cpu, x)
        eq(cpu, got)
        if x.dtype == np.float32:  # and the integer-only twins that float32 batches take
            fast = np.zeros(x.shape, np.uint16)
            got = run(K.float32_bits_to_float16_bits, launch, fast, x.view(np.uint32))[0]
            eq(got[~nan], want[~nan])
            assert ((got[nan] & 0x7FFF) > 0x7C00).all()
            cpu_fast(fast, x.view(np.uint32))
            eq(fast, got)

    def segments(launch, src, seg, out_dtype):
        want = np.zeros(int(seg[:, 2].sum()), out_dtype)
        copy_segments_cpu(want, src, seg)
        eq(want, np.concatenate([src[a : a + n] for a, _, n in seg]).astype(out_dtype))
        out = np.full(len(want), -1, out_dtype)
        got = run(K.copy_segments, launch, out, src, seg[:, 0], seg[:, 1], seg[:, 2])[0]
        eq(got, want)

    cpu_remap = numba.njit(kernels._remap_run_columns)

    def remap(launch, indices, bounds, offsets, widths, maps, want_bad):
        out = indices.copy()
        bad = cpu_remap(out, bounds, offsets, widths, maps)
        assert (bad > 0) == (want_bad is not None), bad
        got_bad, got = run(K.remap_run_columns, launch, np.zeros(1, np.int64), indices, bounds,
                           offsets, widths, maps)[:2]  # fmt: skip
        if want_bad is None:
            assert got_bad[0] == 0
            ref = np.concatenate([
                maps[o + indices[a:b].astype(np.int64)]
                for a, b, o in zip(bounds[:-1], bounds[1:], offsets, strict=True)
            ])  # fmt: skip
            eq(got, ref.astype(indices.dtype))
            eq(out, got)
        else:  # a bad run is named; its bad id is left as it was
            assert bad == want_bad + 1 and got_bad[0] == want_bad + 1, (bad, got_bad)
            a, b = bounds[want_bad], bounds[want_bad + 1]
            assert (got[a:b] == indices[a:b]).any()

    cpu_keep = numba.njit(kernels._keep_panel_rows)

    def keep_rows(launch, csr, run_rows, offsets, widths, maps, n_kept, want_bad):
        data, indices, indptr = csr
        n_rows = len(indptr) - 1
        row_maps, row_widths = (np.repeat(a, np.diff(run_rows)) for a in (offsets, widths))
        host = [data.copy(), indices.copy()]
        kept_cpu = np.full(n_rows, -1, np.int64)
        bad = cpu_keep(kept_cpu, *host, indptr, row_maps, row_widths, maps, n_kept)
        kept, got_bad, d, i = run(K.keep_panel_rows, launch, np.full(n_rows, -1, np.int64),
                                  np.zeros(1, np.int64), data, indices, indptr, row_maps,
                                  row_widths, maps, np.int64(n_kept))[:4]  # fmt: skip
        if want_bad is not None:  # the bad row is named; the bad id stays where it was
            assert bad == want_bad + 1 and got_bad[0] == want_bad + 1, (bad, got_bad)
            a, b, w = indptr[want_bad], indptr[want_bad + 1], row_widths[want_bad]
            assert (i[a:b] >= w).any() and (host[1][a:b] >= w).any()
            return
        assert bad == 0 and got_bad[0] == 0
        eq(kept, kept_cpu)
        run_of = np.repeat(np.arange(len(offsets)), np.diff(run_rows))
        for r in range(n_rows):  # each row's kept entries, in order, at its start
            a, b = indptr[r], indptr[r + 1]
            mapped = maps[offsets[run_of[r]] + indices[a:b].astype(np.int64)]
            keep = mapped < n_kept
            assert kept[r] == keep.sum()
            for got_d, got_i in ((d, i), host):
                eq(got_i[a : a + kept[r]], mapped[keep].astype(indices.dtype))
                eq(got_d[a : a + kept[r]], data[a:b][keep])

    rng = np.random.default_rng(1234)

    # -- CSR: densify (both variants) and gather ----------------------------------------------
    windows = [
        (np.float32, np.int32, 23, 37),
        (np.float64, np.int64, 17, 11),
        (np.int32, np.int32, 19, 64),
        (np.float32, np.int64, 9, 5),
        (np.uint16, np.uint32, 12, 8),
    ]
    for wi, (ddt, idt, n_rows, n_cols) in enumerate(windows):
        csr = _random_csr(rng, n_rows, n_cols, ddt, idt)
        window = sp.csr_matrix((csr[0].astype(np.float64), csr[1], csr[2]), shape=(n_rows, n_cols))
        variants = [
            ("scatter", K.densify_csr_scatter),
            ("shared", K.make_densify_csr_shared(n_cols)),
        ]
        for bi, pos in enumerate(_batches(rng, n_rows)):
            want = np.asarray(window[pos].toarray(), dtype=np.float32)
            cpu = np.empty((len(pos), n_cols), np.float32)
            cpu_densify(cpu, pos, *csr)
            for launch in _launches(wi, bi):
                tag = f"window{wi} {np.dtype(ddt)}/{np.dtype(idt)} batch{bi} launch{launch}"
                for variant, fn in variants:
                    check("densify", f"{variant} {tag}", densify, fn, launch, pos, csr, n_cols,
                          want, cpu)  # fmt: skip
                check("gather_csr", tag, gather, launch, pos, csr, window)
        # a panel: some columns dropped (the last one kept), the rest reordered; the window
        # reader maps ids to panel columns, dropped ones to the panel's width, which both
        # densify variants skip
        keep = np.concatenate([[n_cols - 1], rng.permutation(n_cols - 1)[: n_cols // 2]])
        table = np.full(n_cols, len(keep), np.int64)
        table[keep] = np.arange(len(keep))
        mapped = csr[1].copy()  # one run through the table, as the reader maps a window
        one_run = (np.array([0, len(mapped)]), np.zeros(1, np.int64), np.array([n_cols]))
        assert kernels._remap_run_columns(mapped, *one_run, table) == 0
        panel_csr = (csr[0], mapped, csr[2])
        panel_variants = [
            ("scatter", K.densify_csr_scatter),
            ("shared", K.make_densify_csr_shared(len(keep))),
        ]
        for bi, pos in enumerate(_batches(rng, n_rows)):
            want = np.asarray(window[pos][:, keep].toarray(), dtype=np.float32)
            cpu = np.empty(want.shape, np.float32)
            cpu_densify(cpu, pos, *panel_csr)
            for launch in _launches(wi, bi):
                tag = f"window{wi} {np.dtype(ddt)}/{np.dtype(idt)} batch{bi} launch{launch}"
                for variant, fn in panel_variants:
                    check("densify_panel", f"{variant} {tag}", densify, fn, launch, pos,
                          panel_csr, len(keep), want, cpu)  # fmt: skip
    check("densify", "variant choice", _variant_choice, K)
    for launch in LAUNCHES:
        check("densify", f"no features launch{launch}", _densify_no_features, K, run, launch)

    # -- dense gather (fused cast) ------------------------------------------------------------
    for vi, vdt in enumerate((np.float32, np.float64, np.int16, np.uint8)):
        values = (rng.standard_normal((21, 13)) * 50).astype(vdt)
        for bi, pos in enumerate(_batches(rng, 21)):
            ref = np.empty((len(pos), 13), vdt)
            cpu_dense(ref, pos, values)
            for launch in _launches(vi, bi):
                tag = f"{np.dtype(vdt)} batch{bi} launch{launch}"
                check("gather_dense", tag, dense, launch, pos, values, ref)

    # -- dense panels: each row's panel columns out of its stored row ------------------------
    for vi, vdt in enumerate((np.float32, np.uint16, np.int64, np.uint8)):
        # three panels of 5 columns (reordered, last column, repeats) over stores 11, 11
        # and 14 wide, end to end; rows of the three stores interleaved as runs are
        maps = np.array([10, 0, 4, 4, 7, 1, 2, 3, 5, 6, 13, 8, 7, 11, 0], np.int64)
        row_maps = np.repeat([5, 0, 10, 0, 5, 10], [4, 3, 2, 1, 6, 5])
        stored = [(rng.standard_normal(11 if m < 10 else 14) * 50).astype(vdt) for m in row_maps]
        for launch in _launches(vi, 0):
            check("select_columns", f"{np.dtype(vdt)} launch{launch}", select, launch, stored,
                  maps, row_maps, 5)  # fmt: skip

    # -- float32 -> bfloat16 bits -------------------------------------------------------------
    x = np.concatenate(
        [
            rng.standard_normal(200).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-42, 3.4e38], np.float32),
            # exact ties between two bfloat16 values: round half to even
            (np.arange(1, 33, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
            np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFFC00001], np.uint32).view(np.float32),
        ]
    )
    x = x.reshape(-1, 4)  # every value above, the special ones last
    want16 = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    for launch in LAUNCHES:
        check("bfloat16", f"launch{launch}", bf16, launch, x, want16)

    # -- float16 bits: one rounding from float32, float64 and integers ------------------------
    halves = np.concatenate(
        [
            rng.standard_normal(40) * 1e3,
            [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 2**-24, 2**-25],
            [3 * 2**-26, 2**-14 - 2**-25, 2049, 2051, 4097, 1 + 2**-11, 1 + 3 * 2**-11],
            [2049 + 1e-9, -(1 + 2**-11 + 2**-40), 1e-30],  # float32 would round onto a tie
        ]
    )
    halves = np.resize(halves, 64).reshape(-1, 4)
    for dt in (np.float32, np.float64):
        for launch in LAUNCHES:
            check("float16", f"{np.dtype(dt)} launch{launch}", f16, launch, halves.astype(dt))
    counts = np.array([[0, 1, 2049, 2051], [4097, 65519, 65520, 70000]], np.int32)
    check("float16", "int32 counts", f16, LAUNCHES[1], counts)

    # -- segment copies (the GPU read path's window assembly) ---------------------------------
    # the last two widen as they copy (a store's int32 ids or float16 values in a wider window)
    kinds = [(np.float32, np.float32)] * 3 + [(np.int32, np.int64), (np.float16, np.float32)]
    for trial, (src_dtype, out_dtype) in enumerate(kinds):
        src = (rng.integers(0, 1000, 500) - 400).astype(src_dtype)
        lens = rng.integers(1, 30, 12)
        seg = np.stack([rng.integers(0, 470, 12), np.cumsum(lens) - lens, lens], 1)
        for launch in LAUNCHES:
            check("copy_segments", f"trial{trial} launch{launch}", segments, launch, src,
                  seg.astype(np.int64), out_dtype)  # fmt: skip
    # -- zstd frame ends (the GPU read path's check for chunks cut short) -------------------
    import numcodecs
    import zstandard

    from dali_zarr.io.codecs import FRAME_HEAD_NBYTES, zstd_frame_ends, zstd_walk_from

    def frame_ends(launch, staging, starts, nbytes):
        heads = np.stack([staging[a : a + FRAME_HEAD_NBYTES] for a in starts.tolist()])
        first, checksum = zstd_walk_from(heads)
        want = zstd_frame_ends(staging, starts, nbytes, first, checksum, 1 << 20)
        ends = np.zeros(len(starts), np.int64)
        eq(run(K.zstd_frame_ends, launch, ends, staging, starts, nbytes, first, checksum)[0], want)
        return want

    values = [rng.standard_normal(40_000).astype(np.float32),  # raw blocks (48 at level 3)
              rng.poisson(1, 40_000).astype(np.float32), np.zeros(40_000, np.float32)]  # fmt: skip
    frames = [numcodecs.Zstd(level=lv, checksum=ck).encode(v)
              for v in values for lv in (1, 3) for ck in (False, True)]  # fmt: skip
    frames += [zstandard.ZstdCompressor(level=3).compress(v.tobytes()) for v in values]
    frames += [zstandard.ZstdCompressor(write_content_size=False).compress(values[1].tobytes())]
    stored = [*frames, frames[0][:-100], frames[5][:1000], b"\x28\xb5\x2f\xfd" + b"\xff" * 40]
    staging = np.frombuffer(b"".join(bytes(f) + bytes(64) for f in stored), np.uint8)
    starts = np.cumsum([0] + [len(f) + 64 for f in stored[:-1]]).astype(np.int64)
    nbytes = np.array([len(f) for f in stored], np.int64)

    def frame_cases(launch):
        got = frame_ends(launch, staging, starts, nbytes)
        eq(got[: len(frames)], nbytes[: len(frames)])  # whole frames end where stored
        cut = got[len(frames) : len(frames) + 2]  # no last block in, or one ending past
        assert ((cut == -1) | (cut > nbytes[len(frames) : len(frames) + 2])).all(), cut
        assert got[-1] == -1, got[-1]  # a reserved block type

    for launch in LAUNCHES:
        check("zstd_frame_ends", f"launch{launch}", frame_cases, launch)
    # -- per-run panel maps (collections of panels keeping different columns) --------------
    for ti, idt in enumerate((np.int32, np.int64, np.uint32)):
        widths = np.array([7, 12, 7, 5], np.int64)  # four maps (the panel keeps 4 columns)
        tables = [np.where(rng.random(w) < 0.5, rng.integers(0, 4, w), 4) for w in widths]
        offsets_of = np.cumsum([0, *widths[:-1]])
        maps = np.concatenate(tables).astype(np.int64)
        which = rng.integers(0, 4, 9)  # nine runs, some empty, maps reused
        lens = rng.integers(0, 15, 9)
        lens[[0, 4]] = 0
        lens[6] = 3 + lens[6]  # the run given a bad id below
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        indices = np.concatenate(
            [rng.integers(0, widths[w], n) for w, n in zip(which, lens, strict=True)]
        )
        indices = indices.astype(idt)
        args = (bounds, offsets_of[which].astype(np.int64), widths[which], maps)
        for launch in LAUNCHES:
            check("remap_columns", f"{np.dtype(idt)} launch{launch}", remap, launch, indices,
                  *args, None)  # fmt: skip
        bad_run = 6
        broken = indices.copy()
        broken[bounds[bad_run] + lens[bad_run] // 2] = widths[which[bad_run]]  # one past
        check("remap_columns", f"{np.dtype(idt)} bad id", remap, LAUNCHES[1], broken,
              *args, bad_run)  # fmt: skip
        # the same maps over rows: CSR output of the panels, rows cut in place
        n_rows = 14
        csr = _random_csr(rng, n_rows, 5, np.float32, idt)  # ids below every width
        run_rows = np.array([0, 0, 3, 3, 9, n_rows], np.int64)  # five runs, two empty
        which = rng.integers(0, 4, 5)
        rows_args = (run_rows, offsets_of[which].astype(np.int64), widths[which], maps, 4)
        # every launch shape for the first id dtype, one for the others: a block's scan syncs
        # its threads once per step, which the simulator makes slow
        for launch in LAUNCHES if ti == 0 else [LAUNCHES[ti]]:
            check("keep_panel_rows", f"{np.dtype(idt)} launch{launch}", keep_rows, launch, csr,
                  *rows_args, None)  # fmt: skip
        bad_rows = [r for r in range(3, 9) if csr[2][r + 1] - csr[2][r] >= 2]
        assert bad_rows, "the test window needs a row of 2+ entries in run 3"
        broken = csr[1].copy()
        broken[csr[2][bad_rows[0]]] = widths[which[3]]  # one past run 3's width, first
        check("keep_panel_rows", f"{np.dtype(idt)} bad id", keep_rows, LAUNCHES[2],
              (csr[0], broken, csr[2]), *rows_args, bad_rows[0])  # fmt: skip
        # rows of several tiles: a block walks each in tiles of its threads
        lengths = np.array([70, 0, 33, 64, 1, 45], np.int64)
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        long = (rng.integers(1, 20, indptr[-1]).astype(np.float32),
                rng.integers(0, 5, indptr[-1]).astype(idt), indptr)  # fmt: skip
        run_rows = np.array([0, 2, 2, 6], np.int64)
        which = rng.integers(0, 4, 3)
        long_args = (run_rows, offsets_of[which].astype(np.int64), widths[which], maps, 4)
        for launch in LAUNCHES[1:] if ti == 0 else [LAUNCHES[1 + ti % 2]]:
            check("keep_panel_rows", f"{np.dtype(idt)} long rows launch{launch}", keep_rows,
                  launch, long, *long_args, None)  # fmt: skip
        if ti == 0:
            broken = long[1].copy()
            broken[indptr[3] + 40] = widths[which[2]]  # in row 3's second tile of 32, run 2
            check("keep_panel_rows", f"{np.dtype(idt)} bad id, tile 2", keep_rows, LAUNCHES[2],
                  (long[0], broken, indptr), *long_args, 3)  # fmt: skip

    # -- the CUDA backend's panel launches against the host backend's ------------------------
    backend = _simulated_cuda_backend()
    from dali_zarr.graph.window_backends import HostBackend

    host_backend = HostBackend()
    widths = np.array([7, 12, 7, 5], np.int64)
    maps = np.concatenate([np.where(rng.random(w) < 0.5, rng.integers(0, 4, w), 4) for w in widths])
    offsets_of = np.cumsum([0, *widths[:-1]]).astype(np.int64)
    lengths = np.array([3, 0, 40, 9, 1, 12], np.int64)
    indptr = run_offsets(lengths)
    run_rows = np.array([0, 2, 3, 6], np.int64)  # three runs of rows
    which = np.array([1, 3, 0])
    run_bounds = indptr[run_rows]
    csr = (rng.integers(1, 20, indptr[-1]).astype(np.float32),
           rng.integers(0, 5, indptr[-1]).astype(np.int32), indptr)  # fmt: skip
    per_row = [np.repeat(a[which], np.diff(run_rows)) for a in (offsets_of, widths)]

    def backends_agree(bad_at):
        indices = csr[1].copy()
        if bad_at is not None:
            indices[bad_at] = 12  # at or past every map's width (the widest is 12)
        both = []
        for be in (backend, host_backend):
            ids = indices.copy()
            bad = be.remap_columns(ids, run_bounds, offsets_of[which], widths[which], maps)
            data, cut = csr[0].copy(), indices.copy()
            kept, bad_row = be.keep_panel_rows(data, cut, indptr, *per_row, maps, 4)
            both.append((bad, ids, bad_row, None if bad_row else (kept, data, cut)))
        (bad, ids, bad_row, rows), (want_bad, want_ids, want_row, want_rows) = both
        assert (bad, bad_row) == (want_bad, want_row), (bad, bad_row, want_bad, want_row)
        if bad_at is None:
            assert bad == bad_row == 0
        else:  # 1 + the run and 1 + the row holding it
            row = int(np.searchsorted(indptr, bad_at, side="right")) - 1
            assert bad_row == row + 1
            assert bad == int(np.searchsorted(run_rows, row, side="right"))
        if not bad:
            eq(ids, want_ids)
            for got, want in zip(rows, want_rows, strict=True):
                eq(got, want)

    check("cuda_backend", "panel ids", backends_agree, None)
    check("cuda_backend", "panel ids, a bad id", backends_agree, int(indptr[3]) + 4)

    def dense_columns():
        stored = [rng.standard_normal(w).astype(np.float16) for w in (11, 11, 14, 11)]
        flat = np.concatenate(stored)
        row_starts = run_offsets(np.array([len(r) for r in stored], np.int64))[:-1]
        table = np.array([10, 0, 4, 1, 2, 3, 13, 8, 7], np.int64)
        row_maps = np.array([3, 0, 6, 3], np.int64)
        outs = []
        for be in (backend, host_backend):
            out = np.zeros((4, 3), np.uint16)  # float16 windows cross as their bits
            be.select_columns(out, flat.view(np.uint16), row_starts, row_maps, table)
            outs.append(out)
        eq(outs[0], outs[1])
        eq(outs[0].view(np.float16)[2], stored[2][[13, 8, 7]])

    check("cuda_backend", "dense panel columns", dense_columns)
    return results


def _simulated_cuda_backend():
    """A ``CudaBackend`` whose launches run under the simulator: cupy replaced by NumPy
    (arrays with cupy's ``get``), no executor but its stream. What it checks is the
    backend's own glue: the arguments each launch gets, and what comes back."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from numba import cuda

    from dali_zarr.graph.window_backends import CudaBackend

    class Array(np.ndarray):
        def get(self, stream=None):
            return np.asarray(self).copy()

    class Stream(contextlib.nullcontext):
        ptr = 0

    cuda.external_stream = lambda ptr: 0  # the simulator runs every launch in order
    backend = object.__new__(CudaBackend)
    backend.cp = SimpleNamespace(
        asarray=np.asarray,
        zeros=lambda n, dtype: np.zeros(n, dtype).view(Array),
        empty=lambda n, dtype: np.full(n, -1, dtype).view(Array),
        int64=np.int64,
        cuda=SimpleNamespace(Device=lambda i: contextlib.nullcontext()),
    )
    backend.device_id = 0
    backend._local = threading.local()
    backend._local.executor = SimpleNamespace(stream=Stream())
    return backend


def _variant_choice(K) -> None:
    assert K.densify_kernel(K.SHARED_COLS).__name__ == "densify_csr_shared"
    assert K.densify_kernel(K.SHARED_COLS + 1) is K.densify_csr_scatter
    assert K.densify_kernel(0) is K.densify_csr_scatter  # a store of no features


def _densify_no_features(K, run, launch) -> None:
    """A store of no features (the CPU path yields (B, 0) batches): the variant chosen
    for it writes nothing (the shared one stored column 0 past a (B, 0) output)."""
    pos = np.arange(4, dtype=np.int64)
    csr = (np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(5, np.int64))
    got = run(K.densify_kernel(0), launch, np.zeros((4, 0), np.float32), pos, *csr)[0]
    assert got.shape == (4, 0)


# ---------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def simulated():
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"],
        env=child_env(NUMBA_ENABLE_CUDASIM="1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("group", GROUPS)
def test_kernels_under_cuda_simulator(simulated, group):
    got = simulated[group]
    assert got["cases"] > 0
    assert not got["failures"], "\n".join(got["failures"][:10])


def _nvvm_available() -> bool:
    try:
        from numba import cuda, types

        def k(a):
            a[0] = 1

        cuda.compile_ptx(k, (types.int32[::1],), cc=(8, 0))
        return True
    except Exception:
        return False


_GATHER_NDIMS = [1, 1, 1, 2, 1, 1, 1, 1, 1]
PTX_CASES = [
    ("densify_csr_scatter", ["f4", "i8", "f4", "i4", "i8"], [2, 1, 1, 1, 1]),
    ("densify_csr_scatter", ["f4", "i8", "f8", "i8", "i8"], [2, 1, 1, 1, 1]),
    ("shared", ["f4", "i8", "i4", "i4", "i8"], [2, 1, 1, 1, 1]),
    ("shared", ["f4", "i8", "u2", "u4", "i8"], [2, 1, 1, 1, 1]),
    ("gather_csr_rows", ["f4", "i4", "i8", "u1", "i8", "i8", "f4", "i4", "i8"], _GATHER_NDIMS),
    ("gather_csr_rows", ["f8", "i8", "i8", "u1", "i8", "i8", "f8", "i8", "i8"], _GATHER_NDIMS),
    ("select_row_columns", ["u4", "u4", "i8", "i8", "i8"], [2, 1, 1, 1, 1]),
    ("select_row_columns", ["u2", "u2", "i8", "i8", "i8"], [2, 1, 1, 1, 1]),
    ("select_row_columns", ["u8", "u8", "i8", "i8", "i8"], [2, 1, 1, 1, 1]),
    ("gather_dense_rows", ["f4", "i8", "f8"], [2, 1, 2]),
    ("gather_dense_rows", ["f4", "i8", "i2"], [2, 1, 2]),
    ("gather_dense_rows", ["f4", "i8", "u1"], [2, 1, 2]),
    ("float32_bits_to_bfloat16_bits", ["u2", "u4"], [2, 2]),
    ("float32_bits_to_float16_bits", ["u2", "u4"], [2, 2]),
    ("to_float16_bits", ["u2", "f4"], [2, 2]),
    ("to_float16_bits", ["u2", "f8"], [2, 2]),
    ("to_float16_bits", ["u2", "i4"], [2, 2]),
    ("to_float16_bits", ["u2", "u8"], [2, 2]),
    ("to_float16_bits", ["u2", "b1"], [2, 2]),
    ("copy_segments", ["f4", "f4", "i8", "i8", "i8"], [1] * 5),
    ("copy_segments", ["u1", "u1", "i8", "i8", "i8"], [1] * 5),
    ("copy_segments", ["i8", "i4", "i8", "i8", "i8"], [1] * 5),  # widened as placed
    ("copy_segments", ["i8", "u4", "i8", "i8", "i8"], [1] * 5),
    ("copy_segments", ["f4", "f2", "i8", "i8", "i8"], [1] * 5),
    ("zstd_frame_ends", ["i8", "u1", "i8", "i8", "i8", "i8"], [1] * 6),
    ("remap_run_columns", ["i8", "i4", "i8", "i8", "i8", "i8"], [1] * 6),
    ("remap_run_columns", ["i8", "u4", "i8", "i8", "i8", "i8"], [1] * 6),
    ("remap_run_columns", ["i8", "i8", "i8", "i8", "i8", "i8"], [1] * 6),
    ("keep_panel_rows", ["i8", "i8", "f4", "i4", *["i8"] * 5], [1] * 8 + [0]),
    ("keep_panel_rows", ["i8", "i8", "f8", "u4", *["i8"] * 5], [1] * 8 + [0]),
    # uint8 / uint16 column ids: anndata 0.13 with write_csr_csc_indices_with_min_possible_dtype
    ("densify_csr_scatter", ["f4", "i8", "f4", "u1", "i8"], [2, 1, 1, 1, 1]),
    ("shared", ["f4", "i8", "f4", "u2", "i8"], [2, 1, 1, 1, 1]),
    ("gather_csr_rows", ["f4", "u1", "i8", "u1", "i8", "i8", "f4", "u1", "i8"], _GATHER_NDIMS),
    ("copy_segments", ["i4", "u2", "i8", "i8", "i8"], [1] * 5),  # beside an int32 store
    ("remap_run_columns", ["i8", "u1", "i8", "i8", "i8", "i8"], [1] * 6),
    ("keep_panel_rows", ["i8", "i8", "f4", "u2", *["i8"] * 5], [1] * 8 + [0]),
]  # fmt: skip


@pytest.mark.skipif(not _nvvm_available(), reason="libNVVM not found: cannot compile to PTX")
@pytest.mark.parametrize(("kernel", "dtypes", "ndims"), PTX_CASES)
def test_kernels_compile_for_dali_argument_types(kernel, dtypes, ndims):
    import numba
    from numba import cuda

    from dali_zarr.graph import cuda_kernels as K

    fn = K.make_densify_csr_shared(300) if kernel == "shared" else getattr(K, kernel)
    arrays = K.numba_signature(dtypes, ndims)
    # ndim 0: a scalar (the window-level kernels launched by the reader take some)
    sig = tuple(
        numba.from_dtype(np.dtype(d)) if n == 0 else a
        for a, d, n in zip(arrays, dtypes, ndims, strict=True)
    )
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(8, 0))
    assert ".entry" in ptx or ".visible" in ptx


def test_numba_cuda_compat_mends_what_broke_on_the_gpu_image(monkeypatch):
    """On the H100 image (numba-cuda 0.30.4 on CUDA 13, numpy 2.5.2) no GPU op compiled:
    DALI 2.4's numba plugin lists CUDA 11 and 12 only, and numba-cuda overloads the
    ``np.row_stack`` that numpy 2.5 removed. Both are taken away here whatever this machine
    has, and ``numba_cuda_compat`` must give them back."""
    from numba import cuda
    from nvidia.dali.plugin import numba as dali_numba

    from dali_zarr.graph import cuda_kernels as K

    try:
        major = cuda.runtime.get_version()[0]
    except Exception:
        pytest.skip("no CUDA runtime library: numba cannot tell the toolkit version")
    table = dali_numba.minimal_numba_version
    saved = dict(table)
    others = {k: v for k, v in saved.items() if k != major}
    assert others, "the plugin's table knows no other toolkit to take the minimum from"
    monkeypatch.setattr(np, "row_stack", None, raising=False)  # restored after the test
    monkeypatch.delattr(np, "row_stack")
    try:
        table.pop(major, None)  # a DALI that does not know this toolkit
        assert not dali_numba.NumbaFunction._check_minimal_numba_version(throw=False)
        K.numba_cuda_compat()
        assert dali_numba.NumbaFunction._check_minimal_numba_version(throw=False)
        assert table == {**others, major: others[max(others)]}  # the newest known minimum
        assert np.row_stack is np.vstack
    finally:
        table.clear()
        table.update(saved)


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n_cols", [37, 9000])  # shared-memory and scatter variants
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_gpu_ops_match_cpu_ops(n_cols, index_dtype):
    import torch
    from nvidia.dali import fn, pipeline_def

    from dali_zarr.data.dataset import sub_indptr
    from dali_zarr.graph import cuda_kernels as K
    from dali_zarr.graph import kernels

    rng = np.random.default_rng(0)
    data, indices, indptr = _random_csr(rng, 300, n_cols, np.float32, index_dtype)
    batches = _batches(rng, 300)[:3]

    def source(info):
        pos = batches[info.iteration % len(batches)]
        bptr = sub_indptr(indptr, pos)
        hint = np.empty((int(bptr[-1]), 0), np.uint8)
        return [[a] for a in (pos, data, indices, indptr, hint, bptr)]

    def graph(device):
        pos, d, i, p, hint, bptr = fn.external_source(
            source=source, batch=True, batch_info=True, num_outputs=6
        )
        kw = dict(data_dtype=np.float32, index_dtype=index_dtype)
        if device == "cpu":
            x = kernels.densify_csr(pos, d, i, p, n_features=n_cols, **kw)
            c = kernels.gather_csr(hint, bptr, pos, d, i, p, **kw)
        else:
            g = [n.gpu() for n in (pos, d, i, p, hint, bptr)]
            x = K.densify_csr_gpu(g[0], g[1], g[2], g[3], n_features=n_cols, **kw)
            c = K.gather_csr_gpu(g[4], g[5], g[0], g[1], g[2], g[3], **kw)
        return x, *c

    pipes = [
        pipeline_def(graph, batch_size=1, num_threads=1, device_id=0)(dev) for dev in ("cpu", "gpu")
    ]
    for p in pipes:
        p.build()
    for _ in range(len(batches)):
        cpu_out, gpu_out = (p.run() for p in pipes)
        for a, b in zip(cpu_out, gpu_out, strict=True):
            want = torch.from_dlpack(a[0])
            got = torch.from_dlpack(b[0])
            assert got.is_cuda
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.stdout.write("RESULT " + json.dumps(_worker()) + "\n")


def test_float16_kernels_round_like_numpy_over_float32_bit_patterns():
    """The CPU float16 kernels (float32 bits in integer arithmetic, and any dtype through
    float64) against NumPy's float32 -> float16 over a spread of every bit pattern, the
    subnormal range and the overflow edge, both signs; their CUDA twins run the same lines
    under the simulator above."""
    import numba

    from dali_zarr.graph import kernels

    bits = np.concatenate(
        [
            np.arange(0, 2**31, 997, dtype=np.uint64).astype(np.uint32),
            np.arange(0x32F00000, 0x38900000, 61, dtype=np.uint32),  # around the subnormals
            np.arange(0x477F0000, 0x47810000, dtype=np.uint32),  # around 65504 / 65520
        ]
    )
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)]).reshape(-1, 1)
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    for kernel, arg in (
        (kernels._float32_bits_to_float16_bits, bits),
        (kernels._to_float16_bits, x),
    ):
        got = np.zeros(bits.shape, np.uint16)
        numba.njit(kernel)(got, arg)
        np.testing.assert_array_equal(got[~nan], want[~nan])
        assert ((got[nan] & 0x7FFF) > 0x7C00).all()
