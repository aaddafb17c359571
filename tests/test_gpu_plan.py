"""The GPU read backend's byte plan, run by its CPU executor, against DirectReader.read_rows.

`plan_rows` + `execute_plan_cpu` do on the host exactly what the GPU executor does on the
device (same byte ranges, same staging/chunk-buffer offsets, raw zstd frames and bare LZ4
blocks, the same copy segments), so a wrong offset, a wrong lz4 header strip or a wrong
segment shows up here without a GPU. Tests marked ``gpu`` run the real executor (kvikio +
nvCOMP) and skip where CUDA is absent.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import types
import zlib
from dataclasses import replace

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec

from dali_zarr.errors import ChunkReadError
from dali_zarr.io import DirectReader, open_reader
from dali_zarr.io.codecs import (
    FRAME_HEAD_NBYTES,
    _zstd_content_size,
    frame_problems,
    zstd_block_walk_limit,
    zstd_content_sizes,
    zstd_frame_ends,
    zstd_walk_from,
)
from dali_zarr.io.gpu import (
    GPU_KINDS,
    NotPlannable,
    StoreReaders,
    copy_segments_cpu,
    execute_plan_cpu,
    files_changed,
    gpu_codec_kind,
    place_plan,
    plan_rows,
    probe_gpu,
    split_segments,
    window_plans,
)
from dali_zarr.io.nvcomp_batched import call_slices
from dali_zarr.io.readers import FILE_STAMP, stamp_of
from dali_zarr.planning.partition import run_offsets
from tests.stores import (
    compressors,
    has_cuda,
    make_data,
    needs_cuda,
    raised_by_a_read_of,
    random_ranges,
    same_size_shards,
    write,
    write_layout,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


KIND_OF = {"zstd": "zstd", "lz4": "lz4", "none": "none", "blosc": "host", "gzip": "host"}
KIND_OF["zstd-crc32c"] = "host"

SHAPES = {
    # name: (shape, dtype, chunks, shards)
    "1d-float32": ((1037,), "float32", (64,), (256,)),
    "1d-int32": ((1001,), "int32", (50,), (200,)),  # 200-byte chunks: slots are padded
    "1d-int64": ((777,), "int64", (32,), (128,)),
    "3d-rowchunks": ((93, 4, 5), "float32", (8, 4, 5), (32, 4, 5)),
}


CASES = [
    (fmt, codec, shape, sharded)
    for fmt in (2, 3)
    for codec in ("zstd", "lz4", "blosc", "none", "gzip")
    for shape in SHAPES
    for sharded in ((False, True) if fmt == 3 else (False,))
] + [(3, "zstd-crc32c", "1d-float32", s) for s in (False, True)]


@pytest.mark.parametrize(("fmt", "codec", "shape", "sharded"), CASES)
def test_plan_matches_direct_reader(tmp_path, fmt, codec, shape, sharded):
    data, arr = write_layout(
        tmp_path / "a.zarr", SHAPES[shape], fmt=fmt, codec=codec, sharded=sharded
    )
    shp, _, chunks, _ = SHAPES[shape]
    reader = open_reader(arr, name="a")
    assert isinstance(reader, DirectReader)
    rng = np.random.default_rng(zlib.crc32(repr((fmt, codec, shape, sharded)).encode()))
    for _ in range(3):
        ranges = random_ranges(rng, shp[0], chunks[0])
        plan = plan_rows(reader, ranges)
        assert plan.kind == KIND_OF[codec]
        assert (plan.reason == "") == (plan.kind in GPU_KINDS)
        got = execute_plan_cpu(plan, reader)
        want = reader.read_rows(ranges)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        _check_plan_invariants(plan, reader)
    # the fill-value chunk is not stored: the plan fills it instead of reading it
    full = plan_rows(reader, np.array([[0, shp[0]]]))
    assert len(full.fill_slots) >= 1
    assert len(full.reads) + len(full.fill_slots) == len(full.chunks)
    np.testing.assert_array_equal(execute_plan_cpu(full, reader), data)


@pytest.mark.parametrize("shape", ["1d-int32", "3d-rowchunks"])
@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_placed_plan_writes_its_pieces_where_asked(tmp_path, codec, shape):
    """A store's share of a collection window: its ranges, read by one plan, land as
    pieces (runs of ranges) at scattered places of a larger output, which nothing else
    touches."""
    _, arr = write_layout(tmp_path / "a.zarr", SHAPES[shape], fmt=3, codec=codec, sharded=True)
    n, chunk = SHAPES[shape][0][0], SHAPES[shape][2][0]
    reader = open_reader(arr, name="a")
    rng = np.random.default_rng(7)
    for _ in range(4):
        ranges = random_ranges(rng, n, chunk, k=12)
        lens = ranges[:, 1] - ranges[:, 0]
        # pieces: runs of consecutive ranges (some empty), put in shuffled order with gaps
        bounds = np.unique(np.concatenate([[0, len(ranges)], rng.integers(0, len(ranges), 5)]))
        piece_rows = np.add.reduceat(lens, bounds[:-1]) if len(ranges) else lens
        order = rng.permutation(len(piece_rows))
        gaps = rng.integers(0, 3, len(piece_rows))
        starts = np.empty(len(piece_rows), np.int64)
        at = 0
        for i in order:
            at += int(gaps[i])
            starts[i] = at
            at += int(piece_rows[i])
        out_rows = at + 2
        plan = place_plan(
            plan_rows(reader, ranges), starts=starts, lengths=piece_rows, out_rows=out_rows
        )
        assert plan.out_shape[0] == out_rows
        sentinel = np.full((out_rows, *SHAPES[shape][0][1:]), 99, dtype=arr.dtype)
        got = execute_plan_cpu(plan, reader, out=sentinel.copy())
        want = sentinel.copy()
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            rows = reader.read_rows(ranges[a:b]) if b > a else want[:0]
            want[starts[i] : starts[i] + piece_rows[i]] = rows
        np.testing.assert_array_equal(got, want)
    total = plan.out_shape[0]
    with pytest.raises(ValueError, match=f"pieces of {total + 1} rows"):
        place_plan(plan, starts=[0], lengths=[total + 1], out_rows=total + 1)
    with pytest.raises(ValueError, match="outside an output"):
        place_plan(plan, starts=[5], lengths=[plan.out_shape[0]], out_rows=plan.out_shape[0])


def _collection_window(tmp_path, stores, rng):
    """Readers of ``stores`` (``(codec, sharded)`` each, different data, one layout), and a
    window interleaving some ranges of each: per store ``(reader, ranges, pieces)`` (where
    each of its ranges goes), the window's rows, and the expected window."""
    shape, dtype, chunks, shards = SHAPES["1d-float32"]
    readers, datas = [], []
    for i, (codec, sharded) in enumerate(stores):
        data = make_data(shape, dtype, chunks[0], shards[0] if sharded else None, seed=i)
        arr = write(
            tmp_path / f"s{i}.zarr",
            data,
            chunks=chunks,
            shards=shards if sharded else None,
            compressors=compressors(codec, 3),
        )
        readers.append(open_reader(arr, name=f"s{i}.zarr/x"))
        datas.append(data)
    ranges = [random_ranges(rng, shape[0], chunks[0], k=5) for _ in stores]
    # every range of every store is a piece of the window, pieces in shuffled order
    pieces = [(i, j) for i, r in enumerate(ranges) for j in range(len(r))]
    starts = [np.zeros(len(r), np.int64) for r in ranges]
    want, at = [], 0
    for k in rng.permutation(len(pieces)):
        i, j = pieces[k]
        a, b = ranges[i][j]
        starts[i][j] = at
        want.append(datas[i][a:b])
        at += int(b - a)
    items = [
        (reader, r, (s, r[:, 1] - r[:, 0]))
        for reader, r, s in zip(readers, ranges, starts, strict=True)
    ]
    return items, at, np.concatenate(want)


def test_window_plans_read_every_store_into_its_places(tmp_path):
    """A collection window: the arrays of stores with one chunk format (sharded or not,
    other data) are planned as one; another kind gets a plan of its own. Together they
    write exactly the window the stores' rows make, and each joint plan is what the
    stores' own plans are, end to end."""
    rng = np.random.default_rng(3)
    stores = [("zstd", True), ("zstd", False), ("none", True), ("zstd", True), ("none", False)]
    items, n_rows, want = _collection_window(tmp_path, stores, rng)
    plans, unplannable = window_plans(items, out_rows=n_rows)
    assert unplannable == [] and sorted(plan.kind for plan, _ in plans) == ["none", "zstd"]
    for plan, reader in plans:
        assert isinstance(reader, StoreReaders) and plan.out_shape[0] == n_rows
        own = [plan_rows(r, ranges) for r, ranges, _ in items if r in reader.readers]
        assert plan.files == tuple(f for p in own for f in p.files)
        stored = np.concatenate([p.reads["nbytes"] for p in own])
        np.testing.assert_array_equal(plan.reads["nbytes"], stored)
        assert len(plan.fill_slots) == sum(len(p.fill_slots) for p in own) > 0
    # unplaced, a joint plan is a plan like any other: outputs end to end
    zstd = [(r, ranges, None) for r, ranges, _ in items if r.layout.codecs.bytes_codecs]
    n_zstd = sum(int((ranges[:, 1] - ranges[:, 0]).sum()) for _, ranges, _ in zstd)
    [(joint, reader)], _ = window_plans(zstd, out_rows=n_zstd)
    _check_plan_invariants(joint, reader)
    np.testing.assert_array_equal(
        execute_plan_cpu(joint, reader), np.concatenate([r.read_rows(x) for r, x, _ in zstd])
    )
    got = np.full(want.shape, np.nan, dtype=want.dtype)
    for plan, reader in plans:
        execute_plan_cpu(plan, reader, out=got)
    np.testing.assert_array_equal(got, want)
    # host-decoded arrays are never planned together: each keeps its own store's decoder
    items, n_rows, want = _collection_window(tmp_path / "host", [("gzip", False)] * 2, rng)
    plans, _ = window_plans(items, out_rows=n_rows)
    assert [reader for _, reader in plans] == [r for r, _, _ in items]
    got = np.full(want.shape, np.nan, dtype=want.dtype)
    for plan, reader in plans:
        execute_plan_cpu(plan, reader, out=got)
    np.testing.assert_array_equal(got, want)
    # rows that are the whole window are not placed, and must be the window's size
    reader, ranges, _ = items[0]
    whole = int((ranges[:, 1] - ranges[:, 0]).sum())
    [(plan, _)], _ = window_plans([(reader, ranges, None)], out_rows=whole)
    np.testing.assert_array_equal(execute_plan_cpu(plan, reader), reader.read_rows(ranges))
    with pytest.raises(ValueError, match="for a window of"):
        window_plans([(reader, ranges, None)], out_rows=whole + 1)


def test_window_plans_leave_arrays_without_a_plan_to_the_caller(tmp_path):
    data = np.zeros((40, 7), dtype=np.float32)
    split = open_reader(write(tmp_path / "a.zarr", data, chunks=(8, 4)), name="a")
    whole = open_reader(write(tmp_path / "b.zarr", data, chunks=(8, 7)), name="b")
    ranges = np.array([[0, 8]])
    plans, unplannable = window_plans(
        [
            (split, ranges, (np.array([0]), np.array([8]))),
            (whole, ranges, (np.array([8]), np.array([8]))),
        ],
        out_rows=16,
    )
    assert unplannable == [0] and [reader for _, reader in plans] == [whole]


