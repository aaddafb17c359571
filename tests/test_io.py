"""Tests of dali_zarr.io: layout parsing, chunk decoding and the two row readers.

Every store here is written by zarr-python (one by anndata) into tmp_path; results are
compared with plain numpy slicing of the source data.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import re
import shutil
import stat
import struct
import threading
import warnings
from pathlib import Path

import crc32c
import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    ShardingCodec,
    TransposeCodec,
    ZstdCodec,
)
from zarr.codecs import numcodecs as znc

import dali_zarr as dz
from dali_zarr.errors import ChunkReadError, DatasetError
from dali_zarr.io import DirectReader, ZarrReader, open_reader, parse_layout
from dali_zarr.io import codecs as codecs_mod
from dali_zarr.io import readers as readers_mod
from tests.stores import (
    compressors,
    make_data,
    raised_by_a_read_of,
    random_ranges,
    same_size_shards,
    write,
    write_layout,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # zarr's numcodecs-in-v3 notes


# ---------------------------------------------------------------------------- helpers


KINDS = {
    # name: (shape, dtype, chunks, shards)
    "1d-int32": ((1037,), "int32", (64,), (256,)),
    "1d-float32": ((1037,), "float32", (64,), (256,)),
    "2d-float32": ((203, 7), "float32", (16, 4), (64, 8)),
    "4d-float32": ((45, 8, 18, 36), "float32", (8, 4, 9, 36), (16, 8, 18, 36)),
    # chunks span the other axes whole (or overhang them)
    "2d-rowchunks": ((203, 7), "float32", (16, 7), (64, 7)),
    "2d-overhang": ((203, 7), "int32", (16, 8), (64, 8)),
}


def expected(data: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    return np.concatenate([data[s:e] for s, e in ranges])


def check_reader(reader, data: np.ndarray, seed: int = 1, rounds: int = 3) -> None:
    rng = np.random.default_rng(seed)
    assert reader.shape == data.shape
    assert reader.dtype == data.dtype.newbyteorder("=")
    for _ in range(rounds):
        ranges = random_ranges(rng, data.shape[0], reader.rows_per_chunk)
        got = reader.read_rows(ranges)
        assert got.dtype == reader.dtype
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, expected(data, ranges))
        out = np.full_like(got, -7)
        assert reader.read_rows(ranges, out=out) is out
        np.testing.assert_array_equal(out, got)


# ---------------------------------------------------------------------------- codec matrix

CODECS = ["zstd", "blosc-lz4", "blosc-zstd", "lz4", "gzip", "none"]
MATRIX = [
    (fmt, codec, kind, sharded)
    for fmt, sharded in [(2, False), (3, False), (3, True)]
    for codec in CODECS
    for kind in ["1d-int32", "1d-float32", "2d-float32"]
] + [
    (fmt, codec, kind, sh)
    for fmt, sh in [(2, False), (3, False), (3, True)]
    for codec, kind in [
        ("zstd", "4d-float32"),
        ("zstd", "2d-rowchunks"),
        ("none", "2d-rowchunks"),
        ("blosc-lz4", "2d-overhang"),
    ]
]


@pytest.mark.parametrize(
    ("fmt", "codec", "kind", "sharded"),
    MATRIX,
    ids=[f"v{f}-{c}-{k}{'-sharded' if s else ''}" for f, c, k, s in MATRIX],
)
def test_direct_matches_numpy(tmp_path, fmt, codec, kind, sharded):
    data, arr = write_layout(
        tmp_path / "a.zarr", KINDS[kind], fmt=fmt, codec=codec, sharded=sharded
    )
    reader = open_reader(arr, name="a")
    assert isinstance(reader, DirectReader)
    assert (reader.path, reader.reason) == ("direct", "")
    assert reader.rows_per_chunk == KINDS[kind][2][0]
    check_reader(reader, data)
    # the zarr fallback agrees
    check_reader(open_reader(arr, name="a", force_zarr=True), data)


EXTRA = {
    "v3-crc32c": dict(fmt=3, compressors="zstd-crc32c"),
    "v3-numcodecs-zstd-crc32c": dict(fmt=3, compressors="numcodecs-zstd-crc32c"),
    "v3-sharded-crc32c": dict(fmt=3, compressors="zstd-crc32c", sharded=True),
    # README's "Direct read path": numcodecs' other compressors are decoded there too
    "v2-zlib": dict(fmt=2, compressors="zlib"),
    "v2-bz2": dict(fmt=2, compressors="bz2"),
    "v2-lzma": dict(fmt=2, compressors="lzma"),
    "v2-bigendian": dict(fmt=2, compressors="zstd", dtype=">f4"),
    "v2-bigendian-int-none": dict(fmt=2, compressors="none", dtype=">i4"),
    "v3-bigendian": dict(fmt=3, compressors="blosc-lz4", serializer=BytesCodec(endian="big")),
    "v3-bigendian-none": dict(fmt=3, compressors="none", serializer=BytesCodec(endian="big")),
    "v3-sharded-bigendian": dict(
        fmt=3, compressors="zstd", sharded=True, serializer=BytesCodec(endian="big")
    ),
    "v2-order-F": dict(fmt=2, compressors="zstd", order="F"),
    "v2-slash-separator": dict(
        fmt=2, compressors="lz4", chunk_key_encoding={"name": "v2", "separator": "/"}
    ),
    "v3-v2-key-encoding": dict(
        fmt=3, compressors="zstd", chunk_key_encoding={"name": "v2", "separator": "."}
    ),
    "v2-delta-filter": dict(fmt=2, compressors="zstd", filters=[numcodecs.Delta(dtype="<i4")]),
    "v3-delta-filter": dict(fmt=3, compressors="zstd", filters="delta"),
}


@pytest.mark.parametrize("case", sorted(EXTRA))
def test_direct_layout_variants(tmp_path, case):
    opts = dict(EXTRA[case])
    fmt = opts.pop("fmt")
    codec = opts.pop("compressors")
    sharded = opts.pop("sharded", False)
    kind = "1d-int32" if "delta" in case or "int" in case else "2d-float32"
    if opts.get("filters") == "delta":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opts["filters"] = [znc.Delta(dtype="int32")]
    data, arr = write_layout(
        tmp_path / "a.zarr", KINDS[kind], fmt=fmt, codec=codec, sharded=sharded, **opts
    )
    reader = open_reader(arr, name="a")
    assert reader.path == "direct", reader.reason
    check_reader(reader, data)
    check_reader(open_reader(arr, name="a", force_zarr=True), data)


def test_shard_index_at_start(tmp_path):
    data = make_data((203, 7), "float32", 16, 64)
    arr = write(
        tmp_path / "a.zarr",
        data,
        chunks=(64, 8),
        serializer=ShardingCodec(
            chunk_shape=(16, 4), codecs=[BytesCodec(), ZstdCodec()], index_location="start"
        ),
    )
    lay = parse_layout(arr)
    assert lay.shard is not None and lay.shard.index_location == "start"
    reader = open_reader(arr, name="a")
    assert reader.path == "direct"
    check_reader(reader, data)


def test_layout_description(tmp_path):
    data = make_data((203, 7), "float32", 16, 64)
    arr = write(tmp_path / "a.zarr", data, chunks=(16, 4), shards=(64, 8), compressors=ZstdCodec())
    lay = parse_layout(arr)
    assert lay.grid_chunk_shape == (64, 8)
    assert lay.chunk_shape == (16, 4)
    assert lay.chunk_grid == (13, 2)
    assert lay.shard is not None
    assert lay.shard.chunks_per_shard == (4, 2)
    assert lay.shard.index_crc32c and lay.shard.index_nbytes == 8 * 16 + 4
    assert lay.key((1, 0)) == "c/1/0"
    assert [c["id"] for c in lay.codecs.bytes_codecs] == ["zstd"]
    assert lay.unsupported == ""


# ---------------------------------------------------------------------------- missing chunks


def test_missing_chunks_read_as_fill_value(tmp_path):
    # zarr skips chunks equal to the fill value; we also delete chunk files by hand
    n, C = 1000, 100
    data = np.arange(n, dtype=np.float32)
    data[200:300] = -1.5  # == fill value: never written
    v3 = write(tmp_path / "v3.zarr", data, chunks=(C,), compressors=ZstdCodec(), fill_value=-1.5)
    v2 = write(
        tmp_path / "v2.zarr",
        data,
        fmt=2,
        chunks=(C,),
        compressors=numcodecs.Zstd(),
        fill_value=-1.5,
    )
    sh = write(
        tmp_path / "sh.zarr",
        data,
        chunks=(50,),
        shards=(C,),
        compressors=ZstdCodec(),
        fill_value=-1.5,
    )
    assert not (tmp_path / "v3.zarr/c/2").exists()
    assert not (tmp_path / "v2.zarr/2").exists()
    assert not (tmp_path / "sh.zarr/c/2").exists()
    os.remove(tmp_path / "v3.zarr/c/5")
    os.remove(tmp_path / "v2.zarr/5")
    os.remove(tmp_path / "sh.zarr/c/5")  # a whole shard
    want = data.copy()
    want[500:600] = -1.5
    for arr in (v3, v2, sh):
        reader = open_reader(arr, name="a")
        assert reader.path == "direct"
        check_reader(reader, want)
        np.testing.assert_array_equal(reader.read_rows(np.array([[0, n]])), arr[:])


@pytest.mark.parametrize("written", ["/", "."])
def test_chunks_under_the_other_dimension_separator_are_refused(tmp_path, written):
    # zarr-python < 2.8's NestedDirectoryStore wrote 0/0 folders without recording "/" in
    # .zarray: zarr then reads every chunk as the fill value, without an error
    import json

    data = np.arange(40 * 6, dtype=np.float32).reshape(40, 6) + 1
    path = tmp_path / "a.zarr"
    enc = {"name": "v2", "separator": written}
    write(path, data, fmt=2, chunks=(10, 3), chunk_key_encoding=enc)
    meta = json.loads((path / ".zarray").read_text())
    said = meta["dimension_separator"] = "." if written == "/" else "/"
    if written == "/":
        del meta["dimension_separator"]  # as zarr < 2.8 wrote it: "." by default
    (path / ".zarray").write_text(json.dumps(meta))
    arr = zarr.open_array(str(path), mode="r")
    assert not arr[:].any()  # what zarr reads: all fill values
    for force_zarr in (False, True):
        with pytest.raises(
            DatasetError,
            match=rf"a\.zarr: its \.zarray says chunk keys look like '0{said}0'"
            rf".*separator '{written}'.*Add \"dimension_separator\": \"{written}\" to "
            rf".*a\.zarr/\.zarray",
        ):
            open_reader(arr, name="a.zarr", force_zarr=force_zarr)
    # the advice works
    meta["dimension_separator"] = written
    (path / ".zarray").write_text(json.dumps(meta))
    check_reader(open_reader(zarr.open_array(str(path), mode="r"), name="a"), data)
    # `zarr migrate v3` of such a store keeps its keys: format 3, chunk_key_encoding "v2"
    meta["dimension_separator"] = said
    (path / ".zarray").write_text(json.dumps(meta))
    from zarr.metadata.migrate_v3 import migrate_v2_to_v3

    migrate_v2_to_v3(input_store=str(path))
    assert json.loads((path / "zarr.json").read_text())["chunk_key_encoding"]["name"] == "v2"
    migrated = zarr.open_array(str(path), mode="r", zarr_format=3)
    assert not migrated[:].any()
    with pytest.raises(DatasetError, match=r"its zarr\.json says .*Set the chunk_key_encoding"):
        open_reader(migrated, name="a.zarr")
    # an array whose first chunks were never written (fill values) is not refused
    blank = write(tmp_path / "b.zarr", np.zeros((40, 6), np.float32), fmt=2, chunks=(10, 3))
    assert open_reader(blank, name="b").path == "direct"


@pytest.mark.parametrize("shape", [(40, 6), (40,)])
@pytest.mark.parametrize("written", ["/", "."])
def test_v3_default_keys_under_the_other_separator_are_refused(tmp_path, written, shape):
    # a v3 array's zarr.json naming "." while its chunks lie in c/0/0 (or "/" over c.0.0
    # files) read as fill values throughout, by zarr too: only v2-style keys were checked
    import json

    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    data[:10] = 0  # the first chunks are fill values, not stored: the listing tells
    path = tmp_path / "a.zarr"
    enc = {"name": "default", "separator": written}
    chunks = (10, 3)[: len(shape)]
    write(path, data, fmt=3, chunks=chunks, chunk_key_encoding=enc)
    assert (path / "c").is_dir() == (written == "/")
    meta = json.loads((path / "zarr.json").read_text())
    said = "." if written == "/" else "/"
    meta["chunk_key_encoding"]["configuration"]["separator"] = said
    (path / "zarr.json").write_text(json.dumps(meta))
    arr = zarr.open_array(str(path), mode="r")
    assert not arr[:].any()  # what zarr reads: all fill values
    key = said.join(["c", *["0"] * len(shape)])
    with pytest.raises(
        DatasetError,
        match=rf"a\.zarr: its zarr\.json says chunk keys look like '{re.escape(key)}'.*"
        rf"holds 'c{re.escape(written)}.*separator '{re.escape(written)}' \(its zarr\.json was "
        rf"written apart.*Set the chunk_key_encoding's \"separator\" to \"{re.escape(written)}\"",
    ):
        open_reader(arr, name="a.zarr")
    meta["chunk_key_encoding"]["configuration"]["separator"] = written  # the advice works
    (path / "zarr.json").write_text(json.dumps(meta))
    check_reader(open_reader(zarr.open_array(str(path), mode="r"), name="a"), data)


@pytest.mark.parametrize("written", ["/", "."])
def test_the_other_separator_is_refused_where_the_first_chunks_are_not_stored(tmp_path, written):
    # the check looked only for the first chunk (a folder 0, a file 0.0): an array whose
    # first rows were never written (or are all fill values) opened and read as fill values
    import json

    data = np.arange(40 * 6, dtype=np.float32).reshape(40, 6) + 1
    data[:10] = 0  # the first row of chunks: fill values, not stored
    path = tmp_path / "a.zarr"
    enc = {"name": "v2", "separator": written}
    write(path, data, fmt=2, chunks=(10, 3), chunk_key_encoding=enc)
    assert not (path / "0").exists() and not (path / "0.0").exists()
    meta = json.loads((path / ".zarray").read_text())
    meta["dimension_separator"] = "." if written == "/" else "/"
    (path / ".zarray").write_text(json.dumps(meta))
    arr = zarr.open_array(str(path), mode="r")
    assert not arr[:].any()  # what zarr reads: all fill values
    with pytest.raises(
        DatasetError,
        match=rf"a\.zarr holds '[1-3][./]\S*'.*separator '{written}'.*"
        rf"Add \"dimension_separator\": \"{written}\"",
    ):
        open_reader(arr, name="a.zarr")
    meta["dimension_separator"] = written  # the advice works
    (path / ".zarray").write_text(json.dumps(meta))
    check_reader(open_reader(zarr.open_array(str(path), mode="r"), name="a"), data)


# ---------------------------------------------------------------------------- chunk reads


def test_each_chunk_read_once_per_call(tmp_path, monkeypatch):
    data = np.arange(1000, dtype=np.int32) + 1
    arr = write(tmp_path / "a.zarr", data, chunks=(100,), compressors=ZstdCodec())
    sh = write(tmp_path / "s.zarr", data, chunks=(50,), shards=(200,), compressors=ZstdCodec())
    calls: list[int] = []
    real = readers_mod._pread_into

    def counting(fd, buf, offset):
        calls.append(buf.size)
        return real(fd, buf, offset)

    monkeypatch.setattr(readers_mod, "_pread_into", counting)
    # unsorted, overlapping; chunk 1 (of 100) is touched by four ranges, chunk 5 by two
    ranges = np.array([[550, 560], [120, 130], [110, 250], [105, 106], [150, 199], [555, 600]])
    for a, n_chunks, n_shards in [(arr, 3, 0), (sh, 4, 3)]:
        reader = open_reader(a, name="a")
        calls.clear()
        np.testing.assert_array_equal(reader.read_rows(ranges), expected(data, ranges))
        # 1 pread per (inner) chunk + 1 per shard index (first read only)
        assert len(calls) == n_chunks + n_shards
        calls.clear()
        reader.read_rows(ranges)
        assert len(calls) == n_chunks  # shard indexes are cached


def test_empty_and_invalid_ranges(tmp_path):
    data = np.arange(100, dtype=np.float32).reshape(50, 2)
    arr = write(tmp_path / "a.zarr", data, chunks=(8, 2), compressors=ZstdCodec())
    for reader in (open_reader(arr, name="a"), open_reader(arr, name="a", force_zarr=True)):
        assert reader.read_rows(np.zeros((0, 2), np.int64)).shape == (0, 2)
        assert reader.read_rows(np.array([[3, 3]])).shape == (0, 2)
        with pytest.raises(ValueError, match="range 1"):
            reader.read_rows(np.array([[0, 1], [40, 51]]))
        with pytest.raises(ValueError, match="range 0"):
            reader.read_rows(np.array([[5, 4]]))
        with pytest.raises(ValueError, match="out"):
            reader.read_rows(np.array([[0, 4]]), out=np.empty((4, 2), np.float64))
        with pytest.raises(ValueError, match="out"):
            reader.read_rows(np.array([[0, 4]]), out=np.empty((2, 4), np.float32).T)


def test_zero_dimensional_array_is_rejected(tmp_path):
    arr = zarr.create_array(str(tmp_path / "s.zarr"), shape=(), dtype="float32")
    with pytest.raises(DatasetError, match="0-dimensional"):
        open_reader(arr, name="s")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    spans=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 300)), min_size=0, max_size=12),
    which=st.sampled_from(["plain", "sharded", "nd"]),
)
def test_random_ranges_hypothesis(stores, spans, which, monkeypatch):
    data, direct, fallback = stores[which]
    n = data.shape[0]
    ranges = np.array([[min(s, n), min(s + ln, n)] for s, ln in spans], dtype=np.int64)
    ranges = ranges.reshape(-1, 2)
    want = expected(data, ranges) if len(ranges) else data[:0]
    for threshold in COPY_THRESHOLDS:
        monkeypatch.setattr(readers_mod, "SLICE_COPY_ELEMENTS", threshold)
        np.testing.assert_array_equal(direct.read_rows(ranges), want)
    np.testing.assert_array_equal(fallback.read_rows(ranges), want)


#: ``SLICE_COPY_ELEMENTS`` values that send every run of rows copied out of a shared chunk
#: through the slice copies, through a mix of both copies, or through the per-chunk gathers
COPY_THRESHOLDS = (1, 40, 10**9)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("hyp")
    out = {}
    data = make_data((700,), "float32", 32, 128)
    out["plain"] = write(root / "p.zarr", data, chunks=(32,), compressors=ZstdCodec()), data
    out["sharded"] = (
        write(root / "s.zarr", data, chunks=(32,), shards=(128,), compressors=BloscCodec()),
        data,
    )
    nd = make_data((130, 6, 5), "int32", 16, None)
    out["nd"] = write(root / "n.zarr", nd, chunks=(16, 4, 5), compressors=ZstdCodec()), nd
    return {
        k: (d, open_reader(a, name=k), open_reader(a, name=k, force_zarr=True))
        for k, (a, d) in out.items()
    }


@pytest.mark.parametrize("which", ["plain", "sharded", "nd"])
def test_scattered_short_ranges(stores, which, monkeypatch):
    """A scattered subset: many short runs per chunk, in shuffled order, some repeated, some
    beside whole chunks (which are decoded in place) -- the rows a ``Subset`` window reads."""
    data, direct, _ = stores[which]
    n = data.shape[0]
    rng = np.random.default_rng(7)
    rows = np.sort(rng.choice(n, size=n // 3, replace=False))
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    ranges = np.array([[r[0], r[-1] + 1] for r in runs])
    ranges = np.concatenate([ranges, ranges[:5], [[0, 48], [n - 40, n]]])  # repeats, whole chunks
    ranges = ranges[rng.permutation(len(ranges))]
    for threshold in COPY_THRESHOLDS:
        monkeypatch.setattr(readers_mod, "SLICE_COPY_ELEMENTS", threshold)
        np.testing.assert_array_equal(direct.read_rows(ranges), expected(data, ranges))


def test_long_runs_sharing_a_chunk_are_copied_as_slices(tmp_path, monkeypatch):
    """CSR windows read element ranges of 100k+ elements, and two ranges often share a stored
    chunk (adjacent sampler chunks). Their runs must be copied as slices: gathering them
    element by element made reading a window as slow as decoding it."""
    data = make_data((20000,), "float32", 4000, None)
    reader = open_reader(write(tmp_path / "a.zarr", data, chunks=(4000,)), name="a")
    gathered = []
    real = readers_mod.concat_aranges

    def counting(starts, lengths):
        gathered.append(int(np.sum(lengths)))
        return real(starts, lengths)

    monkeypatch.setattr(readers_mod, "concat_aranges", counting)
    ranges = np.array([[10000, 16000], [5500, 10000], [1200, 5500]])  # chunks 1, 2 in two ranges
    np.testing.assert_array_equal(reader.read_rows(ranges), expected(data, ranges))
    assert gathered == []
    short = np.array([[9000, 9010], [8990, 9000]])  # short runs are still gathered per chunk
    np.testing.assert_array_equal(reader.read_rows(short), expected(data, short))
    assert gathered == [20, 20]


# ---------------------------------------------------------------------------- executors


def test_explicit_executor_and_nested_call(tmp_path):
    data = make_data((1037,), "float32", 64, 256)
    arr = write(tmp_path / "a.zarr", data, chunks=(64,), shards=(256,), compressors=ZstdCodec())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        reader = open_reader(arr, name="a", executor=ex)
        check_reader(reader, data)
        # read_rows running *on* the reader's only pool thread must not deadlock
        ranges = random_ranges(np.random.default_rng(3), 1037, 64)
        got = ex.submit(reader.read_rows, ranges).result(timeout=60)
        np.testing.assert_array_equal(got, expected(data, ranges))


def test_concurrent_callers_share_a_reader(tmp_path):
    data = make_data((203, 7), "float32", 16, 64)
    arr = write(tmp_path / "a.zarr", data, chunks=(16, 4), shards=(64, 8), compressors=ZstdCodec())
    reader = open_reader(arr, name="a")
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            check_reader(reader, data, seed=seed, rounds=5)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------------------- fallback


def test_fallback_memory_store_and_force_zarr(tmp_path):
    data = make_data((203, 7), "float32", 16, None)
    mem = zarr.create_array(
        zarr.storage.MemoryStore(), shape=data.shape, dtype=data.dtype, chunks=(16, 4)
    )
    mem[...] = data
    reader = open_reader(mem, name="mem")
    assert isinstance(reader, ZarrReader)
    assert reader.path == "zarr"
    assert "MemoryStore" in reader.reason
    assert reader.rows_per_chunk == 16
    check_reader(reader, data)

    arr = write(tmp_path / "a.zarr", data, chunks=(16, 4), compressors=ZstdCodec())
    forced = open_reader(arr, name="a", force_zarr=True)
    assert (forced.path, forced.reason) == ("zarr", "force_zarr=True")
    check_reader(forced, data)


def test_fallback_for_unsupported_codec(tmp_path):
    data = make_data((203, 7), "float32", 16, None)
    arr = write(
        tmp_path / "a.zarr",
        data,
        chunks=(16, 7),
        filters=[TransposeCodec(order=(1, 0))],
        compressors=ZstdCodec(),
    )
    reader = open_reader(arr, name="a")
    assert reader.path == "zarr"
    assert "transpose" in reader.reason
    check_reader(reader, data)


BIG_ENDIAN_FILTERS = {
    # name: (data, filter); every filter here encodes to items of more than one byte
    "delta": (np.arange(-300, 500, 3, dtype="int32"), lambda: znc.Delta(dtype="int32")),
    "fixedscaleoffset": (
        np.linspace(-30, 30, 267),
        lambda: znc.FixedScaleOffset(offset=0, scale=100, dtype="float64", astype="int16"),
    ),
    "astype": (
        np.linspace(-30, 30, 267),
        lambda: znc.AsType(encode_dtype="float32", decode_dtype="float64"),
    ),
    "quantize": (np.linspace(-30, 30, 267), lambda: znc.Quantize(digits=3, dtype="float64")),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["chunks", "sharded"])
@pytest.mark.parametrize("name", sorted(BIG_ENDIAN_FILTERS))
def test_big_endian_chunks_behind_numcodecs_filters(tmp_path, name, sharded):
    # zarr-python hands these filters the big-endian array, which numcodecs views as
    # native: it reads every value byte-swapped. The direct path reads the values written;
    # the zarr fallback refuses the array.
    data, make_filter = BIG_ENDIAN_FILTERS[name]
    layout = dict(chunks=(16,), shards=(64,) if sharded else None, compressors=ZstdCodec())
    little = write(tmp_path / "le.zarr", data, filters=[make_filter()], **layout)
    big = write(
        tmp_path / "be.zarr",
        data,
        filters=[make_filter()],
        serializer=BytesCodec(endian="big"),
        **layout,
    )
    want = little[:]  # what the filter keeps of the data (zarr reads the little-endian copy right)
    assert not np.array_equal(big[:], want)  # zarr-python's misreading, which this guards
    reader = open_reader(big, name="be.zarr")
    assert reader.path == "direct"
    check_reader(reader, want)
    with pytest.raises(
        DatasetError,
        match=r"be\.zarr: zarr-python would read this array .*"
        rf"force_zarr=True.*numcodecs\.{name}.*big-endian.*without force_zarr",
    ):
        open_reader(big, name="be.zarr", force_zarr=True)
    mem = zarr.create_array(
        zarr.storage.MemoryStore(),
        shape=data.shape,
        dtype=data.dtype,
        filters=[make_filter()],
        serializer=BytesCodec(endian="big"),
        **layout,
    )
    with pytest.raises(DatasetError, match=r"MemoryStore.*Copy the store to a local disk"):
        open_reader(mem, name="mem")


def test_big_endian_chunks_behind_one_byte_filters_are_read_by_zarr(tmp_path):
    # a filter that encodes to one-byte items sees no byte order: zarr reads it right
    data = np.linspace(0, 25, 100)
    arr = write(
        tmp_path / "a.zarr",
        data,
        chunks=(16,),
        filters=[
            TransposeCodec(order=(0,)),
            znc.FixedScaleOffset(offset=0, scale=10, dtype="float64", astype="uint8"),
        ],
        serializer=BytesCodec(endian="big"),
    )
    reader = open_reader(arr, name="a")
    assert reader.path == "zarr"  # the transpose codec
    check_reader(reader, np.round(data * 10) / 10)


def test_fallback_wraps_zarr_errors(tmp_path):
    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=ZstdCodec())
    _garble_middle(tmp_path / "a.zarr/c/1")
    reader = open_reader(arr, name="a.zarr/X", force_zarr=True)
    with pytest.raises(ChunkReadError, match=r"a\.zarr/X.*rows \[1000, 1100\) \(chunks 0 to 1 "):
        reader.read_rows(np.array([[1000, 1100]]))
    with pytest.raises(ChunkReadError, match=r"rows \[1100, 1200\) \(chunk 1 along axis 0"):
        reader.read_rows(np.array([[1100, 1200]]))


def test_read_whole_names_the_first_bad_chunk_of_many(tmp_path):
    """An array read whole (obs columns, obsm entries, row offsets) that fails is read
    again chunk by chunk (``first_failing_chunk``, which convert uses too): the error names
    the bad chunk's rows, not the whole array's."""
    from dali_zarr.io import first_failing_chunk, read_whole

    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=ZstdCodec())
    assert first_failing_chunk(arr, 0, 4096) is None
    _garble_middle(tmp_path / "a.zarr/c/2")
    assert first_failing_chunk(arr, 0, 2048) is None  # rows before the bad chunk
    assert first_failing_chunk(arr, 1500, 4096)[0] == 2
    with pytest.raises(ChunkReadError, match=r"a\.zarr/X.*rows \[2048, 3072\) \(chunk 2 along"):
        read_whole(arr, name="a.zarr/X")


def test_a_remote_store_that_stops_answering_is_not_called_corrupted(tmp_path):
    # a remote store whose server went away mid-epoch was "truncated or corrupted: re-write
    # the array", advice that would have a user re-write a healthy dataset
    import functools
    import http.server

    pytest.importorskip("aiohttp")
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    data = np.arange(400, dtype=np.float32).reshape(100, 4)
    group.create_array("x", data=data, chunks=(10, 4))
    zarr.consolidate_metadata(tmp_path / "g.zarr")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/g.zarr"
        (reader,) = dz.open_dataset(url, element="x").readers()
        assert reader.path == "zarr"
        np.testing.assert_array_equal(reader.read_rows(np.array([[0, 10]])), data[:10])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    with pytest.raises(ChunkReadError, match=r"rows \[50, 60\).*Fetching the bytes failed .*"
                       r"the store may well be intact"):  # fmt: skip
        reader.read_rows(np.array([[50, 60]]))

    # a corrupted chunk read through zarr still says so (bz2 fails with an OSError too,
    # without an errno)
    arr = write(tmp_path / "z.zarr", data, fmt=2, chunks=(10, 4), compressors=numcodecs.BZ2())
    _garble_middle(tmp_path / "z.zarr/1.0")
    with pytest.raises(ChunkReadError, match=r"OSError: .*truncated or corrupted"):
        open_reader(arr, name="z", force_zarr=True).read_rows(np.array([[10, 20]]))


def test_a_relative_store_path_survives_a_chdir(tmp_path, monkeypatch):
    """The reader keeps the directory absolute: after a chdir (Hydra moves each job into its
    run directory) a relative root would find no chunk files and read fill values."""
    data = make_data((40, 3), "float32", 8, None)
    monkeypatch.chdir(tmp_path)
    arr = write(Path("rel.zarr"), data, chunks=(8, 3), compressors=ZstdCodec())
    reader = open_reader(arr, name="rel.zarr")
    assert reader.path == "direct"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    np.testing.assert_array_equal(reader.read_rows(np.array([[5, 30]])), data[5:30])


# ---------------------------------------------------------------------------- zstd prefix decode

PREFIX_C = 40_000  # rows per chunk: 160 KB of 4-byte items, more than one zstd block
PREFIX_CASES = {
    # name: (fmt, shape, dtype, chunks, shards, compressors)
    "v3-sharded-f4": (3, (130_000,), "float32", (PREFIX_C,), (2 * PREFIX_C,), "zstd"),
    "v3-i4": (3, (130_000,), "int32", (PREFIX_C,), None, "zstd"),
    "v3-numcodecs-zstd": (3, (130_000,), "float32", (PREFIX_C,), None, "numcodecs-zstd"),
    "v2-f4": (2, (130_000,), "float32", (PREFIX_C,), None, "zstd"),
    "v2-bigendian-i4": (2, (130_000,), ">i4", (PREFIX_C,), None, "zstd"),
    "v3-sharded-crc32c": (3, (130_000,), "int32", (PREFIX_C,), (2 * PREFIX_C,), "zstd-crc32c"),
    # 2-D C order: an axis-0 prefix is a byte prefix; whole rows per chunk, then split rows
    "v3-2d-rowchunks": (3, (13_000, 10), "float32", (4000, 10), None, "zstd"),
    "v3-2d-sharded-split": (3, (13_000, 10), "float32", (4000, 4), (8000, 8), "zstd"),
}


def _prefix_store(tmp_path, case):
    fmt, shape, dtype, chunks, shards, codec = PREFIX_CASES[case]
    rng = np.random.default_rng(3)
    data = rng.integers(0, 50, size=shape).astype(dtype)  # compressible, not trivially
    chosen = compressors(codec, fmt)
    arr = write(
        tmp_path / "p.zarr", data, fmt=fmt, chunks=chunks, shards=shards, compressors=chosen
    )
    reader = open_reader(arr, name="p")
    assert reader.path == "direct", reader.reason
    return reader, data


@pytest.mark.parametrize("case", sorted(PREFIX_CASES))
def test_prefix_decode_matches_slicing(tmp_path, case):
    reader, data = _prefix_store(tmp_path, case)
    assert reader._decoder.prefix_decodable
    C, n = reader.rows_per_chunk, data.shape[0]
    calls = [
        # (ranges, chunks decoded only up to a row short of their end)
        ([[0, 10]], 1),  # ends mid-chunk
        ([[C + 3, C + 20]], 1),  # inside one chunk: rows [0, 20) of it are decoded
        ([[C // 2, C + C // 3]], 1),  # starts mid-chunk, ends mid-next-chunk
        ([[C - 1, 2 * C + 1], [5, 7]], 1),  # chunk 0 from C - 1, 1 whole, 2 a prefix
        ([[3 * C + 5, n - 3]], 1),  # the last (short) chunk, short of the array's end
        ([[3 * C, n]], 1),  # the whole last chunk: still shorter than a full chunk
        # the union of the ranges decides: chunk 0 is needed to its end by the second range
        ([[0, 10], [C - 5, C + 7]], 1),
        ([[0, C]], 0),
    ]
    for ranges, n_prefix in calls:
        ranges = np.array(ranges, dtype=np.int64)
        before = reader.chunks_prefix_decoded
        np.testing.assert_array_equal(reader.read_rows(ranges), expected(data, ranges))
        n_pieces = 3 if case.endswith("split") else 1  # chunks per chunk row
        assert reader.chunks_prefix_decoded - before == n_prefix * n_pieces, ranges.tolist()
    check_reader(reader, data, rounds=2)
    assert reader.chunks_prefix_decoded > 0


@pytest.mark.parametrize("case", ["v3-sharded-f4", "v2-bigendian-i4", "v3-2d-rowchunks"])
def test_range_tails_decode_straight_into_the_output(tmp_path, monkeypatch, case):
    """The prefix of a chunk that a range ends in (its first rows, up to the last row any
    range needs of it) is decoded into the range's place in `out`, not into a buffer; where
    the prefix cannot be decoded alone, the full chunk is, and its rows copied there."""
    reader, data = _prefix_store(tmp_path, case)
    C = reader.rows_per_chunk
    heads: list[tuple[bool, int]] = []
    decode_head_into = codecs_mod.ChunkDecoder.decode_head_into

    def spy(self, raw, head, rows):
        heads.append((np.shares_memory(head, out), rows))
        return decode_head_into(self, raw, head, rows)

    monkeypatch.setattr(codecs_mod.ChunkDecoder, "decode_head_into", spy)
    ranges = np.array(
        [
            [C // 2, C + 10],  # ends 10 rows into chunk 1: a head of 10 rows
            [2 * C + 1, 2 * C + 5],  # inside chunk 2, not from its first row: a buffer
            [3 * C, 3 * C + 7],  # the short last chunk's first 7 rows: a head
            [C + 2, C + 4],  # needs rows of chunk 1 the head holds: copied from it
        ]
    )
    for prefix_ok in (True, False):
        if not prefix_ok:  # the prefix decode gives up: full decode, rows copied
            monkeypatch.setattr(codecs_mod, "_zstd_prefix_into", lambda buf, target: 0)
        heads.clear()
        total = int((ranges[:, 1] - ranges[:, 0]).sum())
        out = np.full((total, *data.shape[1:]), -1, dtype=reader.dtype)
        before = reader.chunks_prefix_decoded
        got = reader.read_rows(ranges, out=out)
        assert got is out
        np.testing.assert_array_equal(out, expected(data, ranges))
        assert sorted(heads) == [(True, 7), (True, 10)]  # decoded on several threads
        assert reader.chunks_prefix_decoded - before == (3 if prefix_ok else 0)


def test_prefix_decode_falls_back_without_zstandard(tmp_path, monkeypatch):
    monkeypatch.setattr(codecs_mod, "_zstandard", None)
    reader, data = _prefix_store(tmp_path, "v3-sharded-f4")
    assert not reader._decoder.prefix_decodable
    ranges = np.array([[5, 100], [PREFIX_C // 2, PREFIX_C + 77]])
    np.testing.assert_array_equal(reader.read_rows(ranges), expected(data, ranges))
    assert reader.chunks_prefix_decoded == 0 and reader.chunks_read == 2


def test_prefix_decode_not_for_other_codecs(tmp_path):
    data = np.arange(4096, dtype=np.float32)
    for i, codec in enumerate(["blosc-zstd", "gzip", "none"]):
        arr = write(tmp_path / f"{i}.zarr", data, chunks=(1024,), compressors=compressors(codec, 3))
        reader = open_reader(arr, name="a")
        assert not reader._decoder.prefix_decodable
        np.testing.assert_array_equal(reader.read_rows(np.array([[1030, 1040]])), data[1030:1040])
        assert reader.chunks_prefix_decoded == 0


def test_corrupted_zstd_chunk_prefix(tmp_path):
    reader, _ = _prefix_store(tmp_path, "v3-i4")
    p = tmp_path / "p.zarr/c/1"
    raw = bytearray(p.read_bytes())
    raw[20:52] = bytes(range(200, 232))  # early in the frame: inside the first block
    p.write_bytes(bytes(raw))
    # raised by the prefix decode (zstandard), not by a full numcodecs decode
    match = r"p: chunk 'c/1'.*zstd decoding failed \(ZstdError.*re-write"
    with pytest.raises(ChunkReadError, match=match):
        reader.read_rows(np.array([[PREFIX_C + 1, PREFIX_C + 10]]))
    assert reader.chunks_prefix_decoded == 0


def test_zstd_checksum_frames_are_decoded_whole(tmp_path):
    """A zstd frame with a content checksum (ZstdCodec(checksum=True)) is checked whole: a
    prefix decode stopped before the checksum, so a flipped byte in a stored (raw) block
    came back as wrong rows where zarr and a full decode raise the checksum mismatch."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (100, 200), dtype=np.uint8).view(np.float32)  # raw blocks
    arr = write(
        tmp_path / "ck.zarr", data, chunks=(100, 50), compressors=[ZstdCodec(checksum=True)]
    )
    reader = open_reader(arr, name="ck")
    head = np.array([[0, 5]])  # rows of chunk 0 short of its end: a prefix
    np.testing.assert_array_equal(reader.read_rows(head).view(np.uint32), data[:5].view(np.uint32))
    assert reader.chunks_prefix_decoded == 0
    path = tmp_path / "ck.zarr" / "c" / "0" / "0"
    raw = bytearray(path.read_bytes())
    raw[40] ^= 1  # in row 0's bytes of the frame's one raw block
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="checksum"):
        zarr.open_array(tmp_path / "ck.zarr", mode="r")[:5]  # zarr refuses it too
    with pytest.raises(ChunkReadError, match=r"ck: chunk 'c/0/0'.*checksum"):
        reader.read_rows(head)


