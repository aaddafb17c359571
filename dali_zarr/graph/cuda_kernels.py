"""GPU twins of the row-gather and CSR-densify ops (numba.cuda kernels run by DALI's numba plugin).

Same contract as :mod:`dali_zarr.graph.kernels`: one DALI sample is one whole minibatch; each
op reads the window through ``pos`` (window-local positions of the batch rows, shuffled) and
writes the batch, so the shuffle costs nothing extra. Every op is **one kernel launch per
minibatch**, never one per row.

How DALI runs them: ``numba_function(device="gpu")`` compiles ``run_fn`` (a plain Python
function, *not* ``@cuda.jit``) with ``numba.cuda`` for the arguments ``(*outputs, *inputs)``
as C-contiguous arrays, and launches it once per sample with the **static** ``blocks`` /
``threads_per_block`` given at graph build time. Batch sizes vary (last partial batch), so
every kernel uses grid-stride loops: block ``b`` handles output rows ``b, b + gridDim, ...``
and its threads stride over that row's columns or non-zeros. The output shapes come from the
same CPU ``setup_fn`` as the CPU ops (DALI quirk: it sees only the first ``len(outputs)``
inputs, so the shape-deciding inputs come first).

CSR → dense (:func:`densify_csr_gpu`), two variants chosen by the feature count:

* ``n_features <= SHARED_COLS`` (8192 float32 = 32 KiB of shared memory): the block zeroes a
  shared-memory copy of the row, scatters the row's non-zeros into it with shared-memory
  atomics, then writes the row to global memory with coalesced stores. Each non-zero is read
  once and each output element written **once** to global memory.
* wider rows: the block zero-fills its output row in global memory (coalesced), syncs, then
  scatters the non-zeros with global atomics. Trade-off: the non-zero positions are written
  twice (zero, then value), but the second write lands on lines the same block wrote
  microseconds earlier, so it is served by L2 and DRAM traffic stays ~one write per element;
  the alternative (shared-memory column tiles) re-reads the row's column ids once per tile,
  which costs more than it saves for realistic densities (a 62k-gene row is 8 tiles).

Duplicate column ids in a row add up in both variants (atomics), as in the CPU kernel and
scipy; their summation order is not fixed, so float sums of duplicates may differ in the
last bit from the CPU path (integer-valued counts are exact).

CSR gather (:func:`gather_csr_gpu`) needs each output row's start, a prefix sum of the batch
rows' lengths. The callback computes it on the host (``batch_indptr``, B+1 int64) because the
host must know the batch's nnz anyway (DALI sizes outputs from shapes before the kernel runs;
that is what ``nnz_hint`` carries) and it already holds the window's indptr: a cumsum of B
values costs microseconds and avoids a device scan (a single-block scan would serialise the
prefix over one SM; a multi-block scan is 2-3 extra launches). The kernel then copies each
row's run of data/indices to its slot, one block per row, and copies ``batch_indptr`` out.
A row's length is taken from ``batch_indptr``, its start from the window's ``indptr``: a
window whose rows were cut to a gene panel in place (:func:`keep_panel_rows`, the callback
then sizes batches by the kept lengths) is gathered with no extra pass. The CPU op has the
same contract.

Dense gather (:func:`gather_dense_gpu`) copies rows ``pos`` with coalesced loads/stores and
casts to the output dtype in the same pass (float32 by default), so there is no separate
cast launch.

Gene panels (a feature selection). CSR stores: the window reader (not DALI) maps each
store's column ids to the panel once per window, one launch: :func:`remap_run_columns`
sends dropped columns to the panel's width, which both densify variants skip; for CSR
output, :func:`keep_panel_rows` also moves each row's kept entries to its start. Dense
stores: :func:`select_row_columns` copies each row's panel columns out of the stored
window, also once per window, and the graph gathers the panel-wide rows. For both layouts
one mechanism serves one panel and panels that differ per store.

Half outputs: DALI's numba plugin refuses float16 and DALI 2.4 has no bfloat16 type.
:func:`float32_bits_to_float16_bits_gpu` (float32 batches, integer arithmetic),
:func:`to_float16_bits_gpu` (other dtypes, through float64) and :func:`to_bfloat16_bits_gpu`
round to nearest even and write the bits as uint16: float16 is then ``fn.reinterpret``-ed
(no copy), bfloat16 viewed by the framework (no copy). Each is one extra launch per
minibatch. float16 is ours rather than DALI's ``fn.cast`` so that the CPU path, whose cast
rounds otherwise, gives the same values (the CPU twins are the same arithmetic).

Nothing here needs a GPU at import time: ``numba.cuda`` imports without a driver; kernels
are compiled when a pipeline is built on a device. The same functions run under the numba
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how CI tests them (tests/
test_cuda_kernels.py), and compile to PTX without a GPU where libNVVM is installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numba
import numpy as np
from numba import cuda
from nvidia.dali import types
from nvidia.dali.plugin.numba.fn.experimental import numba_function

from dali_zarr.graph.kernels import _csr_batch_shapes, _rows_by_width, _same_shape_2d, dali_type

#: widest row (in float32 elements) densified through shared memory (32 KiB per block).
SHARED_COLS = 8192
#: default launch shape: blocks (grid-stride over rows) and threads per block.
DEFAULT_BLOCKS = 1024
DEFAULT_THREADS = 256

_f32 = numba.float32


# --- kernels (plain functions: DALI compiles them with numba.cuda; tests wrap them in cuda.jit)


def densify_csr_scatter(out, pos, data, indices, indptr):
    """out[i, :] = dense row pos[i]: zero-fill the row, sync, scatter with global atomics.
    Ids at or past the width are skipped: a gene panel's dropped columns (the window
    reader maps them there; every other id was checked against the width)."""
    width = out.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        for c in range(t, width, nt):
            out[i, c] = 0
        cuda.syncthreads()  # the block's zeros are visible to its own threads after this
        r = pos[i]
        for p in range(indptr[r] + t, indptr[r + 1], nt):
            j = indices[p]
            if j < width:
                cuda.atomic.add(out, (i, j), _f32(data[p]))


def make_densify_csr_shared(width: int) -> Callable:
    """The shared-memory variant for rows of ``width <= SHARED_COLS`` (a compile-time size)."""
    if not 0 < width <= SHARED_COLS:
        raise ValueError(f"width {width} is not in (0, {SHARED_COLS}]")

    def densify_csr_shared(out, pos, data, indices, indptr):
        """out[i, :] = dense row pos[i], built in shared memory, stored once."""
        row = cuda.shared.array(width, numba.float32)
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        for i in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
            for c in range(t, width, nt):
                row[c] = 0
            cuda.syncthreads()
            r = pos[i]
            for p in range(indptr[r] + t, indptr[r + 1], nt):
                j = indices[p]
                if j < width:  # a panel's dropped column (see densify_csr_scatter)
                    cuda.atomic.add(row, j, _f32(data[p]))
            cuda.syncthreads()
            for c in range(t, width, nt):
                out[i, c] = row[c]
            cuda.syncthreads()  # before the next row reuses `row`

    return densify_csr_shared


def gather_csr_rows(
    out_data, out_indices, out_indptr, nnz_hint, batch_indptr, pos, data, indices, indptr
):
    """The batch's CSR: row pos[i] of the window, from its start ``indptr[pos[i]]``, goes
    to [batch_indptr[i], batch_indptr[i+1]) (lengths from ``batch_indptr``: rows cut short
    in place by a gene panel are gathered as they are)."""
    n = pos.shape[0]
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for k in range(g, n + 1, cuda.gridDim.x * cuda.blockDim.x):
        out_indptr[k] = batch_indptr[k]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, n, cuda.gridDim.x):
        src = indptr[pos[i]]
        dst = batch_indptr[i]
        for k in range(t, batch_indptr[i + 1] - dst, nt):
            out_data[dst + k] = data[src + k]
            out_indices[dst + k] = indices[src + k]


def gather_dense_rows(out, pos, values):
    """out[i] = values[pos[i]] (2-D views; the store to ``out`` casts to its dtype)."""
    width = out.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        r = pos[i]
        for c in range(t, width, nt):
            out[i, c] = values[r, c]


def float32_bits_to_bfloat16_bits(out, bits):
    """out = bfloat16 bits (round to nearest even, NaN kept quiet) of float32 ``bits`` (2-D).

    Elementwise, so one grid-stride loop over all elements: a CSR batch's values come as
    one column (``(nnz, 1)``), which a loop of blocks over rows and threads over columns
    would leave to one thread per block."""
    width = out.shape[1]
    for k in range(cuda.grid(1), out.shape[0] * width, cuda.gridsize(1)):
        i = k // width
        c = k - i * width
        u = numba.uint32(bits[i, c])
        if (u & numba.uint32(0x7FFFFFFF)) > numba.uint32(0x7F800000):
            out[i, c] = numba.uint16((u >> numba.uint32(16)) | numba.uint32(0x40))
        else:
            lsb = (u >> numba.uint32(16)) & numba.uint32(1)
            out[i, c] = numba.uint16((u + numba.uint32(0x7FFF) + lsb) >> numba.uint32(16))


def float32_bits_to_float16_bits(out, bits):
    """out = float16 bits of float32 ``bits`` (2-D uint32), rounded to nearest even in integer
    arithmetic: the twin of kernels._float32_bits_to_float16_bits, one grid-stride loop over
    all elements."""
    width = out.shape[1]
    for k in range(cuda.grid(1), out.shape[0] * width, cuda.gridsize(1)):
        i = k // width
        c = k - i * width
        u = numba.uint32(bits[i, c])
        sign = (u >> numba.uint32(16)) & numba.uint32(0x8000)
        a = u & numba.uint32(0x7FFFFFFF)
        if a > numba.uint32(0x7F800000):
            h = numba.uint32(0x7E00)
        elif a >= numba.uint32(0x477FF000):
            h = numba.uint32(0x7C00)
        elif a >= numba.uint32(0x38800000):
            odd = (a >> numba.uint32(13)) & numba.uint32(1)
            h = (a - numba.uint32(0x38000000) + numba.uint32(0xFFF) + odd) >> numba.uint32(13)
        elif a > numba.uint32(0x33000000):
            shift = numba.uint32(126) - (a >> numba.uint32(23))
            m = (a & numba.uint32(0x7FFFFF)) | numba.uint32(0x800000)
            h = m >> shift
            rest = m & ((numba.uint32(1) << shift) - numba.uint32(1))
            half = numba.uint32(1) << (shift - numba.uint32(1))
            if rest > half or (rest == half and (h & numba.uint32(1)) == numba.uint32(1)):
                h += numba.uint32(1)
        else:
            h = numba.uint32(0)
        out[i, c] = numba.uint16(sign | h)


def to_float16_bits(out, x):
    """out = float16 bits of ``x`` (2-D, any real dtype), rounded once to nearest even:
    the arithmetic of the CPU twin (kernels._to_float16_bits), so both paths give the same
    bits; one grid-stride loop over all elements, as above."""
    width = out.shape[1]
    for k in range(cuda.grid(1), out.shape[0] * width, cuda.gridsize(1)):
        i = k // width
        c = k - i * width
        v = x[i, c] * 1.0
        bits = 0x8000 if math.copysign(1.0, v) < 0 else 0
        a = abs(v)
        if a != a:
            bits |= 0x7E00
        elif a >= 65520.0:
            bits |= 0x7C00
        else:
            if a < 6.103515625e-05:
                y = a * 16777216.0
                base = 0
            else:
                m, e = math.frexp(a)
                y = m * 2048.0
                base = ((e + 14) << 10) - 1024
            q = numba.int64(math.floor(y))  # int(): compiling it needs a driver
            rest = y - q
            if rest > 0.5 or (rest == 0.5 and q % 2 == 1):
                q += 1
            bits |= base + q
        out[i, c] = numba.uint16(bits)


def copy_segments(out, src, seg_src, seg_dst, seg_len):
    """out[seg_dst[s] : +seg_len[s]] = src[seg_src[s] : +seg_len[s]] for every segment s.

    Used by the GPU read path (dali_zarr.io.gpu) to assemble a window's rows from decoded
    chunks in one launch; 1-D arrays of one dtype, offsets in elements.
    """
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for s in range(cuda.blockIdx.x, seg_len.shape[0], cuda.gridDim.x):
        a = seg_src[s]
        b = seg_dst[s]
        for k in range(t, seg_len[s], nt):
            out[b + k] = src[a + k]


def zstd_frame_ends(ends, staging, starts, nbytes, first_block, checksum):
    """Where each zstd frame ends by its block headers, in bytes from its start (twin of
    ``dali_zarr.io.codecs.zstd_frame_ends``, which walks on the host).

    One thread a frame follows its 3-byte block headers from ``first_block`` (raw blocks
    store their size, RLE blocks one byte, compressed blocks their size) to the last block,
    then adds ``checksum`` (0 or 4 bytes); -1 where the stored ``nbytes`` end first or a
    block is of the reserved type. The GPU executor checks these ends against the stored
    sizes before nvCOMP decodes anything: one launch and one copy back a window, where the
    host walk took a round trip per block.
    """
    for f in range(cuda.grid(1), starts.shape[0], cuda.gridsize(1)):
        base = starts[f]
        n = nbytes[f]
        pos = first_block[f]
        end = -1
        while pos + 3 <= n:
            at = base + pos
            header = (
                numba.int64(staging[at])
                | (numba.int64(staging[at + 1]) << 8)
                | (numba.int64(staging[at + 2]) << 16)
            )
            kind = (header >> 1) & 3
            if kind == 3:  # reserved: not a block
                break
            pos += 3 + (1 if kind == 1 else header >> 3)
            if header & 1:  # the last block
                end = pos + checksum[f]
                break
        ends[f] = end


def remap_run_columns(bad, indices, run_bounds, run_maps, run_widths, maps):
    """Each run's column ids through its own panel map, in place (a collection of gene
    panels that keep different stored columns; twin of ``kernels._remap_run_columns``).

    One launch per window; threads stride over the window's ids and find their run by a
    binary search of ``run_bounds`` (a window has tens of runs). An id outside
    ``[0, run_widths[r])`` is left as is and ``bad[0]`` becomes at least ``1 + r``.
    """
    n_runs = run_maps.shape[0]
    for p in range(cuda.grid(1), run_bounds[n_runs], cuda.gridsize(1)):
        lo = 0
        hi = n_runs - 1
        while lo < hi:  # the last run starting at or before p: empty runs are passed over
            mid = (lo + hi + 1) // 2
            if run_bounds[mid] <= p:
                lo = mid
            else:
                hi = mid - 1
        j = numba.int64(indices[p])
        if j < 0 or j >= run_widths[lo]:
            cuda.atomic.max(bad, 0, lo + 1)
        else:
            indices[p] = maps[run_maps[lo] + j]


#: threads a :func:`keep_panel_rows` block may have (the size of its shared scan array)
KEEP_MAX_THREADS = 1024


def keep_panel_rows(kept, bad, data, indices, indptr, row_maps, row_widths, maps, n_kept):
    """CSR output of gene panels, in place (twin of ``kernels._keep_panel_rows``): each row's
    ids go through its map (``maps`` from ``row_maps[r]``) and the kept entries move, in
    order, to the row's start; ``kept[r]`` counts them. An id outside ``[0,
    row_widths[r])`` stops its row before the tile that holds it is written (so the bad id
    stays where it is) and makes ``bad[0]`` at least ``1 + r``.

    One launch per window, a block per row (grid-stride). The block walks its row in tiles
    of ``blockDim`` entries: each thread maps one entry, and an inclusive scan of the
    tile's keep flags in shared memory gives each kept entry its place after the kept
    entries before it. So a warp's loads and stores are coalesced and each entry is read
    and written once. In place is safe: a tile is read into registers before any of it is
    written, and an entry never moves past its own position.
    """
    flags = cuda.shared.array(KEEP_MAX_THREADS, numba.int32)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for r in range(cuda.blockIdx.x, indptr.shape[0] - 1, cuda.gridDim.x):
        base = row_maps[r]
        width = row_widths[r]
        start = indptr[r]
        end = indptr[r + 1]
        w = start
        for tile in range(start, end, nt):
            p = tile + t
            keep = 0
            wrong = 0
            c = numba.int64(0)
            value = data[tile]
            if p < end:
                j = numba.int64(indices[p])
                if j < 0 or j >= width:
                    wrong = 1
                    cuda.atomic.max(bad, 0, r + 1)
                else:
                    c = maps[base + j]
                    if c < n_kept:
                        keep = 1
                        value = data[p]
            if cuda.syncthreads_or(wrong):
                break  # every thread of the block: nothing of this tile is written
            flags[t] = keep
            cuda.syncthreads()
            step = 1
            while step < nt:  # Hillis-Steele: flags[t] becomes the kept count up to t
                add = flags[t - step] if t >= step else 0
                cuda.syncthreads()
                flags[t] += add
                cuda.syncthreads()
                step *= 2
            if keep:
                at = w + flags[t] - 1
                data[at] = value
                indices[at] = c
            w += flags[nt - 1]
            cuda.syncthreads()  # the next tile reuses flags
        if t == 0:
            kept[r] = w - start


def select_row_columns(out, values, row_starts, row_maps, maps):
    """Dense stores under gene panels (twin of ``kernels._select_row_columns``): row ``r``
    keeps the stored columns ``maps[row_maps[r] :][: out.shape[1]]`` of its stored row,
    which starts at ``values[row_starts[r]]`` (flat: stores may differ in width), in panel
    order, as their bits. One launch per window, a block per row (grid-stride); its
    threads stride over the panel's columns, so the writes are coalesced."""
    width = out.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for r in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        start = row_starts[r]
        base = row_maps[r]
        for j in range(t, width, nt):
            out[r, j] = values[start + maps[base + j]]


