"""nvCOMP's C API through ctypes (``dali_zarr.io.nvcomp_batched``), checked without a GPU.

libnvcomp loads and sizes its scratch memory on any machine, so CI checks the binding against
the installed nvCOMP: its headers' prototypes and option structs, the temporary-size query,
the argument table and the failure report. The decode itself needs a GPU: the ``gpu``
executor tests in test_gpu_plan.py run it against ``DirectReader`` (``nvcomp_api="c"``).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from dali_zarr.errors import ConfigError

nvcomp_batched = pytest.importorskip("dali_zarr.io.nvcomp_batched")


def _include_dir() -> Path:
    libnvcomp = pytest.importorskip("nvidia.libnvcomp")
    include = Path(libnvcomp.__file__).parent / "include" / "nvcomp"
    if not include.is_dir():
        pytest.skip("this nvidia-libnvcomp wheel ships no headers")
    return include


def _library():
    try:
        return nvcomp_batched.library()
    except (ImportError, OSError) as e:
        pytest.skip(f"libnvcomp unavailable: {e}")


@pytest.mark.parametrize(("kind", "header"), [("zstd", "zstd.h"), ("lz4", "lz4.h")])
def test_binding_matches_the_installed_headers(kind, header):
    """Same parameter count as the header's prototype, and an options struct of 64 bytes."""
    _library()
    text = (_include_dir() / header).read_text()
    name = nvcomp_batched.ALGORITHM[kind]
    proto = re.search(rf"nvcompBatched{name}DecompressAsync\s*\(([^;]*)\)\s*;", text)
    assert proto, f"no nvcompBatched{name}DecompressAsync in {header}"
    params = [p for p in proto.group(1).split(",") if p.strip()]
    temp_size, decompress = nvcomp_batched.functions(kind)
    assert len(params) == len(decompress.argtypes) == 11
    assert f"nvcompBatched{name}DecompressOpts_t decompress_opts" in " ".join(params[8].split())
    # the options struct: 32-bit enum/int fields, then reserved bytes, 64 bytes in all
    end = re.search(rf"\}}\s*nvcompBatched{name}DecompressOpts_t;", text).start()
    body = text[text.index("{", text.rindex("typedef struct", 0, end)) + 1 : end]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = [f.split() for f in body.split(";") if f.strip()]
    reserved = int(re.search(r"reserved\[(\d+)\]", body).group(1))
    assert 4 * (len(fields) - 1) + reserved == ctypes.sizeof(nvcomp_batched.DecompressOpts) == 64
    temp = re.search(rf"nvcompBatched{name}DecompressGetTempSizeAsync\s*\(([^;]*)\)\s*;", text)
    assert len([p for p in temp.group(1).split(",") if p.strip()]) == len(temp_size.argtypes)


def test_status_names_cover_the_installed_header():
    text = (_include_dir() / "shared_types.h").read_text()
    enum = re.search(r"typedef enum nvcompStatus_t\s*\{(.*?)\}", text, re.S)
    assert enum, "nvcompStatus_t not found in shared_types.h"
    codes = {int(v) for v in re.findall(r"nvcomp\w+\s*=\s*(\d+)", enum.group(1))}
    assert codes and codes == set(nvcomp_batched._STATUS)


@pytest.mark.parametrize("kind", ["zstd", "lz4"])
def test_temporary_size_query_runs_without_a_gpu(kind):
    _library()
    small = nvcomp_batched.temp_nbytes(kind, 10, 64 << 10, 10 * (64 << 10))
    large = nvcomp_batched.temp_nbytes(kind, 1000, 64 << 10, 1000 * (64 << 10))
    assert 0 <= small <= large
    # a call of mixed chunk sizes (a window's plans together) asks by its largest call
    sizes = np.array([64 << 10] * 10 + [16 << 10] * 990)
    calls = nvcomp_batched.call_slices(sizes, cap=(64 << 10) * 10)
    assert calls[0] == slice(0, 10) and len(calls) > 1
    # one buffer for all calls: what the neediest call asks for, no less and no more
    needs = [
        nvcomp_batched.temp_nbytes(kind, c.stop - c.start, int(sizes[c].max()), int(sizes[c].sum()))
        for c in calls
    ]
    assert nvcomp_batched.calls_temp_nbytes(kind, sizes, calls) == max(needs)


@pytest.mark.parametrize("chunk_nbytes", [64 << 10, 1 << 20])
def test_capped_calls_bound_the_scratch_memory(chunk_nbytes):
    """The installed nvCOMP's zstd scratch grows with a call's decoded bytes (about 3x):
    calls of at most CALL_NBYTES keep it near 3x CALL_NBYTES whatever the window's size."""
    _library()
    window = 8 * nvcomp_batched.CALL_NBYTES // chunk_nbytes  # chunks of a 1 GiB window
    sizes = np.full(window, chunk_nbytes)
    calls = nvcomp_batched.call_slices(sizes)
    assert len(calls) == 8
    capped = nvcomp_batched.calls_temp_nbytes("zstd", sizes, calls)
    whole = nvcomp_batched.temp_nbytes("zstd", window, chunk_nbytes, window * chunk_nbytes)
    assert capped <= 4 * nvcomp_batched.CALL_NBYTES < whole