@pytest.mark.parametrize("values", [25, 75], ids=["short", "long"])
def test_zstd_frames_without_content_size_are_decoded_whole(tmp_path, values):
    """A zstd frame that does not record its content size (zarr always writes it; a
    streaming compressor may not) holding the wrong number of bytes: the first rows of the
    chunk were decoded from it and returned, where zarr and a full decode refuse it."""
    zstandard = pytest.importorskip("zstandard")
    data = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    arr = write(tmp_path / "cs.zarr", data, chunks=(16, 4), compressors=[ZstdCodec()])
    sink = zstandard.ZstdCompressor(write_content_size=False).stream_writer(
        (tmp_path / "cs.zarr" / "c" / "1" / "0").open("wb")
    )
    with sink:  # 25 or 75 values where the chunk holds 64, and no content size in the frame
        sink.write(np.full(values, 7, dtype=np.float32).tobytes())
    with pytest.raises(ValueError):  # zarr refuses it too (the decoded bytes do not reshape)
        zarr.open_array(tmp_path / "cs.zarr", mode="r")[16:18]
    reader = open_reader(arr, name="cs")
    with pytest.raises(
        ChunkReadError, match=r"cs: chunk 'c/1/0'.*decoded to \d+ bytes, expected 256"
    ):
        reader.read_rows(np.array([[16, 18]]))  # the first rows of chunk 1: a prefix