@pytest.mark.parametrize("damage", ["corrupt", "shrink"])
def test_joint_plan_names_the_store_of_a_bad_chunk(tmp_path, damage):
    """A bad chunk of the middle store, found by decode or by a short read, is named by its
    own store and chunk, not by its place in the joint plan."""
    rng = np.random.default_rng(4)
    items, n_rows, _ = _collection_window(tmp_path, [("zstd", False)] * 3, rng)
    [(plan, reader)], _ = window_plans(items, out_rows=n_rows)
    assert isinstance(reader, StoreReaders)
    path = tmp_path / "s1.zarr" / "c" / "5"  # the window reads every chunk: [0, n) is in it
    raw = bytearray(path.read_bytes())
    if damage == "corrupt":
        raw[:4] = b"\xff" * 4  # not a zstd frame
    else:
        del raw[len(raw) // 2 :]
    path.write_bytes(bytes(raw))
    with pytest.raises(ChunkReadError, match=r"s1.zarr/x: chunk 'c/5'"):
        execute_plan_cpu(plan, reader, out=np.empty(plan.out_shape, plan.dtype))


def _check_plan_invariants(plan, reader) -> None:
    reads, ext = plan.reads, plan.extents
    # every chunk read at most once, in increasing chunk order, to its own slot
    chunks = reads["chunk"].tolist()
    assert chunks == sorted(set(chunks))
    slots = {int(c): i for i, c in enumerate(plan.chunks)}
    assert reads["decoded_offset"].tolist() == [slots[c] * plan.slot_nbytes for c in chunks]
    # slots start on 256-byte boundaries for nvCOMP; uncompressed ones follow each other
    assert (
        reads["decoded_offset"] % (plan.dtype.itemsize if plan.kind == "none" else 256) == 0
    ).all()
    sizes = [os.path.getsize(f) for f in plan.files]
    for r in reads.tolist():
        _, file, offset, nbytes, staging, _ = r
        assert offset + nbytes <= sizes[file]
        if plan.kind == "none":
            assert staging == -1 and nbytes == plan.chunk_nbytes
        else:
            assert staging >= 0 and staging + nbytes <= plan.staging_nbytes
    assert plan.header_nbytes == (4 if plan.kind == "lz4" else 0)
    # staging regions never overlap
    regions = sorted(zip(reads["staging_offset"].tolist(), reads["nbytes"].tolist(), strict=True))
    for (a, n), (b, _) in itertools.pairwise(r for r in regions if r[0] >= 0):
        assert a + n <= b
    # the extents cover the reads once, in order; inside one, chunks follow each other in
    # their file and in the buffer read into; a staging extent starts on a 4 KiB page of its
    # file and of the staging buffer, reading its lead (< 4 KiB) before its first chunk
    assert ext["first"].tolist() == np.cumsum([0, *ext["count"][:-1]]).tolist()
    assert int(ext["count"].sum()) == len(reads)
    dest = reads["decoded_offset"] if plan.kind == "none" else reads["staging_offset"]
    for e in ext.tolist():
        file, offset, nbytes, dest_offset, lead, first, count = e
        run = reads[first : first + count]
        assert (run["file"] == file).all()
        if plan.kind == "none":  # straight into its slot
            assert lead == 0
        else:
            assert offset % 4096 == 0 and dest_offset % 4096 == 0 and 0 <= lead < 4096
        starts = lead + np.cumsum([0, *run["nbytes"][:-1]])
        assert (run["file_offset"] == offset + starts).all()
        assert (dest[first : first + count] == dest_offset + starts).all()
        assert nbytes == lead + int(run["nbytes"].sum())
        assert offset + nbytes <= sizes[file]
    if plan.kind != "none":  # extents' reads, leads included, never overlap in staging
        spans = sorted(zip(ext["dest_offset"].tolist(), ext["nbytes"].tolist(), strict=True))
        for (a, n), (b, _) in itertools.pairwise(spans):
            assert a + n <= b
        assert all(a + n <= plan.staging_nbytes for a, n in spans)
    # segments stay inside both buffers and cover the window exactly once
    seg = plan.segments
    if len(seg):
        elems = plan.decoded_nbytes // plan.dtype.itemsize
        assert (seg[:, 2] > 0).all() and (seg[:, 0] + seg[:, 2] <= elems).all()
        covered = np.zeros(int(np.prod(plan.out_shape)), dtype=np.int64)
        for _, d, k in seg:
            covered[d : d + k] += 1
        assert (covered == 1).all()


def test_lz4_plan_reads_the_header_and_decodes_the_bare_block(tmp_path):
    data = np.arange(4096, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(512,), compressors=compressors("lz4", 3))
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[0, 4096]]))
    src_offset, src_nbytes = plan.decode_sources()
    assert (src_offset == plan.reads["staging_offset"] + 4).all()
    assert (src_nbytes == plan.reads["nbytes"] - 4).all()
    for r in plan.reads.tolist():
        _, file, offset, nbytes, _, _ = r
        with open(plan.files[file], "rb") as f:  # the skipped header is numcodecs' size
            f.seek(offset)
            assert int.from_bytes(f.read(4), "little") == plan.chunk_nbytes
        assert nbytes == os.path.getsize(plan.files[file])  # unsharded: the whole file


def test_lz4_header_that_disagrees_with_the_chunk_shape_is_refused(tmp_path):
    data = np.arange(4096, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(512,), compressors=compressors("lz4", 3))
    path = tmp_path / "a.zarr" / "c" / "3"
    raw = bytearray(path.read_bytes())
    raw[:4] = (512 * 4 + 8).to_bytes(4, "little")  # a header 8 bytes too large
    path.write_bytes(bytes(raw))
    reader = open_reader(arr, name="arr")
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/3'.*header says 2056 bytes"):
        execute_plan_cpu(plan_rows(reader, np.array([[0, 4096]])), reader)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_adjacent_chunks_of_a_shard_are_one_read(tmp_path, monkeypatch, codec):
    """Chunks that follow each other in a shard file are read with one call (an extent);
    runs are cut near MAX_EXTENT. A chunk that is not stored leaves no gap in the shard, but
    uncompressed chunks are read straight into their slots, where it does leave one."""
    from dali_zarr.io import gpu

    data = np.arange(640 * 4, dtype=np.float32).reshape(640, 4)  # 64 chunks of 10 rows
    data[100:110] = 0  # chunk 10 equals the fill value: zarr does not store it
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 4), shards=(160, 4),
                compressors=compressors(codec, 3))  # fmt: skip
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[0, 640]]))  # 4 shards, chunk 10 not stored
    assert plan.slot_nbytes == (160 if codec == "none" else 256)  # 160-byte chunks
    assert plan.fill_slots == (10,)
    want = [10, 5, 16, 16, 16] if codec == "none" else [15, 16, 16, 16]
    assert plan.extents["count"].tolist() == want
    np.testing.assert_array_equal(execute_plan_cpu(plan, reader), data)
    _check_plan_invariants(plan, reader)
    # small MAX_EXTENT: runs are cut (a read starts a new extent once MAX_EXTENT is passed)
    largest = int(plan.reads["nbytes"].max())
    monkeypatch.setattr(gpu, "MAX_EXTENT", 3 * largest)
    small = plan_rows(reader, np.array([[0, 640]]))
    assert len(small.extents) > len(plan.extents)
    chunk_bytes = small.extents["nbytes"] - small.extents["lead"]
    assert (chunk_bytes < 4 * largest).all()  # reads start within MAX_EXTENT
    np.testing.assert_array_equal(execute_plan_cpu(small, reader), data)
    _check_plan_invariants(small, reader)
    # a shuffled window of 3-chunk ranges: reads still follow in sorted chunk order
    rng = np.random.default_rng(0)
    ranges = np.array([[s, s + 30] for s in rng.permutation(np.arange(0, 640, 30)[:-1])])
    window = plan_rows(reader, ranges)
    np.testing.assert_array_equal(execute_plan_cpu(window, reader), reader.read_rows(ranges))
    _check_plan_invariants(window, reader)


@pytest.mark.parametrize("first_row", [0, 20])
def test_short_read_names_the_chunk_where_the_file_ends(tmp_path, first_row):
    """A shard that shrinks after planning: the error names the first chunk not read (also
    when the read starts a page before its first chunk, ``first_row`` 20)."""
    data = np.arange(64 * 40, dtype=np.float32).reshape(640, 4)
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 4), shards=(160, 4),
                compressors=compressors("zstd", 3))  # fmt: skip
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[first_row, 160]]))  # shard 0: one extent of chunks
    assert len(plan.extents) == 1
    assert plan.extents["lead"][0] == plan.reads["file_offset"][0]  # the shard's first page
    cut = int(plan.reads["file_offset"][plan.reads["chunk"] == 5][0]) + 3  # inside chunk 5
    with open(plan.files[0], "r+b") as f:
        f.truncate(cut)
    with pytest.raises(ChunkReadError, match=r"array chunk \(5, 0\).*when its reads were planned"):
        execute_plan_cpu(plan, reader)


def test_unsharded_chunk_sizes_are_looked_up_once(tmp_path, monkeypatch):
    """Unsharded stores: a chunk's file is stat'ed once, then windows are planned without
    a stat per chunk. A chunk that shrinks after that fails its read naming the chunk; a
    chunk missing at first (fill value) is found once it is written."""
    data = np.arange(64 * 40, dtype=np.float32).reshape(640, 4)
    arr = write(tmp_path / "u.zarr", data, chunks=(10, 4), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="u")
    whole = np.array([[0, 640]])
    missing = tmp_path / "u.zarr" / "c" / "7" / "0"
    saved = missing.read_bytes()
    missing.unlink()
    first = plan_rows(reader, whole)
    assert 7 not in first.reads["chunk"].tolist()
    assert (execute_plan_cpu(first, reader)[70:80] == 0).all()  # the fill value
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    missing.write_bytes(saved)
    again = plan_rows(reader, whole)
    assert stats == [str(missing)]  # only the chunk not seen yet is looked for
    np.testing.assert_array_equal(execute_plan_cpu(again, reader), data)
    shrunk = tmp_path / "u.zarr" / "c" / "3" / "0"
    shrunk.write_bytes(shrunk.read_bytes()[:-5])
    later = plan_rows(reader, whole)
    with pytest.raises(ChunkReadError, match=r"u: chunk 'c/3/0'"):
        execute_plan_cpu(later, reader)


def test_contiguous_window_is_one_segment(tmp_path):
    # 64 float32 = 256 bytes per chunk: slots are back to back, so a window of whole
    # consecutive chunks is a single copy
    data = np.arange(1024, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(64,), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[128, 640], [0, 64]]))
    assert plan.segments.tolist() == [[64, 0, 512], [0, 512, 64]]
    np.testing.assert_array_equal(execute_plan_cpu(plan, reader), np.r_[data[128:640], data[:64]])


