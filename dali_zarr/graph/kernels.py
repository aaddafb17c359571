"""Row gather and CSR densify as DALI operators.

DALI has no CSR-to-dense operator and no row gather that takes the row ids as data, so we
add them through DALI's numba plugin (``numba_function``): the kernels are compiled once
per loader, run inside the DALI graph (on DALI's threads, not the Python callback), and the
same indexing logic has a CUDA twin for the GPU path. The alternatives were worse: a C++
DALI plugin must be compiled against each DALI release, and ``fn.python_function`` runs
Python per sample and holds the GIL.

One DALI sample is one whole minibatch (per-row samples are ~5x slower, see DEVELOPERS.md):
each op takes the window's rows plus ``pos``, the window-local positions of the batch's
rows in their shuffled order, and writes the batch. Reading the window through ``pos`` is
the shuffle: every output row is written once, every stored value read once.

DALI plugin quirk (2.4): ``setup_fn`` only sees the shapes of the first ``len(outputs)``
inputs, so the input that decides an output's shape always comes first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache, lru_cache

import numpy as np
from nvidia.dali import types
from nvidia.dali.plugin.numba import NumbaFunction

_DALI_TYPE = {
    np.dtype(np.float32): types.FLOAT,
    np.dtype(np.float64): types.FLOAT64,
    np.dtype(np.int8): types.INT8,
    np.dtype(np.int16): types.INT16,
    np.dtype(np.int32): types.INT32,
    np.dtype(np.int64): types.INT64,
    np.dtype(np.uint8): types.UINT8,
    np.dtype(np.uint16): types.UINT16,
    np.dtype(np.uint32): types.UINT32,
    np.dtype(np.uint64): types.UINT64,
    np.dtype(np.bool_): types.BOOL,
}


def dali_type(dtype: np.dtype) -> types.DALIDataType:
    """The DALI type of a NumPy dtype (native byte order)."""
    try:
        return _DALI_TYPE[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no DALI equivalent") from None


# --- CPU kernels (numba nopython; called once per minibatch sample) -------------------------


def _densify_csr_rows(out, pos, data, indices, indptr):
    """out[i, :] = dense row pos[i] of the window CSR (duplicate column ids add up, as scipy)."""
    for i in range(pos.shape[0]):
        row = out[i]
        row[:] = 0
        r = pos[i]
        for p in range(indptr[r], indptr[r + 1]):
            j = indices[p]
            if j < row.shape[0]:  # else a panel's dropped column (the GPU reader maps them there)
                row[j] += np.float32(data[p])  # rounded once: int64 + float32 goes via float64


def _gather_csr_rows(
    out_data, out_indices, out_indptr, nnz_hint, batch_indptr, pos, data, indices, indptr
):
    """The batch's own CSR: row pos[i] of the window, from its start ``indptr[pos[i]]``,
    goes to ``[batch_indptr[i], batch_indptr[i + 1])``. The lengths come from
    ``batch_indptr``, so a window whose rows were cut short in place (a gene panel kept on
    the device) is gathered as it is."""
    for i in range(pos.shape[0] + 1):
        out_indptr[i] = batch_indptr[i]
    for i in range(pos.shape[0]):
        src = indptr[pos[i]]
        dst = batch_indptr[i]
        n = batch_indptr[i + 1] - dst
        # two slice copies (memcpy-like), not one loop over both arrays: ~1.5x faster
        out_data[dst : dst + n] = data[src : src + n]
        out_indices[dst : dst + n] = indices[src : src + n]


def _gather_dense_rows(out, pos, values):
    """out[i] = values[pos[i]] on 2-D views (features flattened)."""
    for i in range(pos.shape[0]):
        out[i, :] = values[pos[i], :]


def _select_row_columns(out, values, row_starts, row_maps, maps):
    """Dense stores under gene panels: ``out[r, j] = values[row_starts[r] + maps[row_maps[r]
    + j]]``. ``values`` holds the window's rows as stored (flat: stores may differ in
    width), row ``r``'s from ``row_starts[r]``; its map (its store's panel) lists the
    stored columns it keeps, in panel order. Values are copied as their bits."""
    for r in range(out.shape[0]):
        start = row_starts[r]
        base = row_maps[r]
        for j in range(out.shape[1]):
            out[r, j] = values[start + maps[base + j]]


def _remap_run_columns(indices, run_bounds, run_maps, run_widths, maps):
    """Each run's column ids through its own panel map, in place: the ids of run ``r``
    (elements ``run_bounds[r]`` to ``run_bounds[r + 1]``) become
    ``maps[run_maps[r] + id]``. Returns 0, or 1 + a run holding an id outside
    ``[0, run_widths[r])`` (left unmapped: the caller names the store and fails)."""
    for r in range(run_maps.shape[0]):
        base = run_maps[r]
        width = run_widths[r]
        for p in range(run_bounds[r], run_bounds[r + 1]):
            j = np.int64(indices[p])
            if j < 0 or j >= width:
                return r + 1
            indices[p] = maps[base + j]
    return 0


def _keep_panel_rows(kept, data, indices, indptr, row_maps, row_widths, maps, n_kept):
    """CSR output of gene panels: each row's entries through its map (``maps`` from
    ``row_maps[r]``), the kept ones (panel column below ``n_kept``) moved to the row's
    start in their order, in place; ``kept[r]`` = how many row ``r`` keeps. Returns 0, or 1
    + a row holding an id outside ``[0, row_widths[r])`` (it stops at the bad id, which
    stays where it was)."""
    for r in range(indptr.shape[0] - 1):
        base = row_maps[r]
        width = row_widths[r]
        start = indptr[r]
        w = start
        for p in range(start, indptr[r + 1]):
            j = np.int64(indices[p])
            if j < 0 or j >= width:
                return r + 1
            c = maps[base + j]
            if c < n_kept:
                data[w] = data[p]
                indices[w] = c
                w += 1
        kept[r] = w - start
    return 0


@cache
def host_kernel(fn: Callable) -> Callable:
    """A window-level kernel (:func:`_remap_run_columns`, :func:`_keep_panel_rows`,
    :func:`_select_row_columns`) compiled for the host backend, GIL released, once per
    process: the twins of the CUDA kernels of the same names that the window reader
    launches on the device."""
    import numba

    return numba.njit(nogil=True)(fn)


def _float32_bits_to_bfloat16_bits(out, bits):
    """out = bfloat16 bits of float32 ``bits`` (2-D), round to nearest even, NaN kept quiet.

    The same rounding as the GPU twin (cuda_kernels.float32_bits_to_bfloat16_bits) and as
    torch's ``.to(torch.bfloat16)``.
    """
    sign_off = np.uint32(0x7FFFFFFF)
    inf = np.uint32(0x7F800000)
    quiet = np.uint32(0x40)
    half = np.uint32(0x7FFF)
    one = np.uint32(1)
    shift = np.uint32(16)
    for i in range(bits.shape[0]):
        for c in range(bits.shape[1]):
            u = bits[i, c]
            if (u & sign_off) > inf:
                out[i, c] = np.uint16((u >> shift) | quiet)
            else:
                out[i, c] = np.uint16((u + half + ((u >> shift) & one)) >> shift)


def _float32_bits_to_float16_bits(out, bits):
    """out = float16 bits of float32 ``bits`` (2-D uint32), rounded to nearest even in
    integer arithmetic: the path of every dense X and of float32 CSR values, about as fast
    as a cast (the float64 arithmetic of :func:`_to_float16_bits` is ~10x slower). Same
    results, and the same as NumPy's and torch's float32 -> float16."""
    for i in range(bits.shape[0]):
        for c in range(bits.shape[1]):
            u = np.uint32(bits[i, c])
            sign = (u >> np.uint32(16)) & np.uint32(0x8000)
            a = u & np.uint32(0x7FFFFFFF)
            if a > np.uint32(0x7F800000):  # NaN: quiet
                h = np.uint32(0x7E00)
            elif a >= np.uint32(0x477FF000):  # 65520 (halfway past 65504) and up: inf
                h = np.uint32(0x7C00)
            elif a >= np.uint32(0x38800000):  # 2**-14 and up: normal; drop 13 bits, rebias
                odd = (a >> np.uint32(13)) & np.uint32(1)
                h = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + odd) >> np.uint32(13)
            elif a > np.uint32(0x33000000):  # (2**-25, 2**-14): subnormal, steps of 2**-24
                shift = np.uint32(126) - (a >> np.uint32(23))  # 14 .. 24
                m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
                h = m >> shift
                rest = m & ((np.uint32(1) << shift) - np.uint32(1))
                half = np.uint32(1) << (shift - np.uint32(1))
                if rest > half or (rest == half and (h & np.uint32(1)) == np.uint32(1)):
                    h += np.uint32(1)
            else:  # up to 2**-25 (a tie, to the even 0): zero
                h = np.uint32(0)
            out[i, c] = np.uint16(sign | h)


def _to_float16_bits(out, x):
    """out = float16 bits of ``x`` (2-D, any real dtype), one rounding to nearest even from
    the value itself, NaN kept quiet with its sign: NumPy's ``astype(float16)``, and torch's
    ``.half()`` of float32 values (torch narrows float64 through float32, rounding twice).

    Not DALI's ``fn.cast``: on the CPU it rounds halves away from zero (2049 → 2050, where
    torch and DALI's GPU cast give 2048) and narrows float64 through float32, so the two
    loader paths would differ. The CUDA twin
    (cuda_kernels.to_float16_bits) is the same arithmetic: float64, ``frexp``, and a
    round-half-to-even of a value with at most 53 significant bits, all exact.
    """
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            v = x[i, c] * 1.0
            bits = 0x8000 if math.copysign(1.0, v) < 0 else 0
            a = abs(v)
            if a != a:
                bits |= 0x7E00
            elif a >= 65520.0:  # halfway past float16's largest (65504) and beyond: inf
                bits |= 0x7C00
            else:
                if a < 6.103515625e-05:  # below 2**-14: subnormal, steps of 2**-24
                    y = a * 16777216.0
                    base = 0
                else:  # [2**(e-1), 2**e): 11 significant bits, the leading one implicit
                    m, e = math.frexp(a)
                    y = m * 2048.0
                    base = ((e + 14) << 10) - 1024
                q = np.int64(math.floor(y))
                rest = y - q
                if rest > 0.5 or (rest == 0.5 and q % 2 == 1):
                    q += 1
                bits |= base + q  # a carry into the exponent is the right next value
            out[i, c] = np.uint16(bits)


def _cf_decode(out, x, params):
    """out = float32 ``x`` (2-D) decoded as ``params`` say (float32: ``scale``, ``offset``,
    then the fills; see elements.CfDecoding, whose ``_Unsigned`` reading the gather has
    done): one pass over the batch, where the GPU path's DALI arithmetic takes several
    (each a pass of its own: ~7x the time of this kernel on the CPU). The same float32
    operations in the same order, so both paths give the same values: a scale of 1 and an
    offset of 0 are not applied (x + 0 would make -0 +0). Branches on the parameters are
    taken out of the loop, and the first two fills are locals (NaN, never equal, where
    there are fewer): ~4x faster than a loop over them."""
    scale, offset = np.float32(params[0]), np.float32(params[1])
    scaled, offset_added = scale != np.float32(1.0), offset != np.float32(0.0)
    nan = np.float32(np.nan)
    n_fills = params.shape[0] - 2
    fill0 = params[2] if n_fills > 0 else nan
    fill1 = params[3] if n_fills > 1 else nan
    for i in range(x.shape[0]):
        row, out_row = x[i], out[i]
        for c in range(x.shape[1]):
            v = row[c]
            missing = (v == fill0) | (v == fill1)
            for k in range(4, params.shape[0]):
                missing |= v == params[k]
            if scaled:
                v = v * scale
            if offset_added:
                v = v + offset
            out_row[c] = nan if missing else v


# --- setup functions: output shapes from input shapes ---------------------------------------


def _rows_by_width(width: int) -> Callable:
    """Output (len(pos), width): ``width`` is baked in as a compile-time constant."""

    def setup(outs, ins):
        for s in range(len(outs[0])):
            outs[0][s][0] = ins[0][s][0]
            outs[0][s][1] = width

    return setup


def _same_shape_2d(outs, ins):
    """Output shaped like the (2-D) input: elementwise ops whatever a transform did to X."""
    for s in range(len(outs[0])):
        outs[0][s][0] = ins[0][s][0]
        outs[0][s][1] = ins[0][s][1]


def _csr_batch_shapes(outs, ins):
    """data/indices: nnz from ``nnz_hint`` (nnz, 0); indptr: len(batch_indptr) (both ops)."""
    for s in range(len(outs[0])):
        outs[0][s][0] = ins[0][s][0]
        outs[1][s][0] = ins[0][s][0]
        outs[2][s][0] = ins[1][s][0]


# --- graph builders ---------------------------------------------------------------------------


#: kernel name -> (run function, setup function for a row width)
_KERNELS: dict[str, tuple[Callable, Callable[[int], Callable]]] = {
    "densify_csr": (_densify_csr_rows, _rows_by_width),
    "gather_csr": (_gather_csr_rows, lambda _width: _csr_batch_shapes),
    "gather_dense": (_gather_dense_rows, _rows_by_width),
    "to_bfloat16_bits": (_float32_bits_to_bfloat16_bits, lambda _width: _same_shape_2d),
    "to_float16_bits": (_to_float16_bits, lambda _width: _same_shape_2d),
    "float32_to_float16_bits": (_float32_bits_to_float16_bits, lambda _width: _same_shape_2d),
    "cf_decode": (_cf_decode, lambda _width: _same_shape_2d),
}


@lru_cache(maxsize=64)
def _numba_op(
    kernel: str,
    width: int | None,
    out_types: tuple,
    in_types: tuple,
    outs_ndim: tuple[int, ...],
    ins_ndim: tuple[int, ...],
) -> NumbaFunction:
    """One compiled DALI numba op per signature and process.

    Compiling an op takes seconds (numba builds C callbacks for DALI); the instance can be
    called in any number of pipelines, so later loaders of the same shape start at once.
    """
    run_fn, setup_for_width = _KERNELS[kernel]
    return NumbaFunction(
        run_fn=run_fn,
        setup_fn=setup_for_width(int(width or 0)),
        out_types=list(out_types),
        in_types=list(in_types),
        outs_ndim=list(outs_ndim),
        ins_ndim=list(ins_ndim),
        device="cpu",
    )


def densify_csr(pos, data, indices, indptr, *, n_features: int, data_dtype, index_dtype):
    """DALI op: dense float32 ``(len(pos), n_features)`` batch from window CSR + positions
    (ids at ``n_features`` or past it are a panel's dropped columns and are skipped)."""
    op = _numba_op(
        "densify_csr",
        n_features,
        (types.FLOAT,),
        (types.INT64, dali_type(data_dtype), dali_type(index_dtype), types.INT64),
        (2,),
        (1, 1, 1, 1),
    )
    return op(pos, data, indices, indptr)


def gather_csr(nnz_hint, batch_indptr, pos, data, indices, indptr, *, data_dtype, index_dtype):
    """DALI op: the batch's (data, indices, indptr) from window CSR + positions + the batch's
    row starts (computed by the callback, which must know the batch's nnz anyway)."""
    data_t, index_t = dali_type(data_dtype), dali_type(index_dtype)
    op = _numba_op(
        "gather_csr",
        None,
        (data_t, index_t, types.INT64),
        (types.UINT8, types.INT64, types.INT64, data_t, index_t, types.INT64),
        (1, 1, 1),
        (2, 1, 1, 1, 1, 1),
    )
    return op(nnz_hint, batch_indptr, pos, data, indices, indptr)


def gather_dense(pos, values, *, n_features: int, dtype):
    """DALI op: rows ``pos`` of a window given as a 2-D ``(rows, n_features)`` view."""
    wire = dali_type(dtype)
    op = _numba_op("gather_dense", n_features, (wire,), (types.INT64, wire), (2,), (1, 2))
    return op(pos, values)


def to_bfloat16_bits(bits):
    """DALI op: uint16 bfloat16 bits of a 2-D float32 batch given as uint32 (``fn.reinterpret``).

    DALI has no bfloat16 type: the bits leave DALI as uint16 and the framework adapter views
    them as bfloat16 (no copy).
    """
    op = _numba_op("to_bfloat16_bits", None, (types.UINT16,), (types.UINT32,), (2,), (2,))
    return op(bits)


def cf_decode(x, params):
    """DALI op: 2-D float32 ``x`` decoded by ``params`` (a 1-D float32 node: scale,
    offset, fills...; see :func:`_cf_decode`)."""
    op = _numba_op("cf_decode", None, (types.FLOAT,), (types.FLOAT, types.FLOAT), (2,), (2, 1))
    return op(x, params)


def float32_bits_to_float16_bits(bits):
    """DALI op: uint16 float16 bits of a 2-D float32 batch given as uint32 (``fn.reinterpret``),
    rounded as :func:`to_float16_bits` rounds, in integer arithmetic."""
    op = _numba_op("float32_to_float16_bits", None, (types.UINT16,), (types.UINT32,), (2,), (2,))
    return op(bits)


def to_float16_bits(x, *, dtype):
    """DALI op: uint16 float16 bits of a 2-D batch of ``dtype`` values, rounded once to
    nearest even (:func:`_to_float16_bits`); ``fn.reinterpret`` makes them float16."""
    op = _numba_op("to_float16_bits", None, (types.UINT16,), (dali_type(dtype),), (2,), (2,))
    return op(x)