# ---------------------------------------------------------------------------- corruption


def _garble_middle(path, n: int = 32) -> None:
    raw = bytearray(path.read_bytes())
    m = len(raw) // 2
    raw[m - n // 2 : m + n // 2] = bytes(range(200, 200 + n))
    path.write_bytes(bytes(raw))


def _truncate(path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def _compressible(n: int) -> np.ndarray:
    i = np.arange(n)
    return ((i % 13) * 0.5 + np.sin(i).round(1)).astype(np.float32)


def test_corrupted_zstd_chunk(tmp_path):
    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=ZstdCodec())
    _garble_middle(tmp_path / "a.zarr/c/1")
    reader = open_reader(arr, name="cells.zarr/X/data")
    with pytest.raises(ChunkReadError, match=r"cells\.zarr/X/data.*'c/1'.*zstd.*re-write") as e:
        reader.read_rows(np.array([[0, 10], [1500, 1600]]))
    assert isinstance(e.value, OSError)
    # other chunks still read
    np.testing.assert_array_equal(reader.read_rows(np.array([[2048, 4096]])), data[2048:])


@pytest.mark.parametrize("codec", ["zstd", "blosc-lz4", "lz4", "gzip", "none", "zstd-crc32c"])
def test_truncated_chunk(tmp_path, codec):
    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=compressors(codec, 3))
    _truncate(tmp_path / "a.zarr/c/2")
    reader = open_reader(arr, name="arr")
    assert reader.path == "direct"
    with pytest.raises(ChunkReadError, match=r"arr: chunk 'c/2'.*truncated or corrupted"):
        reader.read_rows(np.array([[2100, 2200]]))