def test_host_kinds_say_why(tmp_path):
    data = np.arange(300, dtype=np.float32)
    big = write(
        tmp_path / "big.zarr",
        data,
        chunks=(64,),
        compressors=compressors("zstd", 3),
        serializer=BytesCodec(endian="big"),
    )
    kind, why = gpu_codec_kind(open_reader(big, name="big").layout)
    assert kind == "host" and "byte swap" in why
    delta = write(
        tmp_path / "delta.zarr",
        data.astype(np.int32),
        fmt=2,
        chunks=(64,),
        compressors=compressors("zstd", 2),
        filters=[numcodecs.Delta(dtype="<i4")],
    )
    reader = open_reader(delta, name="delta")
    kind, why = gpu_codec_kind(reader.layout)
    assert kind == "host" and "delta" in why
    ranges = np.array([[5, 250], [0, 3]])
    np.testing.assert_array_equal(
        execute_plan_cpu(plan_rows(reader, ranges), reader), reader.read_rows(ranges)
    )


@pytest.mark.parametrize("fmt", [2, 3])
def test_chunks_past_a_decode_call_are_decoded_on_the_host(tmp_path, fmt):
    """A call holds at least one chunk, so a chunk of more than ``CALL_NBYTES`` decoded
    would pass the call cap's scratch bound (and nvCOMP refuses zstd chunks of 2 GiB or
    more with a status that names no chunk): such arrays take the host decode."""
    from dali_zarr.io.nvcomp_batched import CALL_NBYTES

    for codec in ("zstd", "lz4"):
        kinds = []
        for width in (CALL_NBYTES // 4, CALL_NBYTES // 4 + 1):  # float32: the cap, one more
            path = tmp_path / f"{codec}{width}.zarr"
            array = zarr.create_array(  # metadata only: no chunk is written
                str(path), shape=(2, width), chunks=(1, width), dtype="float32",
                compressors=compressors(codec, fmt), zarr_format=fmt,
            )  # fmt: skip
            kinds.append(gpu_codec_kind(open_reader(array, name=path.name).layout))
        assert kinds[0] == (codec, "")
        assert kinds[1][0] == "host" and "chunks of 512 MiB decoded" in kinds[1][1], kinds


@pytest.mark.parametrize("kind", ["none", "zstd", "lz4", "host"])
@pytest.mark.parametrize(("kvikio", "gds", "nvcomp"), [(1, 1, 1), (1, 0, 1), (1, 0, 0), (0, 0, 1)])
@pytest.mark.parametrize("reads", ["", "pinned"])
def test_described_path_is_the_path_taken(monkeypatch, kind, kvikio, gds, nvcomp, reads):
    """read_paths() says "device" exactly when the executor decodes on the device, and names
    the read method the executor uses."""
    from dali_zarr.io.gpu import (
        READS_ENV,
        GpuSupport,
        decodes_on_device,
        describe_path,
        read_method,
    )

    monkeypatch.setenv(READS_ENV, reads)
    support = GpuSupport(True, True, bool(kvikio), bool(gds), bool(nvcomp), "")
    line = describe_path(kind, "blosc" if kind == "host" else "", support)
    on_device = decodes_on_device(kind, nvcomp=bool(nvcomp))
    assert on_device == (kind in ("none", "zstd", "lz4") and (kind == "none" or nvcomp))
    assert ("→ device" in line) == on_device, line
    assert ("host read and decode" in line) == (not on_device), line
    # the way out where the codec is the reason (not where nvCOMP is missing)
    assert ("dali-zarr convert" in line) == (kind == "host"), line
    method = read_method(support)
    assert method == ("kvikio" if kvikio and not reads else "pinned")
    if on_device:
        if method == "kvikio":
            assert ("GDS" if gds else "compat") in line
        else:
            assert "pinned" in line and ("kvikio unavailable" in line) == (not kvikio)
        assert ("nvCOMP" in line) == (kind != "none")
    else:
        assert ("blosc" if kind == "host" else "nvCOMP") in line


def test_read_method_switch_is_checked(monkeypatch):
    from dali_zarr.errors import ConfigError
    from dali_zarr.io.gpu import READS_ENV, GpuSupport, read_method

    without = GpuSupport(True, True, False, False, True, "")
    monkeypatch.setenv(READS_ENV, "gds")
    with pytest.raises(ConfigError, match=r"DALI_ZARR_GPU_READS='gds'.*'kvikio' or 'pinned'"):
        read_method(without)
    monkeypatch.setenv(READS_ENV, "kvikio")
    with pytest.raises(ConfigError, match="kvikio is not installed"):
        read_method(without)


def test_rows_split_across_chunks_are_not_plannable(tmp_path):
    data = np.zeros((40, 7), dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(8, 4))
    with pytest.raises(NotPlannable, match="trailing axes"):
        plan_rows(open_reader(arr, name="a"), np.array([[0, 8]]))


def test_corrupted_chunk_names_array_and_chunk(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.poisson(3, 4096).astype(np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=compressors("zstd", 3))
    path = tmp_path / "a.zarr" / "c" / "1"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 16] = b"\xff" * 16
    path.write_bytes(bytes(raw))
    reader = open_reader(arr, name="arr")
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/1'"):
        execute_plan_cpu(plan_rows(reader, np.array([[0, 4096]])), reader)


def _zstd_header(fcs_flag: int, single_segment: int, size: int, dict_flag=0, checksum=0):
    """A zstd frame header recording content size ``size`` in the given layout (RFC 8878)."""
    width = (single_segment, 2, 4, 8)[fcs_flag]
    head = bytearray((0xFD2FB528).to_bytes(4, "little"))
    head.append(fcs_flag << 6 | single_segment << 5 | checksum << 2 | dict_flag)
    if not single_segment:
        head.append(0x58)  # a window descriptor
    head += b"\xd1\xc7\xb5\xa3"[: (0, 1, 2, 4)[dict_flag]]  # a dictionary id
    head += (size - 256 if width == 2 else size).to_bytes(width, "little") if width else b""
    return np.frombuffer(bytes(head).ljust(FRAME_HEAD_NBYTES, b"\0"), np.uint8), len(head)


LAYOUTS = [(0, 1, 200), (1, 0, 256), (1, 1, 65791), (2, 0, 70_000), (3, 1, 5 << 30), (0, 0, -1)]


@pytest.mark.parametrize(("fcs_flag", "single_segment", "size"), LAYOUTS)
@pytest.mark.parametrize("dict_flag", [0, 1, 2, 3])
@pytest.mark.parametrize("checksum", [0, 1])
def test_zstd_content_size_in_every_header_layout(
    fcs_flag, single_segment, size, dict_flag, checksum
):
    """The vectorised parser (plan executors) and the scalar one (the reader's decode) agree
    with the header as written, for every field the descriptor can add."""
    head, end = _zstd_header(fcs_flag, single_segment, size, dict_flag, checksum)
    is_frame, content, header_end = zstd_content_sizes(head[None])
    assert is_frame[0] and content[0] == size and header_end[0] == end
    assert _zstd_content_size(head[:end]) == (None if size < 0 else size)
    assert _zstd_content_size(head[: end - 1]) is None  # a truncated header
    reserved = head.copy()
    reserved[4] |= 1 << 3
    assert not zstd_content_sizes(reserved[None])[0][0]
    assert _zstd_content_size(reserved) is None


def test_content_sizes_past_int64_are_no_match():
    head, _ = _zstd_header(3, 1, (1 << 64) - 5)
    assert frame_problems("zstd", head[None], [100], 4096) == [
        (0, f"zstd frame holds {(1 << 63) - 257} bytes, expected 4096")
    ]


def test_frame_problems_on_real_frames():
    """Frames numcodecs writes pass; data that is not the chunk the metadata describes is
    named before any decoder sees it."""
    chunk = np.arange(1024, dtype=np.float32)
    n = chunk.nbytes
    zstd = [np.frombuffer(numcodecs.Zstd(level=lv).encode(chunk), np.uint8) for lv in (1, 9)]
    other_size = np.frombuffer(numcodecs.Zstd().encode(chunk[:1000]), np.uint8)
    gzip = np.frombuffer(numcodecs.GZip().encode(chunk), np.uint8)
    stored = [*zstd, other_size, gzip, zstd[0][:7]]
    heads = np.stack([np.frombuffer(b[:18].tobytes().ljust(18, b"\0"), np.uint8) for b in stored])
    got = frame_problems("zstd", heads, [len(b) for b in stored], n)
    assert [i for i, _ in got] == [2, 3, 4]
    assert got[0][1] == f"zstd frame holds 4000 bytes, expected {n}"
    assert got[1][1].startswith("not a zstd frame (starts with [1f 8b 08 00]")
    assert got[2][1] == "stored 7 bytes, too short for a zstd frame"
    lz4 = np.frombuffer(numcodecs.LZ4().encode(chunk), np.uint8)
    lz4_heads = np.zeros((2, FRAME_HEAD_NBYTES), np.uint8)
    lz4_heads[0, :4], lz4_heads[1, :4] = lz4[:4], [1, 2, 0, 0]
    assert frame_problems("lz4", lz4_heads, [lz4.size] * 2, n) == [
        (1, f"lz4 header says 513 bytes, expected {n}")
    ]


@pytest.mark.parametrize("blob", ["gzip", "short-zstd"])
def test_chunk_that_is_not_what_the_metadata_says_is_named(tmp_path, blob):
    """A chunk file replaced by other data (gzip bytes, or a zstd frame of another size) in
    an array declared zstd: the plan executor names the chunk before decoding anything."""
    data = np.arange(4096, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=compressors("zstd", 3))
    wrong = numcodecs.GZip() if blob == "gzip" else numcodecs.Zstd()
    part = data if blob == "gzip" else data[:1000]
    (tmp_path / "a.zarr" / "c" / "2").write_bytes(wrong.encode(part))
    reader = open_reader(arr, name="arr")
    why = "not a zstd frame" if blob == "gzip" else "zstd frame holds 4000 bytes, expected 4096"
    with pytest.raises(ChunkReadError, match=rf"arr: chunk 'c/2'.*{why}"):
        execute_plan_cpu(plan_rows(reader, np.array([[0, 4096]])), reader)


def test_decode_calls_are_capped_in_decoded_bytes():
    def sizes(n, nbytes):
        return np.full(n, nbytes)

    assert call_slices(sizes(10, 100), cap=250) == [slice(0, 2), slice(2, 4), slice(4, 6),
                                                    slice(6, 8), slice(8, 10)]  # fmt: skip
    assert call_slices(sizes(3, 1000), cap=10) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert call_slices(sizes(0, 100)) == []
    assert call_slices(sizes(5, 1 << 20)) == [slice(0, 5)]  # a window well under CALL_NBYTES
    # the chunks of a window's plans together: float64 values beside int32 ids
    mixed = np.array([200, 200, 100, 100, 100, 200, 50])
    assert call_slices(mixed, cap=400) == [slice(0, 2), slice(2, 5), slice(5, 7)]
    assert call_slices(mixed, cap=150) == [slice(i, i + 1) for i in range(7)]


def test_truncated_uncompressed_chunk(tmp_path):
    data = np.arange(256, dtype=np.int32)
    arr = write(tmp_path / "a.zarr", data, chunks=(64,))
    path = tmp_path / "a.zarr" / "c" / "2"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ChunkReadError, match="expected 256"):
        plan_rows(open_reader(arr, name="a"), np.array([[0, 256]]))