def densify_kernel(n_features: int) -> Callable:
    """The densify variant :func:`densify_csr_gpu` uses for rows of ``n_features``.

    A store of no features takes the scatter variant, which loops over ``out.shape[1]``:
    the shared one needs a width of at least 1 and would store that column into a
    ``(B, 0)`` batch (past its end)."""
    if 0 < n_features <= SHARED_COLS:
        return make_densify_csr_shared(n_features)
    return densify_csr_scatter


# --- setup functions (CPU, compiled by the plugin with njit) -----------------------------------


# --- graph builders (device="gpu"; every input must be a GPU DataNode) -------------------------


def _launch(blocks: int, threads: int) -> dict:
    if blocks < 1 or threads < 1 or threads > 1024:
        raise ValueError(
            f"blocks={blocks}, threads={threads}: need blocks >= 1, 1 <= threads <= 1024"
        )
    return {"blocks": [int(blocks), 1, 1], "threads_per_block": [int(threads), 1, 1]}


def numba_cuda_compat() -> None:
    """Make numba-cuda and DALI's numba plugin work with what current GPU images ship.

    * numba-cuda 0.30 registers an overload for ``np.row_stack`` while its CUDA typing
      context loads, and numpy 2.5 removed that alias: every first compile raised
      ``AttributeError``. The alias is restored (as ``np.vstack``) before compiling.
    * DALI 2.4's plugin keeps a table of the minimum numba per CUDA toolkit major (11 and
      12) and refuses any other major before compiling. numba-cuda on a CUDA 13 toolkit
      compiles and loads these kernels fine (checked on an H100), so a missing major gets the
      newest entry's minimum.
    """
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    from nvidia.dali.plugin import numba as dali_numba

    table = getattr(dali_numba, "minimal_numba_version", None)
    if not isinstance(table, dict) or not table:
        return
    try:
        major = cuda.runtime.get_version()[0]
    except Exception:  # no CUDA runtime: DALI's own check will say so
        return
    table.setdefault(major, table[max(table)])


