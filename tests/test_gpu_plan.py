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
import zlib

import numcodecs
import numpy as np
import pytest
from zarr.codecs import BytesCodec

from dali_zarr.errors import ChunkReadError
from dali_zarr.io import DirectReader, open_reader
from dali_zarr.io.gpu import (
    GPU_KINDS,
    NotPlannable,
    copy_segments_cpu,
    execute_plan_cpu,
    gpu_codec_kind,
    plan_rows,
    probe_gpu,
)
from tests.stores import compressors, has_cuda, needs_cuda, random_ranges, write, write_layout

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


def _check_plan_invariants(plan, reader) -> None:
    # every chunk read at most once, in increasing chunk order, to its own slot
    chunks = [r.chunk for r in plan.reads]
    assert chunks == sorted(set(chunks))
    slots = {int(c): i for i, c in enumerate(plan.chunks)}
    for r in plan.reads:
        assert r.decoded_offset == slots[r.chunk] * plan.slot_nbytes
        assert r.decoded_offset % 256 == 0
        if plan.kind == "none":
            assert r.staging_offset == -1 and r.nbytes == plan.chunk_nbytes
        else:
            assert r.staging_offset % 256 == 0
            assert r.staging_offset + r.nbytes <= plan.staging_nbytes
        assert r.file_offset + r.nbytes <= os.path.getsize(r.path)
    # staging regions never overlap
    regions = sorted((r.staging_offset, r.nbytes) for r in plan.reads if r.staging_offset >= 0)
    for (a, n), (b, _) in itertools.pairwise(regions):
        assert a + n <= b
    # segments stay inside both buffers and cover the window exactly once
    seg = plan.segments
    if len(seg):
        elems = plan.decoded_nbytes // plan.dtype.itemsize
        assert (seg[:, 2] > 0).all() and (seg[:, 0] + seg[:, 2] <= elems).all()
        covered = np.zeros(int(np.prod(plan.out_shape)), dtype=np.int64)
        for _, d, k in seg:
            covered[d : d + k] += 1
        assert (covered == 1).all()


def test_lz4_plan_reads_the_bare_block(tmp_path):
    data = np.arange(4096, dtype=np.float32)
    arr = write(tmp_path / "a.zarr", data, chunks=(512,), compressors=compressors("lz4", 3))
    reader = open_reader(arr, name="a")
    plan = plan_rows(reader, np.array([[0, 4096]]))
    locations = reader.chunk_locations([(int(c),) for c in plan.chunks])
    for rd, (path, offset, nbytes) in zip(plan.reads, locations, strict=True):
        assert (rd.path, rd.file_offset, rd.nbytes) == (path, offset + 4, nbytes - 4)
        with open(path, "rb") as f:  # the skipped header is numcodecs' decoded size
            f.seek(offset)
            assert int.from_bytes(f.read(4), "little") == plan.chunk_nbytes


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


@pytest.mark.parametrize("kind", ["none", "zstd", "lz4", "host"])
@pytest.mark.parametrize(("kvikio", "gds", "nvcomp"), [(1, 1, 1), (1, 0, 1), (1, 0, 0), (0, 0, 1)])
def test_described_path_is_the_path_taken(kind, kvikio, gds, nvcomp):
    """read_paths() says "device" exactly when the executor reads to the device."""
    from dali_zarr.io.gpu import GpuSupport, describe_path, reads_to_device

    support = GpuSupport(True, True, bool(kvikio), bool(gds), bool(nvcomp), "")
    line = describe_path(kind, "blosc" if kind == "host" else "", support)
    on_device = reads_to_device(kind, kvikio=bool(kvikio), nvcomp=bool(nvcomp))
    assert on_device == (kind in ("none", "zstd", "lz4") and kvikio and (kind == "none" or nvcomp))
    assert ("→ device" in line) == on_device, line
    assert ("host read and decode" in line) == (not on_device), line
    if on_device:
        assert ("GDS" if gds else "compat") in line
        assert ("nvCOMP" in line) == (kind != "none")
    else:
        why = "blosc" if kind == "host" else ("kvikio" if not kvikio else "nvCOMP")
        assert why in line


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
def test_gpu_executor_matches_direct_reader(tmp_path, monkeypatch, fmt, codec, sharded, nvcomp_api):
    import cupy

    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import GpuPlanExecutor

    monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "1" if nvcomp_api == "c" else "0")

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


# ------------------------------------------------- the GPU executor's control flow, faked CUDA


class _Dev(np.ndarray):
    """A host array standing in for a cupy array (what the executor calls on it)."""

    def set(self, arr, stream=None):
        self[...] = arr


def _fake_cuda_modules(monkeypatch, log):
    """cupy, kvikio and nvidia.nvcomp stand-ins backed by NumPy, os.pread and numcodecs."""
    import contextlib
    import sys
    import types

    class Ctx(contextlib.nullcontext):
        ptr = 1234

        def synchronize(self):
            pass

    cupy = types.ModuleType("cupy")
    cupy.empty = lambda n, dtype: np.zeros(n, dtype).view(_Dev)
    cupy.asarray = np.asarray
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
            return types.SimpleNamespace(get=lambda: got)

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
    from dali_zarr.io import gpu
    from dali_zarr.io.gpu import GpuSupport

    fake = GpuSupport(cuda=True, dali_gpu=True, kvikio=True, gds=False, nvcomp=True, reason="")
    monkeypatch.setattr(gpu, "probe_gpu", lambda: fake)


@pytest.mark.parametrize(("codec", "path"), [("zstd", "device"), ("lz4", "device"),
                                             ("none", "device"), ("blosc", "host")])  # fmt: skip
@pytest.mark.parametrize("sharded", [False, True])
def test_gpu_executor_control_flow_with_faked_cuda(tmp_path, monkeypatch, codec, path, sharded):
    """GpuPlanExecutor.run with cupy/kvikio/nvCOMP replaced by NumPy stand-ins: exercises its
    buffers, offsets, path choice, fills and segment copies (not the libraries themselves)."""
    from dali_zarr.io.gpu import GpuPlanExecutor

    log: list = []
    _fake_cuda_modules(monkeypatch, log)
    monkeypatch.setattr(
        GpuPlanExecutor,
        "copy_segments",
        lambda self, out, src, seg: copy_segments_cpu(out, src, seg),
    )
    _, arr = write_layout(tmp_path / "a.zarr", SHAPES["3d-rowchunks"], codec=codec, sharded=sharded)
    shp, _, chunks, _ = SHAPES["3d-rowchunks"]
    reader = open_reader(arr, name="a")
    executor = GpuPlanExecutor(0, max_open_files=2)
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
            assert [e for e in log if e[0] == "pread"] == [("pread", r.nbytes) for r in plan.reads]
            decodes = [e for e in log if e[0] == "decode"]
            assert decodes == ([("decode", {"zstd": "Zstd", "lz4": "LZ4"}[codec], len(plan.reads))]
                               if codec != "none" and plan.reads else [])  # fmt: skip
        else:
            assert not log  # host decode: no kvikio, no nvCOMP
    assert len(executor._files) <= 2
    executor.close()