def test_copy_segments_reference():
    src = np.arange(20, dtype=np.int64)
    out = np.full(9, -1, dtype=np.int64)
    copy_segments_cpu(out, src, np.array([[10, 0, 3], [0, 3, 6]]))
    assert out.tolist() == [10, 11, 12, 0, 1, 2, 3, 4, 5]


def test_long_segments_are_cut_into_pieces_that_copy_the_same(tmp_path):
    """The copy kernel gives each segment one block, and an unshuffled window of
    uncompressed chunks is a single merged segment: it is cut so every SM gets a share."""
    data = np.arange(4096, dtype=np.float32)
    arr = write(tmp_path / "u.zarr", data, chunks=(64,), compressors=None)
    reader = open_reader(arr, name="u")
    plan = plan_rows(reader, np.array([[0, 4096]]))
    assert plan.segments.tolist() == [[0, 0, 4096]]
    pieces = split_segments(plan.segments, 1000)
    assert pieces.tolist() == [[0, 0, 1000], [1000, 1000, 1000], [2000, 2000, 1000],
                               [3000, 3000, 1000], [4000, 4000, 96]]  # fmt: skip
    rng = np.random.default_rng(5)
    for piece in (1, 7, 64, 10**6):
        lens = rng.integers(1, 300, 40)
        seg = np.stack([rng.integers(0, 5000, 40), run_offsets(lens)[:-1], lens], 1)
        cut = split_segments(seg, piece)
        assert cut[:, 2].max() <= piece and cut[:, 2].sum() == lens.sum()
        assert len(cut) == int((-(-lens // piece)).sum())
        src = rng.standard_normal(6000).astype(np.float32)
        want, got = np.zeros(int(lens.sum()), np.float32), np.ones(int(lens.sum()), np.float32)
        copy_segments_cpu(want, src, seg)
        copy_segments_cpu(got, src, cut)
        np.testing.assert_array_equal(got, want)
    assert split_segments(np.zeros((0, 3), np.int64), 10).shape == (0, 3)


def test_probe_reports_without_raising():
    support = probe_gpu()
    assert isinstance(support.usable, bool)
    if not has_cuda():
        assert not support.usable and "CUDA" in support.reason


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("fmt", "codec", "sharded"),
    [(3, c, s) for c in ("zstd", "lz4", "blosc", "none") for s in (False, True)]
    + [(2, c, False) for c in ("zstd", "lz4", "blosc", "none")],
)
@pytest.mark.parametrize("nvcomp_api", ["python", "c"])  # c: dali_zarr.io.nvcomp_batched
@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_matches_direct_reader(
    tmp_path, monkeypatch, fmt, codec, sharded, nvcomp_api, reads
):
    import cupy

    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV, GpuPlanExecutor

    monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "1" if nvcomp_api == "c" else "0")
    monkeypatch.setenv(READS_ENV, reads)

    _, arr = write_layout(
        tmp_path / "a.zarr", SHAPES["3d-rowchunks"], fmt=fmt, codec=codec, sharded=sharded
    )
    shp, _, chunks, _ = SHAPES["3d-rowchunks"]
    reader = open_reader(arr, name="a")
    executor = GpuPlanExecutor(0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ranges = random_ranges(rng, shp[0], chunks[0])
        plan = plan_rows(reader, ranges)
        out = cupy.empty(plan.out_shape, dtype=plan.dtype)
        executor.run(plan, reader, out)
        np.testing.assert_array_equal(cupy.asnumpy(out), reader.read_rows(ranges))
    executor.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nvcomp_api", ["python", "c"])
@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_capped_calls_and_a_bad_chunk(tmp_path, monkeypatch, nvcomp_api, reads):
    """On the device: a window decoded in calls of at most CALL_NBYTES equals the host read;
    a chunk that is not a zstd frame fails naming it, and the executor serves the next plan."""
    import cupy

    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV, GpuPlanExecutor

    monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "1" if nvcomp_api == "c" else "0")
    monkeypatch.setenv(READS_ENV, reads)
    monkeypatch.setattr(nvcomp_batched, "CALL_NBYTES", 3 * 4096)  # three 4 KiB chunks a call
    data = np.random.default_rng(0).poisson(2, 16 * 1024).astype(np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="arr")
    executor = GpuPlanExecutor(0)
    whole = np.array([[0, data.size]])
    out = cupy.empty(data.size, dtype=np.float32)
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(cupy.asnumpy(out), data)
    chunk5 = tmp_path / "a.zarr" / "c" / "5"
    good = chunk5.read_bytes()
    chunk5.write_bytes(numcodecs.GZip().encode(data[:1024]))
    assert reader.forget_changed_chunks()  # as the window reader does on a changed size
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/5'.*not a zstd frame"):
        executor.run(plan_rows(reader, whole), reader, out)
    # cut short, its header intact: nvCOMP decoded such a frame to NaNs (2026-11-27)
    noise = np.random.default_rng(1).random(1024, np.float32)  # incompressible
    chunk5.write_bytes(numcodecs.Zstd().encode(noise)[:-9])
    assert reader.forget_changed_chunks()
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/5'.*zstd frame cut short"):
        executor.run(plan_rows(reader, whole), reader, out)
    # frames without a content size: a corrupted one named (nvCOMP read out of bounds on
    # such a frame, 2026-11-27) by the device walk (kvikio) or, past the host walk's limit
    # (pinned), by numcodecs; and the device still works
    chunk5.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 40)
    assert reader.forget_changed_chunks()
    why = "zstd frame cut short" if reads == "kvikio" else "zstd decoding failed"
    with pytest.raises(ChunkReadError, match=rf"arr: chunk 'c/5'.*{why}"):
        executor.run(plan_rows(reader, whole), reader, out)
    chunk5.write_bytes(_streamed_zstd(data[5120:6144]))
    assert reader.forget_changed_chunks()
    out[...] = 0
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(cupy.asnumpy(out), data)
    chunk5.write_bytes(good)
    assert reader.forget_changed_chunks()
    out[...] = 0
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(cupy.asnumpy(out), data)
    executor.close()


# ------------------------------------------------- the GPU executor's control flow, faked CUDA


class _Dev(np.ndarray):
    """A host array standing in for a cupy array (what the executor calls on it)."""

    def set(self, arr, stream=None):
        self[...] = arr

    def get(self, stream=None) -> np.ndarray:
        return np.array(self)

    @property
    def data(self):  # cupy's MemoryPointer: where the array starts
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.ctypes.data, False)}


def _fake_cuda_modules(monkeypatch, log, reads: str):
    """cupy, kvikio and nvidia.nvcomp stand-ins backed by NumPy, os.pread and numcodecs; the
    executor reads with ``reads`` and copies segments with the NumPy reference."""
    from dali_zarr.graph import cuda_kernels
    from dali_zarr.io import gpu, nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV

    monkeypatch.setenv(READS_ENV, reads)
    # the stand-in below is nvCOMP's Python codec; the C API (the default) calls libnvcomp
    # with device pointers, so only the `gpu` tests run it
    monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "0")
    monkeypatch.setattr(gpu, "COPY_PIECE_ELEMENTS", 100)  # the test's segments are cut

    def launch(fn, blocks, threads, stream, out, src, *seg):  # the kernels' references
        assert stream.ptr == 1234
        if fn is cuda_kernels.zstd_frame_ends:
            log.append(("frame ends", len(seg[0])))
            # the host walk with no block limit: what test_cuda_kernels checks the kernel
            # against under the CUDA simulator
            out[...] = zstd_frame_ends(np.asarray(src), *map(np.asarray, seg), 1 << 20)
            return
        assert fn is cuda_kernels.copy_segments
        pieces = np.stack(seg, axis=1)
        assert 1 <= blocks <= len(pieces) and pieces[:, 2].max() <= 100
        log.append(("copy", len(pieces)))
        copy_segments_cpu(out, src, pieces)

    monkeypatch.setattr(gpu, "launch", launch)
    import contextlib
    import sys
    import types

    class Ctx(contextlib.nullcontext):
        ptr = 1234

        def synchronize(self):
            pass

    cupy = types.ModuleType("cupy")
    cupy.empty = lambda n, dtype: np.zeros(n, dtype).view(_Dev)
    cupy.uint8, cupy.uint64 = np.uint8, np.uint64
    cupy.asarray = np.asarray
    cupy.asnumpy = lambda a, stream=None: np.asarray(a).copy()
    cupy.cuda = types.SimpleNamespace(
        Device=lambda i: Ctx(),
        Stream=lambda non_blocking: Ctx(),
        alloc_pinned_memory=lambda n: bytearray(n),
    )

    class CuFile:
        def __init__(self, path, mode):
            self.fd = os.open(path, os.O_RDONLY)

        def pread(self, buf, size, offset):
            assert isinstance(buf, _Dev) and buf.size == size
            got = os.preadv(self.fd, [buf], offset)
            log.append(("pread", size))
            log.append(("pages", buf.ctypes.data % 4096, offset % 4096))
            return types.SimpleNamespace(get=lambda: got)

        def fileno(self):
            return self.fd

        def close(self):
            os.close(self.fd)

    kvikio = types.ModuleType("kvikio")
    kvikio.CuFile = CuFile

    class Codec:
        def __init__(self, *, algorithm, bitstream_kind, device_id, cuda_stream):
            assert bitstream_kind == "RAW" and cuda_stream == 1234
            self.algorithm = algorithm

        def decode(self, srcs, data_type, out):
            log.append(("decode", self.algorithm, len(srcs)))
            sizes = []
            for src, dst in zip(srcs, out, strict=True):
                if self.algorithm == "Zstd":
                    numcodecs.Zstd().decode(src, out=dst)
                else:  # a bare LZ4 block: give numcodecs its size header back
                    numcodecs.LZ4().decode(dst.size.to_bytes(4, "little") + src.tobytes(), out=dst)
                sizes.append(types.SimpleNamespace(buffer_size=dst.size))
            return sizes

    nvcomp = types.ModuleType("nvidia.nvcomp")
    nvcomp.Codec = Codec
    nvcomp.as_arrays = lambda arrays, stream: list(arrays)
    nvcomp.BitstreamKind = types.SimpleNamespace(RAW="RAW")
    import nvidia

    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", nvcomp)
    monkeypatch.setattr(nvidia, "nvcomp", nvcomp, raising=False)
    # the probe (which also checks CUDA and kvikio's GDS settings) reports the fakes usable
    from dali_zarr.io.gpu import GpuSupport

    fake = GpuSupport(cuda=True, dali_gpu=True, kvikio=True, gds=False, nvcomp=True, reason="")
    monkeypatch.setattr(gpu, "probe_gpu", lambda: fake)