def test_truncated_chunk_v2(tmp_path):
    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, fmt=2, chunks=(1024,), compressors=numcodecs.Blosc())
    _truncate(tmp_path / "a.zarr/2", keep=0.9)
    with pytest.raises(ChunkReadError, match=r"chunk '2'.*blosc header"):
        open_reader(arr, name="arr").read_rows(np.array([[2100, 2200]]))


def test_crc32c_mismatch(tmp_path):
    data = _compressible(4096)
    arr = write(tmp_path / "a.zarr", data, chunks=(1024,), compressors=[Crc32cCodec()])
    p = tmp_path / "a.zarr/c/3"
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))
    reader = open_reader(arr, name="arr")
    assert reader.path == "direct"
    with pytest.raises(ChunkReadError, match=r"chunk 'c/3'.*crc32c checksum mismatch"):
        reader.read_rows(np.array([[3000, 3100]]))


def _sharded(tmp_path, **kw):
    data = _compressible(4096)
    arr = write(
        tmp_path / "s.zarr", data, chunks=(256,), shards=(1024,), compressors=ZstdCodec(), **kw
    )
    return arr, data, tmp_path / "s.zarr/c/1"


def test_corrupted_shard_index_crc(tmp_path):
    arr, _, shard = _sharded(tmp_path)
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 0x01  # inside the index (last 4 * 16 + 4 bytes)
    shard.write_bytes(bytes(raw))
    reader = open_reader(arr, name="s")
    with pytest.raises(ChunkReadError, match=r"s: shard 'c/1'.*shard index crc32c"):
        reader.read_rows(np.array([[1100, 1200]]))