def _gpu_op(*inputs, blocks: int, threads: int, **kwargs):
    """``numba_function(device="gpu")`` with a validated launch shape."""
    launch = _launch(blocks, threads)
    numba_cuda_compat()
    return numba_function(*inputs, device="gpu", **launch, **kwargs)


def densify_csr_gpu(
    pos,
    data,
    indices,
    indptr,
    *,
    n_features: int,
    data_dtype,
    index_dtype,
    blocks: int = DEFAULT_BLOCKS,
    threads: int = DEFAULT_THREADS,
):
    """GPU op: dense float32 ``(len(pos), n_features)`` batch from window CSR + positions
    (ids at ``n_features`` or past it are a panel's dropped columns and are skipped)."""
    return _gpu_op(
        pos,
        data,
        indices,
        indptr,
        run_fn=densify_kernel(n_features),
        setup_fn=_rows_by_width(n_features),
        out_types=[types.FLOAT],
        in_types=[types.INT64, dali_type(data_dtype), dali_type(index_dtype), types.INT64],
        outs_ndim=[2],
        ins_ndim=[1, 1, 1, 1],
        blocks=blocks,
        threads=threads,
    )


def gather_csr_gpu(
    nnz_hint,
    batch_indptr,
    pos,
    data,
    indices,
    indptr,
    *,
    data_dtype,
    index_dtype,
    blocks: int = DEFAULT_BLOCKS,
    threads: int = DEFAULT_THREADS,
):
    """GPU op: the batch's (data, indices, indptr) from window CSR + positions + batch indptr."""
    return _gpu_op(
        nnz_hint,
        batch_indptr,
        pos,
        data,
        indices,
        indptr,
        run_fn=gather_csr_rows,
        setup_fn=_csr_batch_shapes,
        out_types=[dali_type(data_dtype), dali_type(index_dtype), types.INT64],
        in_types=[
            types.UINT8,
            types.INT64,
            types.INT64,
            dali_type(data_dtype),
            dali_type(index_dtype),
            types.INT64,
        ],
        outs_ndim=[1, 1, 1],
        ins_ndim=[2, 1, 1, 1, 1, 1],
        blocks=blocks,
        threads=threads,
    )