@pytest.mark.parametrize("kind", ["zstd", "lz4"])
def test_read_plans_meet_the_decoders_alignment(kind):
    """The byte plan packs compressed chunks at any byte offset and starts decoded slots on
    ALIGN boundaries; scratch and tables are cupy allocations (256-byte aligned). The
    installed nvCOMP must accept that, or the GPU decode would read misaligned buffers."""
    _library()
    from dali_zarr.io.gpu import ALIGN

    inputs, outputs, temp = nvcomp_batched.required_alignments(kind)
    assert inputs == 1
    assert ALIGN % outputs == 0 and 256 % temp == 0


def test_call_table_points_at_each_chunk():
    table = nvcomp_batched.call_table(
        1 << 20, np.array([0, 512, 1536]), np.array([100, 900, 7]), 1 << 30,
        np.array([0, 4096, 8192]), 4000,
    )  # fmt: skip
    assert table.dtype == np.uint64 and table.shape == (6, 3)
    assert table[0].tolist() == [(1 << 20), (1 << 20) + 512, (1 << 20) + 1536]
    assert table[1].tolist() == [100, 900, 7]
    assert table[2].tolist() == [(1 << 30), (1 << 30) + 4096, (1 << 30) + 8192]
    assert table[3].tolist() == [4000] * 3
    assert not table[4:].any()  # nvCOMP writes decoded sizes and statuses there
    zeros = np.zeros(3, dtype=np.int64)
    sizes = np.array([4000, 8000, 2000])  # each chunk's own decoded size
    assert nvcomp_batched.call_table(0, zeros, zeros, 0, zeros, sizes)[3].tolist() == [
        4000, 8000, 2000,
    ]  # fmt: skip


def test_failed_chunks_names_bad_statuses_and_short_chunks():
    table = np.zeros((6, 4), dtype=np.uint64)
    table[4] = [4000, 4000, 3999, 4000]  # decoded sizes
    statuses = table[5].view(np.int32)  # n 32-bit statuses at the start of the row
    statuses[:4] = [0, 12, 0, 0]
    assert nvcomp_batched.failed_chunks(table, 4000) == [
        (1, "nvCOMP status 12 (cannot decompress)"),
        (2, "decoded to 3999 bytes, expected 4000"),
    ]
    table[4, 2], statuses[1] = 4000, 0
    assert nvcomp_batched.failed_chunks(table, 4000) == []
    # chunks of several plans in one call: each checked against its own decoded size
    expected = np.array([4000, 4000, 8000, 4000])
    assert nvcomp_batched.failed_chunks(table, expected) == [
        (2, "decoded to 4000 bytes, expected 8000")
    ]
    table[4, 2] = 8000
    assert nvcomp_batched.failed_chunks(table, expected) == []


def test_on_unless_turned_off(monkeypatch):
    """The C API is the default since it ran on a GPU (2026-11-26); ``0`` turns it off, and a
    value that is neither is refused rather than read as either."""
    monkeypatch.delenv(nvcomp_batched.ENV_SWITCH, raising=False)
    assert nvcomp_batched.enabled()
    for value, want in (("1", True), (" 0 ", False), ("0", False)):
        monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, value)
        assert nvcomp_batched.enabled() is want
    monkeypatch.setenv(nvcomp_batched.ENV_SWITCH, "yes")
    with pytest.raises(ConfigError, match=r"DALI_ZARR_NVCOMP_BATCHED='yes': use 1 .* or 0"):
        nvcomp_batched.enabled()


def test_statuses_are_read_back_on_the_decoders_stream():
    """check() copies the statuses back on the executor's stream: with no stream, cupy
    copies on the legacy default stream, which waits for the training step torch queued
    there (the reader thread would stall once per plan)."""
    from dali_zarr.io import nvcomp_batched

    seen = []

    class Table:
        def get(self, stream=None):
            seen.append(stream)
            back = np.zeros((6, 2), np.uint64)
            back[4] = 8
            return back

    stream = object()
    decoder = object.__new__(nvcomp_batched.BatchedDecoder)
    decoder.stream = stream
    decoder._pending = (Table(), 2, 8)
    assert decoder.check() == []
    assert seen == [stream]


def test_the_installed_libnvcomp_serves_the_c_api(monkeypatch):
    """Where nvidia-libnvcomp is installed (CI), the C API loads and is the one used; a
    machine where it does not is test_gpu_plan.py's fallback test."""
    pytest.importorskip("nvidia.libnvcomp")
    from dali_zarr.io.gpu import GpuSupport, describe_path

    monkeypatch.delenv(nvcomp_batched.ENV_SWITCH, raising=False)
    assert nvcomp_batched.load_error() is None and nvcomp_batched.use_c_api()
    support = GpuSupport(True, True, True, False, True, "")
    assert describe_path("zstd", "", support).endswith("nvCOMP zstd (C API)")