def test_shard_index_points_past_end(tmp_path):
    arr, data, shard = _sharded(tmp_path)
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-68:-4]), "<u8").copy().reshape(4, 2)
    index[2, 0] = len(raw) + 1000  # inner chunk 2 starts past the end
    raw[-68:] = index.tobytes() + struct.pack("<I", crc32c.crc32c(index.tobytes()))
    shard.write_bytes(bytes(raw))
    reader = open_reader(arr, name="s")
    with pytest.raises(ChunkReadError, match=r"inner chunk \(2,\).*shard 'c/1'.*shard file is"):
        reader.read_rows(np.array([[1024 + 512, 1024 + 600]]))
    # the other inner chunks of that shard are fine
    np.testing.assert_array_equal(reader.read_rows(np.array([[1024, 1500]])), data[1024:1500])
    # the GPU path's byte plan locates chunks with one vectorized lookup: same error
    from dali_zarr.io.gpu import execute_plan_cpu, plan_rows

    with pytest.raises(ChunkReadError, match=r"inner chunk \(2,\).*shard 'c/1'.*shard file is"):
        plan_rows(reader, np.array([[0, 10], [1024 + 512, 1024 + 600]]))
    ok = np.array([[1024, 1500], [0, 300]])
    want = np.concatenate([data[1024:1500], data[0:300]])
    np.testing.assert_array_equal(execute_plan_cpu(plan_rows(reader, ok), reader), want)
    # an entry near 2**64 must not wrap around into a plausible range
    index[2] = (2**64 - 2, 10)
    raw[-68:] = index.tobytes() + struct.pack("<I", crc32c.crc32c(index.tobytes()))
    shard.write_bytes(bytes(raw))
    reader = open_reader(arr, name="s")
    with pytest.raises(ChunkReadError, match=r"inner chunk \(2,\).*shard file is"):
        plan_rows(reader, np.array([[1024 + 512, 1024 + 600]]))
    with pytest.raises(ChunkReadError, match=r"inner chunk \(2,\).*shard file is"):
        reader.read_rows(np.array([[1024 + 512, 1024 + 600]]))