def gather_dense_gpu(
    pos,
    values,
    *,
    n_features: int,
    dtype,
    out_dtype=np.float32,
    blocks: int = DEFAULT_BLOCKS,
    threads: int = DEFAULT_THREADS,
):
    """GPU op: rows ``pos`` of a 2-D ``(rows, n_features)`` window, cast to ``out_dtype``."""
    return _gpu_op(
        pos,
        values,
        run_fn=gather_dense_rows,
        setup_fn=_rows_by_width(n_features),
        out_types=[dali_type(out_dtype)],
        in_types=[types.INT64, dali_type(dtype)],
        outs_ndim=[2],
        ins_ndim=[1, 2],
        blocks=blocks,
        threads=threads,
    )


def _elementwise_half_op(x, run_fn, in_type, *, blocks: int, threads: int):
    """A half-conversion op: uint16 bits shaped like the 2-D input, one launch a batch."""
    return _gpu_op(
        x,
        run_fn=run_fn,
        setup_fn=_same_shape_2d,
        out_types=[types.UINT16],
        in_types=[in_type],
        outs_ndim=[2],
        ins_ndim=[2],
        blocks=blocks,
        threads=threads,
    )


def float32_bits_to_float16_bits_gpu(
    x_bits, *, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS
):
    """GPU op: uint16 float16 bits of a 2-D float32 batch given as uint32."""
    return _elementwise_half_op(
        x_bits, float32_bits_to_float16_bits, types.UINT32, blocks=blocks, threads=threads
    )


def to_float16_bits_gpu(x, *, dtype, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS):
    """GPU op: uint16 float16 bits of a 2-D batch of ``dtype`` values (rounded once)."""
    return _elementwise_half_op(
        x, to_float16_bits, dali_type(dtype), blocks=blocks, threads=threads
    )


def to_bfloat16_bits_gpu(x_bits, *, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS):
    """GPU op: uint16 bfloat16 bits of a 2-D float32 batch given as uint32 (``fn.reinterpret``)."""
    return _elementwise_half_op(
        x_bits, float32_bits_to_bfloat16_bits, types.UINT32, blocks=blocks, threads=threads
    )


# --- helpers for running the kernels outside DALI (GPU read path, tests) -----------------------


def numba_signature(dtypes: Sequence[np.dtype], ndims: Sequence[int]) -> tuple:
    """The argument types DALI compiles ``run_fn`` for: C-contiguous arrays."""
    return tuple(
        numba.types.Array(numba.from_dtype(np.dtype(d)), int(n), "C")
        for d, n in zip(dtypes, ndims, strict=True)
    )