class _Cuda:
    """What an executor test needs of its device: arrays for ``run`` to fill and their host
    copies, under the stand-ins (``faked``, CI) or the real cupy/kvikio (``real``, a GPU)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def empty(self, shape, dtype):
        if self.kind == "faked":
            return np.empty(shape, dtype).view(_Dev)
        import cupy

        return cupy.empty(shape, dtype=dtype)

    def host(self, out) -> np.ndarray:
        if self.kind == "faked":
            return np.asarray(out)
        import cupy

        return cupy.asnumpy(out)


@pytest.fixture(params=["faked", pytest.param("real", marks=[pytest.mark.gpu, needs_cuda])])
def kvikio_executor_device(request, monkeypatch) -> _Cuda:
    """The executor reading with kvikio: under the NumPy stand-ins (whose CuFile holds its
    file open, as kvikio's does), or, on a GPU, with the real kvikio, cupy and nvCOMP."""
    if request.param == "faked":
        _fake_cuda_modules(monkeypatch, [], "kvikio")
    else:
        from dali_zarr.io.gpu import READS_ENV

        monkeypatch.setenv(READS_ENV, "kvikio")
    return _Cuda(request.param)


@pytest.mark.parametrize(("codec", "path"), [("zstd", "device"), ("lz4", "device"),
                                             ("none", "device"), ("blosc", "host")])  # fmt: skip
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_control_flow_with_faked_cuda(
    tmp_path, monkeypatch, codec, path, sharded, reads
):
    """GpuPlanExecutor.run with cupy/kvikio/nvCOMP replaced by NumPy stand-ins: exercises its
    buffers, offsets, path and read-method choice, fills and segment copies (not the
    libraries themselves)."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    _, arr = write_layout(tmp_path / "a.zarr", SHAPES["3d-rowchunks"], codec=codec, sharded=sharded)
    shp, _, chunks, _ = SHAPES["3d-rowchunks"]
    reader = open_reader(arr, name="a")
    executor = GpuPlanExecutor(0, max_open_files=2)
    assert executor.reads == reads
    rng = np.random.default_rng(3)
    for _ in range(3):
        ranges = random_ranges(rng, shp[0], chunks[0])
        plan = plan_rows(reader, ranges)
        assert executor.path_of(plan) == path
        out = np.full(plan.out_shape, np.nan, plan.dtype).view(_Dev)
        log.clear()
        assert executor.run(plan, reader, out) is out
        np.testing.assert_array_equal(out, reader.read_rows(ranges))
        if path == "device":
            preads = [("pread", n) for n in plan.extents["nbytes"].tolist()]  # one per extent
            assert [e for e in log if e[0] == "pread"] == (preads if reads == "kvikio" else [])
            if codec != "none" and reads == "kvikio" and len(plan.extents):
                # staging reads start on a page of the device buffer and of the file
                assert {e[1:] for e in log if e[0] == "pages"} == {(0, 0)}
            decodes = [e for e in log if e[0] == "decode"]
            assert decodes == ([("decode", {"zstd": "Zstd", "lz4": "LZ4"}[codec], len(plan.reads))]
                               if codec != "none" and len(plan.reads) else [])  # fmt: skip
        else:  # host decode: no kvikio, no nvCOMP
            assert not [e for e in log if e[0] != "copy"]
        # one copy launch, the segments cut into pieces of at most 100 elements
        cut = len(split_segments(plan.segments, 100))
        assert [e for e in log if e[0] == "copy"] == ([("copy", cut)] if len(plan.segments) else [])
        assert cut > len(plan.segments) or not len(plan.segments)
    assert len(executor._files) <= 2
    executor.close()


def _fake_nvcomp_c_api(monkeypatch, log) -> None:
    """nvCOMP's C API (``nvcompBatched{Zstd,LZ4}DecompressAsync``) standing in on host
    pointers (the faked device arrays are host memory): each chunk of the call table decoded
    with numcodecs, its status and decoded size written back as nvCOMP writes them."""
    import ctypes

    from dali_zarr.io import nvcomp_batched

    def decompress_of(kind: str):
        def decompress(src_ptrs, src_nbytes, dst_room, dst_got, n, temp, temp_nbytes,
                       dst_ptrs, opts, statuses, stream):  # fmt: skip
            assert stream == 1234 and temp_nbytes == 64

            def row(ptr, ctype=ctypes.c_uint64):
                return np.ctypeslib.as_array((ctype * n).from_address(ptr))

            srcs, sizes, room, dsts = map(row, (src_ptrs, src_nbytes, dst_room, dst_ptrs))
            got, status = row(dst_got), row(statuses, ctypes.c_int32)
            log.append(("c decode", kind, n))
            for i in range(n):
                stored = ctypes.string_at(int(srcs[i]), int(sizes[i]))
                try:
                    if kind == "zstd":
                        chunk = bytes(numcodecs.Zstd().decode(stored))
                    else:  # a bare LZ4 block: numcodecs wants its size header back
                        head = int(room[i]).to_bytes(4, "little")
                        chunk = bytes(numcodecs.LZ4().decode(head + stored))
                except Exception:
                    status[i], got[i] = 12, 0  # nvcompErrorCannotDecompress
                    continue
                chunk = chunk[: int(room[i])]
                ctypes.memmove(int(dsts[i]), chunk, len(chunk))
                status[i], got[i] = 0, len(chunk)
            return 0

        return decompress

    fakes = {kind: decompress_of(kind) for kind in nvcomp_batched.ALGORITHM}
    monkeypatch.setattr(nvcomp_batched, "use_c_api", lambda: True)
    monkeypatch.setattr(nvcomp_batched, "functions", lambda kind: (None, fakes[kind]))
    monkeypatch.setattr(nvcomp_batched, "temp_nbytes", lambda kind, n, biggest, total: 64)


#: arrays of a joint run: other codecs, dtypes, chunk sizes and layouts side by side
JOINT = [
    ("values", "1d-float32", "zstd", True),
    ("ids", "1d-int32", "zstd", False),  # 200-byte chunks beside 256-byte ones, one kind
    ("more", "1d-int64", "lz4", True),
    ("blosc", "3d-rowchunks", "blosc", False),  # decoded on the host
    ("raw", "1d-int32", "none", True),  # read straight into its chunk buffer
]


def _joint_readers(tmp_path) -> list[DirectReader]:
    readers = []
    for name, spec, codec, sharded in JOINT:
        _, arr = write_layout(tmp_path / f"{name}.zarr", SHAPES[spec], codec=codec, sharded=sharded)
        readers.append(open_reader(arr, name=name))
    return readers


def _unset(device: _Cuda, shape, dtype):
    """A device array of ``shape`` (``device``'s) holding a byte pattern no plan writes."""
    out = device.empty(shape, dtype)
    out.view(np.uint8)[...] = 0xA5
    return out


#: the executor's device in a test: NumPy stand-ins (CI), or a real GPU (``gpu`` tests)
ON_DEVICES = ["faked", pytest.param("real", marks=[pytest.mark.gpu, needs_cuda])]


def _executor_device(monkeypatch, log: list, device: str, reads: str, api: str) -> _Cuda:
    """The stand-ins of cupy, kvikio and the nvCOMP ``api`` ("c" or "python") for a
    ``faked`` device (decode calls logged in ``log``), or the real ones told to use
    ``reads`` and ``api``."""
    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV

    if device == "faked":
        _fake_cuda_modules(monkeypatch, log, reads)
        if api == "c":
            _fake_nvcomp_c_api(monkeypatch, log)
    else:
        monkeypatch.setenv(READS_ENV, reads)
        monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "1" if api == "c" else "0")
    return _Cuda(device)


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("api", ["c", "python"])
@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_runs_a_windows_plans_together(tmp_path, monkeypatch, reads, api, device):
    """``run_many``: the plans of five arrays (two zstd ones of other chunk sizes, lz4,
    blosc on the host, uncompressed) run in one call, each into its own output as
    ``read_rows`` gives its rows. Under the stand-ins, through nvCOMP's C API every chunk of
    a codec kind goes in one enqueue (the chunks of both zstd arrays in one call)."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    log: list = []
    cuda = _executor_device(monkeypatch, log, device, reads, api)
    readers = _joint_readers(tmp_path)
    executor = GpuPlanExecutor(0)
    rng = np.random.default_rng(5)
    for _ in range(4):
        jobs, want = [], []
        for reader, (_, spec, _, _) in zip(readers, JOINT, strict=True):
            shape, _, chunks, _ = SHAPES[spec]
            ranges = random_ranges(rng, shape[0], chunks[0])
            plan = plan_rows(reader, ranges)
            jobs.append((plan, reader, _unset(cuda, plan.out_shape, plan.dtype)))
            want.append(reader.read_rows(ranges))
        log.clear()
        executor.run_many(jobs)
        for (_, reader, out), rows in zip(jobs, want, strict=True):
            np.testing.assert_array_equal(cuda.host(out), rows, err_msg=reader.name)
        if device == "real":
            continue
        decodes = [e for e in log if e[0] in ("c decode", "decode")]
        chunks = {kind: sum(len(p.reads) for p, _, _ in jobs if p.kind == kind)
                  for kind in ("zstd", "lz4")}  # fmt: skip
        if api == "c":
            assert decodes == [
                ("c decode", "zstd", chunks["zstd"]),
                ("c decode", "lz4", chunks["lz4"]),
            ]
        else:  # the Python codecs: a call per plan
            assert [e[1] for e in decodes] == ["Zstd", "Zstd", "LZ4"]
    executor.close()


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_a_file_changed_under_a_joint_read_is_named_by_its_own_array(tmp_path, monkeypatch, reads):
    """The reads of a window's plans are in flight together (one pool for the pinned reads):
    a chunk file of the second array cut short after planning is named by that array and
    chunk, whichever plan's read finds it."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    cuda = _executor_device(monkeypatch, [], "faked", reads, "c")
    values, ids = _joint_readers(tmp_path)[:2]
    jobs = []
    for reader in (values, ids):
        plan = plan_rows(reader, np.array([[0, 400]]))
        jobs.append((plan, reader, _unset(cuda, plan.out_shape, plan.dtype)))
    chunk = tmp_path / "ids.zarr" / "c" / "5"
    chunk.write_bytes(chunk.read_bytes()[:10])
    executor = GpuPlanExecutor(0)
    with pytest.raises(ChunkReadError, match=r"ids: chunk 'c/5'.*rewritten since"):
        executor.run_many(jobs)
    executor.close()


def _undecodable_zstd_frame(content_nbytes: int) -> bytes:
    """A zstd frame whose header and block headers are sound (content size
    ``content_nbytes`` < 256, one last compressed block) but whose block is not: the frame
    checks pass it to the decoder, which fails."""
    block = bytes([0xFF]) * 16
    head = ((len(block) << 3) | (2 << 1) | 1).to_bytes(3, "little")  # last, compressed
    return b"\x28\xb5\x2f\xfd" + bytes([0x20, content_nbytes]) + head + block


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_a_chunk_nvcomp_fails_in_a_joint_call_is_named_by_its_own_array(
    tmp_path, monkeypatch, reads
):
    """The chunks of two zstd arrays decode in one C API call; a chunk of the second whose
    status comes back failed is named by that array and chunk, not by the first array or
    by its place in the call."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    _fake_nvcomp_c_api(monkeypatch, log)
    values, ids = _joint_readers(tmp_path)[:2]
    bad = _undecodable_zstd_frame(SHAPES["1d-int32"][2][0] * 4)
    (tmp_path / "ids.zarr" / "c" / "3").write_bytes(bad)
    ids = open_reader(zarr.open_array(tmp_path / "ids.zarr", mode="r"), name="ids")
    jobs = []
    for reader in (values, ids):
        plan = plan_rows(reader, np.array([[0, 400]]))
        jobs.append((plan, reader, _unset(_Cuda("faked"), plan.out_shape, plan.dtype)))
    executor = GpuPlanExecutor(0)
    with pytest.raises(ChunkReadError, match=r"ids: chunk 'c/3'.*nvCOMP status 12"):
        executor.run_many(jobs)
    assert [e for e in log if e[0] == "c decode"] == [
        ("c decode", "zstd", len(jobs[0][0].reads) + len(jobs[1][0].reads))
    ]
    executor.close()


def test_a_shard_swapped_for_a_pipe_after_planning_is_refused_before_kvikio_opens_it(
    tmp_path, kvikio_executor_device
):
    """kvikio's open of a named pipe waits for a writer: a shard replaced by one after its
    window was planned is refused by a look at the path first, naming the chunk."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    v1, _, _, _ = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    plan = plan_rows(reader, np.array([[10, 40]]))
    shard.unlink()
    os.mkfifo(shard)
    executor = GpuPlanExecutor(0)
    out = kvikio_executor_device.empty(plan.out_shape, plan.dtype)
    raised = raised_by_a_read_of(lambda: executor.run(plan, reader, out), shard)
    assert isinstance(raised, ChunkReadError), raised
    assert re.search(r"^s: .*opening failed \(it is not a regular file", str(raised)), raised
    executor.close()


def test_a_kvikio_read_that_raises_at_end_of_file_names_the_chunk_there(
    tmp_path, monkeypatch, kvikio_executor_device
):
    """kvikio raises at end of file ("POSIX error on pread: EOF") instead of reading short;
    the error named the extent's first chunk, not the one where the shrunken file ends."""
    import sys

    from dali_zarr.io.gpu import GpuPlanExecutor

    device = kvikio_executor_device
    if device.kind == "faked":
        cufile = sys.modules["kvikio"].CuFile
        short_read = cufile.pread

        def pread(self, buf, size, offset):  # the future raises, as kvikio's does
            got = short_read(self, buf, size, offset).get()

            def get():
                if got < size:
                    raise RuntimeError("POSIX error on pread: EOF")
                return got

            return types.SimpleNamespace(get=get)

        monkeypatch.setattr(cufile, "pread", pread)
    data = np.arange(64 * 40, dtype=np.float32).reshape(640, 4)
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 4), shards=(160, 4),
                compressors=compressors("zstd", 3))  # fmt: skip
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[20, 160]]))  # one extent, chunks 2..15
    intact = plan_rows(reader, np.array([[20, 40]]))  # chunks 2, 3 of shard 0 (see below)
    cut = int(plan.reads["file_offset"][plan.reads["chunk"] == 5][0]) + 3
    with open(plan.files[0], "r+b") as f:
        f.truncate(cut)
    executor = GpuPlanExecutor(0, max_open_files=2)
    out = device.empty(plan.out_shape, plan.dtype)
    # the file's size is compared with the planned one before any read
    with pytest.raises(
        ChunkReadError, match=r"array chunk \(5, 0\).*is \d+ bytes, \d+ when its reads were planned"
    ):
        executor.run(plan, reader, out)
    # truncated between that look and the read: the real kvikio may raise or read short,
    # either names the chunk where the file ends
    plan = replace(plan, file_stamp=_stamps_now(plan))
    with pytest.raises(
        ChunkReadError, match=r"array chunk \(5, 0\).*(kvikio read failed.*EOF|file shrank)"
    ):
        executor.run(plan, reader, out)
    if device.kind == "faked":
        # a read failing on an intact file (EIO) names the extent's first chunk, not its
        # last (planned before the cut, the file's size as read: planned after it, the
        # changed file is indexed anew)
        intact = replace(intact, file_stamp=_stamps_now(intact))
        monkeypatch.setattr(cufile, "pread", lambda *a: types.SimpleNamespace(get=_eio))
        with pytest.raises(ChunkReadError, match=r"array chunk \(2, 0\).*kvikio read failed.*EIO"):
            executor.run(intact, reader, device.empty(intact.out_shape, intact.dtype))

        def pread_at_once(self, buf, size, offset):  # kvikio 26.10 on a small extent
            got = short_read(self, buf, size, offset).get()
            if got < size:
                raise RuntimeError("POSIX error on pread: EOF")
            return types.SimpleNamespace(get=lambda: got)

        # the H200 run of 2026-11-27: kvikio raised in pread itself, past the translation
        monkeypatch.setattr(cufile, "pread", pread_at_once)
        with pytest.raises(ChunkReadError, match=r"array chunk \(5, 0\).*kvikio read failed.*EOF"):
            executor.run(plan, reader, out)
    executor.close()