@pytest.mark.parametrize("rewrites", [1, 4])
def test_a_shard_rewritten_after_its_index_was_read_is_read_at_its_new_offsets(tmp_path, rewrites):
    """A window reads its shards' indexes, then their chunks. A shard rewritten in between
    (a writer of the store: zarr renames a new file over the old) was read at the old
    offsets: at the same size no read came up short, and rows 10-29 came back as other
    chunks' values without an error. Each read now compares the file it opened with the
    one indexed, and reads the index again; a shard that keeps changing is named."""
    v1, _, v2, want = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    load_shards, load_index = reader._load_shards, reader._load_shard_index
    versions = itertools.cycle([v2, v1])

    def rewrite() -> None:  # what zarr does: a new file renamed over the shard
        shutil.copyfile(next(versions) / "c" / "0" / "0", tmp_path / "next")
        os.replace(tmp_path / "next", shard)

    def load_then_rewrite(shards) -> None:
        load_shards(shards)
        rewrite()

    def load_index_then_rewrite(key) -> None:  # a writer faster than the reads
        load_index(key)
        rewrite()

    reader._load_shards = load_then_rewrite
    if rewrites == 1:
        np.testing.assert_array_equal(reader.read_rows(np.array([[10, 40]])), want[10:40])
    else:
        reader._load_shard_index = load_index_then_rewrite
        with pytest.raises(
            ChunkReadError, match=r"s: inner chunk \(1, 0\).*rewritten 4 times while this chunk"
        ) as caught:
            reader.read_rows(np.array([[10, 20]]))
        # what to do: wait for the writer (the store is not damaged)
        assert "Another process is writing the array" in str(caught.value)
        assert "corrupted" not in str(caught.value)