def test_a_chunk_forgotten_by_another_thread_while_located_is_not_read_as_fill(tmp_path):
    """The GPU path's read threads share each array's reader. One window's failed read
    forgets the chunks that changed (``forget_changed_chunks``) while another window's plan
    locates its chunks: between the stat of its unseen chunks and its look at the cache,
    a chunk it had cached was forgotten, and the plan read that stored chunk as the fill
    value, without an error. A plan now uses the sizes it found, not the cache again."""
    data = np.arange(40 * 16, dtype=np.float32).reshape(40, 16) + 1  # no fill values
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 16), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="a")
    plan_rows(reader, np.array([[0, 10]]))  # chunk 0's size cached
    new = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32)
    zarr.open_array(tmp_path / "a.zarr", mode="r+")[0:10] = new  # chunk 0: another size
    stat_chunks = reader._stat_chunks

    def other_thread_forgets_meanwhile(chunks):
        found = stat_chunks(chunks)
        reader.forget_changed_chunks()  # another window's failed read, on another thread
        return found

    reader._stat_chunks = other_thread_forgets_meanwhile
    plan = plan_rows(reader, np.array([[0, 20]]))  # chunk 0 cached, chunk 1 not yet
    assert plan.fill_slots == ()
    # planned with chunk 0's old size (the cache as it was): the read refuses it, and the
    # window reader plans again (files_changed), as for any chunk rewritten before a read
    with pytest.raises(ChunkReadError, match=r"a: chunk 'c/0/0'.*when its reads were planned"):
        execute_plan_cpu(plan, reader)
    reader._stat_chunks = stat_chunks
    got = execute_plan_cpu(plan_rows(reader, np.array([[0, 20]])), reader)
    np.testing.assert_array_equal(got.reshape(20, 16), np.r_[new, data[10:20]])


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_a_chunk_grown_since_planned_is_refused_before_its_cut_frame_is_decoded(
    tmp_path, monkeypatch, kvikio_executor_device, reads
):
    """Unsharded chunk sizes are cached: values rewritten in place (zarr writes a new file of
    another size) left a plan reading the grown file's first bytes, a zstd frame cut short.
    nvCOMP decoded such frames to garbage without an error (the H200 run of 2026-11-27: a
    collection's rewritten plate read NaNs); each read path now compares the file's size
    with the planned one, and the plan made after ``forget_changed_chunks`` reads the new
    values."""
    from dali_zarr.io.gpu import READS_ENV, GpuPlanExecutor

    monkeypatch.setenv(READS_ENV, reads)
    device = kvikio_executor_device
    data = np.arange(40 * 16, dtype=np.float32).reshape(40, 16)
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 16), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="a")
    whole = np.array([[0, 40]])
    plan = plan_rows(reader, whole)
    new = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32)
    zarr.open_array(tmp_path / "a.zarr", mode="r+")[20:30] = new  # incompressible: grows
    planned = int(plan.reads["nbytes"][plan.reads["chunk"] == 2][0])
    assert os.path.getsize(tmp_path / "a.zarr" / "c" / "2" / "0") > planned
    executor = GpuPlanExecutor(0, max_open_files=2)
    assert executor.reads == reads
    out = device.empty(plan.out_shape, plan.dtype)
    grown = r"a: chunk 'c/2/0'.*its file is \d+ bytes, \d+ when its reads were planned"
    with pytest.raises(ChunkReadError, match=grown):
        executor.run(plan, reader, out)
    with pytest.raises(ChunkReadError, match=grown):  # the host backend's reads
        execute_plan_cpu(plan, reader)
    assert reader.forget_changed_chunks()
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(device.host(out), np.r_[data[:20], new, data[30:]])
    executor.close()


def _stamps_now(plan):
    """``plan``'s files as they are now: a plan made after a change, which its reads take."""
    return np.array([stamp_of(os.stat(path)) for path in plan.files], FILE_STAMP)


def _eio():
    raise OSError(5, "EIO")