@pytest.mark.parametrize("path", ["read_rows", "byte plan"])
def test_a_shard_swapped_for_a_pipe_after_its_index_was_read_is_refused_not_waited_on(
    tmp_path, path
):
    """A shard replaced by a named pipe between a window's index look and its chunk reads:
    the read opened the pipe without O_NONBLOCK and waited for a writer, forever. Both
    readers now open without waiting, see another file, and name it."""
    from dali_zarr.io.gpu import execute_plan_cpu, plan_rows

    v1, _, _, _ = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    ranges = np.array([[10, 40]])

    def swap_for_a_pipe() -> None:
        shard.unlink()
        os.mkfifo(shard)

    if path == "read_rows":
        load_shards = reader._load_shards

        def load_then_swap(shards) -> None:
            load_shards(shards)
            if not stat.S_ISFIFO(shard.stat().st_mode):
                swap_for_a_pipe()

        reader._load_shards = load_then_swap
        read, why = (lambda: reader.read_rows(ranges)), "not a regular file"
    else:
        plan = plan_rows(reader, ranges)
        swap_for_a_pipe()
        read, why = (lambda: execute_plan_cpu(plan, reader)), "rewritten since"
    raised = raised_by_a_read_of(read, shard)
    assert isinstance(raised, ChunkReadError) and why in str(raised), raised
    assert str(raised).startswith("s: ")