def test_a_chunk_file_gone_since_planned_names_the_chunk(tmp_path, kvikio_executor_device):
    """zarr deletes a chunk file whose values are all set to the fill value. Opening it with
    kvikio raised kvikio's own error, naming no array and no chunk, so the window reader
    could not tell it from any other failure (it plans again where chunk files changed)."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    device = kvikio_executor_device
    data = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    arr = write(tmp_path / "a.zarr", data, chunks=(10, 4), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[0, 40]]))
    os.remove(tmp_path / "a.zarr" / "c" / "2" / "0")
    executor = GpuPlanExecutor(0, max_open_files=2)
    try:
        with pytest.raises(ChunkReadError, match=r"a: chunk 'c/2/0'.*opening failed"):
            executor.run(plan, reader, device.empty(plan.out_shape, plan.dtype))
    finally:
        executor.close()


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_shard_rewritten_under_the_executor_is_read_from_the_new_file(
    tmp_path, codec, kvikio_executor_device
):
    """zarr rewrites a shard by writing a new file and renaming it over the old one. The
    reader re-reads the changed shard's index; the executor's kvikio handle, kept by path,
    read the old file at the new offsets: stale rows (uncompressed), or frames cut at the
    wrong bytes. The CPU executor, which opens each file per read, was right."""
    import zarr

    from dali_zarr.io.gpu import GpuPlanExecutor

    device = kvikio_executor_device
    old = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    arr = write(tmp_path / "a.zarr", old, chunks=(8, 4), shards=(64, 4),
                compressors=compressors(codec, 3) if codec != "none" else None)  # fmt: skip
    reader = open_reader(arr, name="a")
    executor = GpuPlanExecutor(0)
    whole = np.array([[0, 64]])
    out = device.empty(old.shape, old.dtype)
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(device.host(out), old)
    want = old.copy()
    want[:32] = -old[32:][::-1]
    zarr.open_array(str(tmp_path / "a.zarr"), mode="r+")[:32] = want[:32]  # a new shard file
    plan = plan_rows(reader, whole)
    np.testing.assert_array_equal(execute_plan_cpu(plan, reader), want)
    executor.run(plan, reader, out)
    np.testing.assert_array_equal(device.host(out), want)
    executor.close()


@pytest.mark.parametrize(
    ("reads", "when"),
    [("kvikio", "before the read"), ("pinned", "before the read"), ("kvikio", "as it is opened")],
)
def test_a_shard_rewritten_at_the_same_size_since_planned_is_refused_then_planned_anew(
    tmp_path, monkeypatch, kvikio_executor_device, reads, when
):
    """A byte plan carried each file's size only. A shard rewritten since it was planned, at
    the same size, holds its chunks at other offsets: the plan read rows 10-29 as other
    chunks' values without an error. And a kvikio handle took its file's size from a stat
    of the path before the open, so a file renamed over the path in between passed as the
    planned one. Each read now compares the file it opened (inode, modification time, size)
    with the planned one, and the window reader plans again where files changed."""
    import kvikio  # the stand-in where kvikio_executor_device installed one

    from dali_zarr.io.gpu import READS_ENV, GpuPlanExecutor

    monkeypatch.setenv(READS_ENV, reads)
    device = kvikio_executor_device
    v1, _, v2, want = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    rows = np.array([[10, 40]])
    plan = plan_rows(reader, rows)

    def rewrite() -> None:  # what zarr does: a new file renamed over the shard
        shutil.copyfile(v2 / "c" / "0" / "0", tmp_path / "next")
        os.replace(tmp_path / "next", shard)

    open_file = kvikio.CuFile

    def rewritten_as_opened(path, mode):  # how the executor opens files
        rewrite()
        return open_file(path, mode)

    if when == "as it is opened":
        monkeypatch.setattr(kvikio, "CuFile", rewritten_as_opened)
    else:
        rewrite()
    executor = GpuPlanExecutor(0)
    assert executor.reads == reads
    out = device.empty(plan.out_shape, plan.dtype)
    same = (
        r"s: inner chunk \(1, 0\).*its file was replaced or rewritten since its reads were "
        r"planned \(the same 548 bytes.*Another process is writing the array"
    )
    with pytest.raises(ChunkReadError, match=same):
        executor.run(plan, reader, out)
    if when == "before the read":
        with pytest.raises(ChunkReadError, match=same):  # the host backend's reads
            execute_plan_cpu(plan, reader)
    assert files_changed(plan)  # so the window reader plans again
    monkeypatch.setattr(kvikio, "CuFile", open_file)
    plan = plan_rows(reader, rows)
    assert not files_changed(plan)
    executor.run(plan, reader, out)
    np.testing.assert_array_equal(device.host(out), want[10:40])
    executor.close()


def test_a_shard_renamed_over_between_kvikios_two_opens_is_not_read_at_planned_offsets(
    tmp_path, monkeypatch
):
    """kvikio's CuFile opens its path twice: ``fileno()`` is the first descriptor, and with
    GDS its reads go through the second (O_DIRECT, registered with cuFile). The executor
    stamped a new handle through ``fileno()`` only, so a shard renamed over the path between
    the two opens passed as the planned file while its reads came from the new one: rows
    10-29 were other chunks' values, without an error. A handle whose path no longer holds
    the file it stamped is opened again; the plan's reads are then refused, and a plan made
    anew reads the new values."""
    from dali_zarr.io.gpu import READS_ENV, GpuPlanExecutor

    _fake_cuda_modules(monkeypatch, [], "kvikio")
    monkeypatch.setenv(READS_ENV, "kvikio")
    import kvikio  # the stand-in

    v1, _, v2, want = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    rows = np.array([[10, 40]])
    plan = plan_rows(reader, rows)
    opened: list[str] = []

    class TwoDescriptors(kvikio.CuFile):  # as kvikio's: fileno() is not the one read
        def __init__(self, path, mode):
            super().__init__(path, mode)
            if not opened:  # a writer renames a new shard over the path, once
                shutil.copyfile(v2 / "c" / "0" / "0", tmp_path / "next")
                os.replace(tmp_path / "next", shard)
            opened.append(path)
            self.direct = os.open(path, os.O_RDONLY)

        def pread(self, buf, size, offset):
            got = os.preadv(self.direct, [buf], offset)
            return types.SimpleNamespace(get=lambda: got)

        def close(self):
            os.close(self.direct)
            super().close()

    monkeypatch.setattr(kvikio, "CuFile", TwoDescriptors)
    executor = GpuPlanExecutor(0)
    out = _Cuda("faked").empty(plan.out_shape, plan.dtype)
    with pytest.raises(ChunkReadError, match=r"s: inner chunk \(1, 0\).*replaced or rewritten"):
        executor.run(plan, reader, out)
    assert files_changed(plan)  # so the window reader plans again
    plan = plan_rows(reader, rows)
    executor.run(plan, reader, out)
    np.testing.assert_array_equal(np.asarray(out), want[10:40])
    executor.close()


def test_a_closed_executor_refuses_a_plan_and_opens_no_file(
    tmp_path, monkeypatch, kvikio_executor_device
) -> None:
    """A reader thread still running when the loader closed went on to a plan on the closed
    executor and opened kvikio files (and codecs) again, which nothing closed."""
    import kvikio  # the stand-in where kvikio_executor_device installed one

    from dali_zarr.io.gpu import GpuPlanExecutor

    device = kvikio_executor_device
    opened: list[str] = []
    open_file = kvikio.CuFile

    def cufile(path, mode):  # how the executor opens files: kvikio.CuFile(path, "r")
        opened.append(path)
        return open_file(path, mode)

    monkeypatch.setattr(kvikio, "CuFile", cufile)
    data = np.arange(64, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(8,), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="a")
    executor = GpuPlanExecutor(0)
    out = device.empty(data.shape, data.dtype)
    executor.run(plan_rows(reader, np.array([[0, 64]])), reader, out)
    np.testing.assert_array_equal(device.host(out), data)
    n_opened = len(opened)
    executor.close()
    with pytest.raises(RuntimeError, match="a: this GPU executor was closed"):
        executor.run(plan_rows(reader, np.array([[0, 64]])), reader, out)
    assert len(opened) == n_opened and n_opened > 0


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_runs_a_joint_plan_with_faked_cuda(tmp_path, monkeypatch, reads):
    """A collection window's joint plan through GpuPlanExecutor.run (NumPy stand-ins for
    cupy, kvikio and nvCOMP): every store's extents read, one decode call for all of their
    chunks, the rows of each store at their places; a bad frame names its own store."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    rng = np.random.default_rng(5)
    items, n_rows, want = _collection_window(tmp_path, [("zstd", True), ("zstd", False)] * 2, rng)
    [(plan, reader)], _ = window_plans(items, out_rows=n_rows)
    executor = GpuPlanExecutor(0, max_open_files=3)
    out = np.full(plan.out_shape, np.nan, plan.dtype).view(_Dev)
    assert executor.run(plan, reader, out) is out
    np.testing.assert_array_equal(out, want)
    if reads == "kvikio":
        assert sorted(e[1] for e in log if e[0] == "pread") == sorted(
            n for r, ranges, _ in items for n in plan_rows(r, ranges).extents["nbytes"].tolist()
        )
    assert [e for e in log if e[0] == "decode"] == [("decode", "Zstd", len(plan.reads))]
    path = tmp_path / "s3.zarr" / "c" / "4"
    raw = bytearray(path.read_bytes())
    raw[:4] = b"\xff" * 4
    path.write_bytes(bytes(raw))
    with pytest.raises(ChunkReadError, match=r"s3.zarr/x: chunk 'c/4'"):
        executor.run(plan, reader, out)
    executor.close()


def _zstd_array_read_whole(tmp_path, n_values: int):
    """A zstd array of ``n_values`` float32 counts in chunks of 1,024, read whole by a
    GpuPlanExecutor (run with the stand-ins active) and checked against what was written:
    ``(data, reader, executor, plan, out)``."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    data = np.random.default_rng(0).poisson(2, n_values).astype(np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=compressors("zstd", 3))
    reader = open_reader(arr, name="arr")
    executor = GpuPlanExecutor(0)
    plan = plan_rows(reader, np.array([[0, data.size]]))
    out = np.full(plan.out_shape, np.nan, plan.dtype).view(_Dev)
    assert executor.run(plan, reader, out) is out
    np.testing.assert_array_equal(out, data)
    return data, reader, executor, plan, out


def test_a_c_api_that_does_not_load_falls_back_to_the_python_codecs(tmp_path, monkeypatch):
    """The C API is the default, so a machine whose libnvcomp lacks it (or fails to load)
    decodes with nvCOMP's Python codecs (here the stand-in) instead of failing in the first
    window, and ``read_paths()`` says why."""
    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import GpuSupport, describe_path

    log: list = []
    _fake_cuda_modules(monkeypatch, log, "kvikio")
    monkeypatch.delenv(nvcomp_batched.ENV_SWITCH)  # the default: the C API asked for

    def missing(kind):
        raise AttributeError(f"libnvcomp.so.5: undefined symbol nvcompBatched{kind}Decompress")

    monkeypatch.setattr(nvcomp_batched, "functions", missing)
    nvcomp_batched.load_error.cache_clear()
    try:
        _, _, executor, plan, _ = _zstd_array_read_whole(tmp_path, 8 * 1024)
        assert [e for e in log if e[0] == "decode"] == [("decode", "Zstd", len(plan.reads))]
        executor.close()
        support = GpuSupport(True, True, True, False, True, "")
        line = describe_path("zstd", "", support)
        assert "nvCOMP zstd (Python API: the C API did not load (AttributeError: " in line
        monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "0")
        assert describe_path("zstd", "", support).endswith(
            "(Python API, DALI_ZARR_NVCOMP_BATCHED=0)"
        )
    finally:
        monkeypatch.undo()
        nvcomp_batched.load_error.cache_clear()


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_gpu_executor_checks_frames_first_and_caps_decode_calls(tmp_path, monkeypatch, reads):
    """With the same stand-ins: nvCOMP gets a window in calls of at most CALL_NBYTES decoded
    bytes, and a chunk that is not a zstd frame is named before nvCOMP sees any chunk."""
    from dali_zarr.io import nvcomp_batched

    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    monkeypatch.setattr(nvcomp_batched, "CALL_NBYTES", 3 * 4096)  # three 4 KiB chunks a call
    data, reader, executor, _, out = _zstd_array_read_whole(tmp_path, 16 * 1024)
    assert [e[2] for e in log if e[0] == "decode"] == [3, 3, 3, 3, 3, 1]

    (tmp_path / "a.zarr" / "c" / "5").write_bytes(numcodecs.GZip().encode(data[:1024]))
    assert reader.forget_changed_chunks()  # as the window reader does on a changed size
    log.clear()
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/5'.*not a zstd frame"):
        executor.run(plan_rows(reader, np.array([[0, data.size]])), reader, out)
    assert not [e for e in log if e[0] == "decode"]
    executor.close()


def _streamed_zstd(values: np.ndarray) -> bytes:
    """``values`` as a zstd frame whose header records no content size (as a streaming
    writer makes it; zarr and numcodecs always record it)."""
    import zstandard

    return zstandard.ZstdCompressor(write_content_size=False).compress(values.tobytes())


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_frames_without_a_content_size_are_decoded_on_the_host(tmp_path, monkeypatch, reads):
    """nvCOMP cannot check a frame that records no content size against the chunk's size
    (a corrupted one made it read out of bounds on the H200): the executor decodes such
    frames on the host, where a frame of another size, or no frame at all, is named, and
    gives nvCOMP the others."""
    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    data, reader, executor, _, out = _zstd_array_read_whole(tmp_path, 8 * 1024)
    chunk5 = tmp_path / "a.zarr" / "c" / "5"
    whole = np.array([[0, data.size]])
    chunk5.write_bytes(_streamed_zstd(data[5120:6144]))
    assert reader.forget_changed_chunks()
    log.clear()
    out[...] = np.nan
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(out, data)
    assert [e[2] for e in log if e[0] == "decode"] == [7]  # nvCOMP: every chunk but c/5
    # the H200's crash: empty blocks to the end of the stored bytes. The device walk finds
    # no last block; the host walk of pinned reads gives up first, and numcodecs refuses it
    crash = "zstd frame cut short" if reads == "kvikio" else "zstd decoding failed"
    for stored, why, host_why in [
        (_streamed_zstd(data[5120:6000]), *["expected to decompress 4096, got 3520"] * 2),
        (b"\x28\xb5\x2f\xfd" + b"\x00" * 40, crash, "zstd decoding failed"),
    ]:
        chunk5.write_bytes(stored)
        assert reader.forget_changed_chunks()
        with pytest.raises(ChunkReadError, match=rf"arr: chunk 'c/5'.*{why}"):
            executor.run(plan_rows(reader, whole), reader, out)
        with pytest.raises(ChunkReadError, match=rf"arr: chunk 'c/5'.*{host_why}"):
            execute_plan_cpu(plan_rows(reader, whole), reader)  # the host backend
    executor.close()


def _zstd_frames() -> list[tuple[int, bytes]]:
    """``(decoded bytes, frame)``: numcodecs' frames with and without a checksum, of raw,
    RLE and compressed blocks, one block or several, and a streaming writer's."""
    import zstandard

    rng = np.random.default_rng(0)
    out = []
    for n in (1_000, 300_000):
        for data in (np.zeros(n, np.uint8), rng.integers(0, 255, n, np.uint8)):
            out.append((n, numcodecs.Zstd().encode(data)))
            out.append((n, numcodecs.Zstd(checksum=True).encode(data)))
            out.append((n, zstandard.ZstdCompressor(write_content_size=False).compress(data)))
    return out