def test_a_shard_index_dropped_by_another_read_thread_as_a_window_looks_reads_as_fill(
    tmp_path, monkeypatch
):
    """A window looks at each cached shard index's file (a stat) before reading; another
    read thread may drop that index meanwhile, having found the shard deleted (zarr deletes a
    shard rewritten to all fill values), as its re-reads of a changed shard now do. The look
    took the index by key after the stat and raised a bare KeyError (no array, no file); the
    shard now reads as the fill value, as a deleted shard does."""
    v1, want, _, _ = same_size_shards(tmp_path)
    shard = v1 / "c" / "0" / "0"
    reader = open_reader(zarr.open_array(v1, mode="r"), name="s")
    rows = np.array([[10, 40]])
    np.testing.assert_array_equal(reader.read_rows(rows), want[10:40])  # its index cached
    stat = readers_mod._file_stamp

    def stat_as_another_thread_drops_the_index(path: str) -> tuple[int, ...]:
        now = stat(path)
        if path == str(shard):
            monkeypatch.setattr(readers_mod, "_file_stamp", stat)
            os.remove(shard)  # the writer: all fill values now
            other = threading.Thread(target=reader._load_shard_index, args=((0, 0),))
            other.start()
            other.join()
        return now

    monkeypatch.setattr(readers_mod, "_file_stamp", stat_as_another_thread_drops_the_index)
    np.testing.assert_array_equal(reader.read_rows(rows), np.zeros((30, 4), np.float32))


def test_truncated_shard(tmp_path):
    arr, _, shard = _sharded(tmp_path)
    _truncate(shard, keep=0.5)
    with pytest.raises(ChunkReadError, match=r"shard 'c/1'"):
        open_reader(arr, name="s").read_rows(np.array([[1100, 1200]]))
    shard.write_bytes(b"\0" * 10)  # shorter than the index itself
    with pytest.raises(ChunkReadError, match=r"shorter than its 68-byte shard index"):
        open_reader(arr, name="s").read_rows(np.array([[1100, 1200]]))


def test_corrupted_inner_chunk(tmp_path):
    arr, _, shard = _sharded(tmp_path)
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-68:-4]), "<u8").reshape(4, 2)
    off, nb = (int(v) for v in index[1])
    raw[off + nb // 2 : off + nb // 2 + 24] = bytes(range(100, 124))
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChunkReadError, match=r"inner chunk \(1,\) \(array chunk \(5,\)\)"):
        open_reader(arr, name="s").read_rows(np.array([[1024 + 256, 1024 + 300]]))


# ---------------------------------------------------------------------------- anndata


@pytest.mark.parametrize("fmt", [2, 3])
def test_anndata_store(tmp_path, fmt):
    anndata = pytest.importorskip("anndata")
    sparse = pytest.importorskip("scipy.sparse")
    X = sparse.random(
        517,
        301,
        density=0.05,
        format="csr",
        dtype=np.float32,
        random_state=np.random.default_rng(0),
    )
    X.data[:] = np.round(X.data * 10) + 1
    old = anndata.settings.zarr_write_format
    try:
        anndata.settings.zarr_write_format = fmt
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            anndata.AnnData(X=X).write_zarr(tmp_path / "cells.zarr")
    finally:
        anndata.settings.zarr_write_format = old
    g = zarr.open_group(str(tmp_path / "cells.zarr"), mode="r")
    assert g["X"].metadata.zarr_format == fmt
    rng = np.random.default_rng(5)
    for key, ref in [("data", X.data), ("indices", X.indices), ("indptr", X.indptr)]:
        reader = open_reader(g["X"][key], name=f"cells.zarr/X/{key}")
        assert reader.path == "direct", reader.reason
        assert reader.shape == ref.shape
        np.testing.assert_array_equal(reader.read_rows(np.array([[0, len(ref)]])), ref)
        check_reader(reader, ref.astype(reader.dtype, copy=False), seed=int(rng.integers(1000)))
    # the CSR rows of a few cells, read the way the loader does (ranges from indptr)
    indptr = open_reader(g["X"]["indptr"], name="indptr").read_rows(np.array([[0, 518]]))
    cells = np.array([400, 3, 77, 78, 516])
    ranges = np.stack([indptr[cells], indptr[cells + 1]], 1).astype(np.int64)
    data = open_reader(g["X"]["data"], name="data").read_rows(ranges)
    np.testing.assert_array_equal(data, np.concatenate([X[c].data for c in cells]))


@pytest.mark.parametrize("stored", [False, True], ids=["missing", "stored"])
def test_an_edge_chunk_far_longer_than_its_array_is_not_allocated_whole(
    tmp_path: Path, stored: bool
) -> None:
    """An edge chunk is decoded whole into a chunk-shaped buffer; a missing one of 2**40
    rows asked for 42 TiB (a bare MemoryError) where zarr reads fill values. Far larger than
    their valid part, such chunks are cropped from their decode: a missing one costs its
    valid rows, a stored one (zarr writes edge chunks whole) the decode zarr makes too."""
    rows = 2**21 if stored else 2**40  # stored: 80 MiB decoded, past EDGE_WHOLE_BYTES
    array = zarr.create_array(
        tmp_path / "long.zarr", shape=(100, 10), chunks=(rows, 10), dtype="float32",
        fill_value=1.5, compressors=zarr.codecs.ZstdCodec(),
    )  # fmt: skip
    if stored:
        array[...] = np.arange(1000, dtype=np.float32).reshape(100, 10)
    reader = open_reader(zarr.open_array(tmp_path / "long.zarr", mode="r"), name="long")
    ranges = np.array([[90, 100], [3, 7]])
    want = zarr.open_array(tmp_path / "long.zarr", mode="r")[...]
    np.testing.assert_array_equal(reader.read_rows(ranges), np.r_[want[90:100], want[3:7]])