def _frame_end(frame: bytes, nbytes: int, max_blocks: int) -> int:
    """:func:`zstd_frame_ends` of ``frame`` stored in its first ``nbytes`` bytes."""
    buf = np.frombuffer(frame, np.uint8)
    head = np.frombuffer(frame[:FRAME_HEAD_NBYTES].ljust(FRAME_HEAD_NBYTES, b"\0"), np.uint8)
    first, checksum = zstd_walk_from(head[None])
    return int(zstd_frame_ends(buf, [0], [nbytes], first, checksum, max_blocks)[0])


def test_zstd_frame_ends_walks_every_block_and_finds_a_cut_frame():
    """A frame's header records what it decodes to, not what it is stored in: the block
    headers say where it ends, at the stored size for a whole frame and past it for one
    cut short anywhere (in a block, a block header or its checksum)."""
    for n, frame in _zstd_frames():
        limit = zstd_block_walk_limit(n)
        assert _frame_end(frame, len(frame), limit) == len(frame)
        for cut in {len(frame) - 1, len(frame) - 3, len(frame) - 4, len(frame) // 2, 12}:
            end = _frame_end(frame, cut, limit)
            assert end == -1 or end > cut, (n, len(frame), cut, end)
        if n > 200_000:  # several blocks: not walked to the end within one
            assert _frame_end(frame, len(frame), 1) == -2


@pytest.mark.parametrize("reads", ["kvikio", "pinned"])
def test_a_truncated_zstd_chunk_is_named_before_nvcomp_gets_it(tmp_path, monkeypatch, reads):
    """A chunk file cut short (an interrupted copy) is planned at the size it has, so the
    size check of rewrites does not see it, and its frame header is intact: nvCOMP decoded
    such a frame to garbage without an error on the H200 (2026-11-27). Its block headers
    now show it ends past its stored bytes, and the chunk is named before any decode; a
    frame of too many blocks to walk is decoded on the host (numcodecs checks it)."""
    import zstandard

    log: list = []
    _fake_cuda_modules(monkeypatch, log, reads)
    data, reader, executor, _, out = _zstd_array_read_whole(tmp_path, 8 * 1024)
    chunk5 = tmp_path / "a.zarr" / "c" / "5"
    whole = np.array([[0, data.size]])
    values = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
    frame = numcodecs.Zstd().encode(values)  # incompressible: ~4 KiB stored
    chunk5.write_bytes(frame[:-100])  # cut short, its header intact
    assert reader.forget_changed_chunks()
    log.clear()
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/5'.*zstd frame cut short"):
        executor.run(plan_rows(reader, whole), reader, out)
    assert not [e for e in log if e[0] == "decode"]  # nothing reached nvCOMP
    # one block per 64 bytes: the device walks every block; the host walk of pinned reads
    # gives up after a 4 KiB chunk's limit, and that chunk is decoded on the host
    writer = zstandard.ZstdCompressor().compressobj(size=4096)
    values = data[5120:6144].tobytes()
    blocks = [writer.compress(values[i : i + 64]) + writer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
              for i in range(0, 4096, 64)]  # fmt: skip
    chunk5.write_bytes(b"".join(blocks) + writer.flush())
    assert reader.forget_changed_chunks()
    log.clear()
    out[...] = np.nan
    executor.run(plan_rows(reader, whole), reader, out)
    np.testing.assert_array_equal(out, data)
    on_nvcomp = 7 if reads == "pinned" else 8
    assert [e[2] for e in log if e[0] == "decode"] == [on_nvcomp]
    assert [e for e in log if e[0] == "frame ends"] == (
        [] if reads == "pinned" else [("frame ends", 8)]
    )
    executor.close()


def test_kvikio_pool_is_raised_but_never_lowered_or_overridden(monkeypatch):
    """kvikio's pool (1 thread by default) is raised for the GPU path, through kvikio's own
    config API (a stand-in here: kvikio needs libcuda to import)."""
    import sys
    import types

    from dali_zarr.io.gpu import kvikio_threads

    config = {"num_threads": 1}
    defaults = types.ModuleType("kvikio.defaults")
    defaults.get = config.__getitem__
    defaults.set = config.__setitem__
    kvikio = types.ModuleType("kvikio")
    kvikio.defaults = defaults
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    assert kvikio_threads() == 1
    assert kvikio_threads(8) == 8 and config["num_threads"] == 8
    assert kvikio_threads(4) == 8  # never lowered
    config["num_threads"] = 2
    monkeypatch.setenv("KVIKIO_NTHREADS", "2")  # the user's choice stands
    assert kvikio_threads(8) == 2
    monkeypatch.delitem(sys.modules, "kvikio.defaults")
    monkeypatch.setitem(sys.modules, "kvikio", None)  # not installed
    assert kvikio_threads(8) == 0


def test_kvikio_readers_raise_the_soft_limit_of_open_files():
    """Reader threads' kvikio files of an unsharded store outgrow a soft limit of 1,024; the
    executor raises it (to at most the hard limit) before its first read."""
    import resource

    from dali_zarr.io.gpu import OPEN_FILES_WANTED, room_for_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        now = room_for_open_files.__wrapped__()
        want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
        assert now == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_chunks_wider_than_the_array_name_the_padding(tmp_path):
    """A chunk wider than the array (zarr keeps chunks=(8, 10) on a 7-wide array, padding
    each chunk's row) holds each row contiguously; the GPU path still reads it on the host,
    and its note must say why (the rows are spaced by the chunk's width), not that a row
    is split across chunks, which would send the user chunking along the wrong axis."""
    data = np.zeros((40, 7), dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(8, 10))
    with pytest.raises(NotPlannable) as info:
        plan_rows(open_reader(arr, name="a"), np.array([[0, 8]]))
    message = str(info.value)
    assert "do not span" not in message, message
    assert "wider than the array's trailing axes (7,)" in message, message
    assert "chunks=(N, 7)" in message, message


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("joint", ["1", "0"])
def test_the_cuda_backend_reads_a_collections_windows_with_joint_plans(
    tmp_path, monkeypatch, joint, device
):
    """``DeviceWindowReader`` on the CUDA backend, cupy, kvikio and nvCOMP's C API standing
    in: windows of a collection of four CSR stores written differently (zstd of two chunk
    sizes, lz4 unsharded, blosc, decoded on the host) come out as the host backend reads
    them. Each store's ``data`` and ``indices`` is its own byte plan (eight a window); with
    ``DALI_ZARR_JOINT_PLANS=1`` (the default) a window is one decode call per codec kind
    (zstd, lz4), with ``0`` one call per plan nvCOMP decodes (the way before)."""
    import dali_zarr as dz
    from dali_zarr.graph import window_backends
    from dali_zarr.graph.device_window import DeviceWindowReader
    from dali_zarr.io import gpu
    from dali_zarr.synthetic import make_single_cell

    log: list = []
    cuda = _executor_device(monkeypatch, log, device, "kvikio", "c")
    monkeypatch.setenv(window_backends.JOINT_PLANS_ENV, joint)
    if device == "faked":
        monkeypatch.setattr(window_backends, "probe_gpu", gpu.probe_gpu)  # the stand-in's
        import cupy  # the stand-in

        cupy.stack = lambda arrays: np.stack(arrays).view(_Dev)
    written = [  # (codec, elements a chunk, chunks a shard, zarr format)
        ("zstd", 256, 32, 3), ("zstd", 100, None, 3), ("lz4", 128, None, 2),
        ("blosc", 256, 8, 3),
    ]  # fmt: skip
    parts, codec_of = [], {}
    for i, (codec, chunk, shard, fmt) in enumerate(written):
        path = tmp_path / f"{i}.zarr"
        make_single_cell(path, n_obs=150, n_features=60, codec=codec, chunk_elements=chunk,
                         shard_chunks=shard, zarr_format=fmt, seed=i)  # fmt: skip
        parts.append(dz.open_dataset(path))
        codec_of[id(parts[-1])] = codec
    ds = dz.Collection(parts)
    device = DeviceWindowReader(ds, window_backends.CudaBackend(0))
    host = DeviceWindowReader(ds, window_backends.HostBackend())
    rng = np.random.default_rng(11)
    for _ in range(3):
        starts = rng.choice(np.arange(0, ds.n_obs - 20, 20), size=12, replace=False)
        ranges = np.stack([starts, starts + rng.integers(1, 20, size=12)], axis=1)  # shuffled
        log.clear()
        window = device.layout(ranges)
        got, got_indptr = device.read(window, device.backend.alloc(window.nbytes))
        want, want_indptr = host.read(host.layout(ranges), host.backend.alloc(window.nbytes))
        np.testing.assert_array_equal(got_indptr, want_indptr)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(cuda.host(a), b)
        if device == "real":
            continue
        touched = [codec_of[id(store)] for store, _, _ in window.by_store]
        kinds = [e[1] for e in log if e[0] == "c decode"]
        if joint == "1":  # a call per kind the window touches
            assert sorted(kinds) == sorted({"zstd", "lz4"} & set(touched)), (kinds, touched)
        else:  # a call per array of each nvCOMP-decoded store the window touches
            assert len(kinds) == 2 * sum(c != "blosc" for c in touched), (kinds, touched)
