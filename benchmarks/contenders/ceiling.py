"""The ceiling: read and decode every chunk of the epoch with all cores, and nothing else.

Settings: ``kind`` is ``"csr"`` (every inner chunk of ``X/data`` and ``X/indices``),
``"dense"`` (the same, plus densifying the rows into float32 ``[batch_size, n_genes]``
batches) or ``"cube"`` (every chunk of a dense array); ``threads`` (default: all cores).

Chunks are read with ``os.pread`` (for a shard: its index, then each inner chunk) and
decoded with numcodecs on a thread pool; no zarr-python, no dali_zarr. Densifying is one
compiled loop (numba, GIL released, so the pool's threads run it side by side): each task
owns one batch of consecutive rows, zeroes a reusable buffer and writes ``data`` at
``row * n_genes + indices``; a decoded chunk that two batches share is decoded once. (It
was NumPy's scatter, slower than the loader's own compiled op: the loader measured above
100 % of it.) The pass over the whole store is repeated until ``min_seconds`` have passed.
Supports what the benchmark writes: zarr v3, ``bytes`` + zstd/gzip/blosc/crc32c, sharded
(``sharding_indexed``) or not.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product

import numba
import numcodecs
import numpy as np
from _common import emit, parse


@numba.njit(nogil=True, cache=True)
def _densify(out, row_starts, cols, vals, n_genes):  # pragma: no cover (compiled)
    """out[r, cols[p]] = vals[p] for the rows' entries, out zeroed first (flat out)."""
    out[:] = 0
    for r in range(row_starts.shape[0] - 1):
        base = r * n_genes
        for p in range(row_starts[r], row_starts[r + 1]):
            out[base + cols[p]] = vals[p]


_EMPTY = 2**64 - 1


class Chunks:
    """The chunks of one zarr v3 array: ``read(i)`` returns inner chunk ``i`` decoded, flat."""

    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "zarr.json")) as f:
            meta = json.load(f)
        if meta.get("zarr_format") != 3:
            raise SystemExit(f"{path}: the ceiling reads zarr v3 arrays only")
        self.path = path
        self.shape = tuple(meta["shape"])
        self.dtype = np.dtype(meta["data_type"])
        outer = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        enc = meta["chunk_key_encoding"]
        self.sep = enc.get("configuration", {}).get(
            "separator", "/" if enc["name"] == "default" else "."
        )
        self.prefix = "c" + self.sep if enc["name"] == "default" else ""
        codecs = meta["codecs"]
        self.sharded = codecs[0]["name"] == "sharding_indexed"
        if self.sharded:
            conf = codecs[0]["configuration"]
            self.inner = tuple(conf["chunk_shape"])
            self.codecs = conf["codecs"]
            self.index_at_end = conf.get("index_location", "end") == "end"
            self.index_crc = any(c["name"] == "crc32c" for c in conf["index_codecs"])
        else:
            self.inner = outer
            self.codecs = codecs
        self.outer = outer
        self.per_shard = tuple(o // i for o, i in zip(outer, self.inner, strict=True))
        self.grid = tuple(math.ceil(s / o) for s, o in zip(self.shape, outer, strict=True))
        self.decoders = [_decoder(c) for c in reversed(self.codecs) if c["name"] != "bytes"]
        self.n_per_shard = math.prod(self.per_shard)
        self._indexes: dict[tuple[int, ...], np.ndarray] = {}
        self._lock = threading.Lock()
        self._scratch = threading.local()  # a decode buffer per thread, for read(reuse=True)

    @property
    def n_inner(self) -> int:
        """Inner chunks along axis 0 (the benchmark's arrays are chunked on axis 0 only)."""
        return math.ceil(self.shape[0] / self.inner[0])

    def _key(self, outer_coords: tuple[int, ...]) -> str:
        return os.path.join(self.path, self.prefix + self.sep.join(map(str, outer_coords)))

    def _index(self, coords: tuple[int, ...], fd: int) -> np.ndarray:
        with self._lock:
            index = self._indexes.get(coords)
        if index is None:
            nbytes = 16 * self.n_per_shard + (4 if self.index_crc else 0)
            offset = os.fstat(fd).st_size - nbytes if self.index_at_end else 0
            raw = os.pread(fd, nbytes, offset)
            index = np.frombuffer(raw[: 16 * self.n_per_shard], dtype="<u8").reshape(-1, 2)
            with self._lock:
                self._indexes[coords] = index
        return index

    def read(self, i: int, reuse: bool = False) -> np.ndarray:
        """Inner chunk ``i`` along axis 0 (all of it, over every other axis), decoded.
        ``reuse``: into this thread's buffer, valid until its next read (as the loader
        decodes into memory it has already touched; a fresh array per chunk costs page
        faults, which made this ceiling lower than the loader on the cube)."""
        parts = []
        k0 = i // self.per_shard[0]
        within0 = i % self.per_shard[0]
        for rest in product(*(range(g) for g in self.grid[1:])):
            outer = (k0, *rest)
            parts.extend(self._read_outer(outer, within0, reuse))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _buffer(self) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = np.empty(math.prod(self.inner), dtype=self.dtype)
        return buf

    def _read_outer(self, outer: tuple[int, ...], within0: int, reuse: bool) -> list[np.ndarray]:
        fd = os.open(self._key(outer), os.O_RDONLY)
        out = (
            self._buffer() if reuse and math.prod(self.grid[1:] + self.per_shard[1:]) == 1 else None
        )
        try:
            if not self.sharded:
                return [self._decode(os.pread(fd, os.fstat(fd).st_size, 0), out)]
            index = self._index(outer, fd)
            parts = []
            for rest in product(*(range(p) for p in self.per_shard[1:])):
                flat = np.ravel_multi_index((within0, *rest), self.per_shard)
                offset, nbytes = (int(v) for v in index[flat])
                if offset == _EMPTY:
                    parts.append(np.zeros(math.prod(self.inner), dtype=self.dtype))
                else:
                    parts.append(self._decode(os.pread(fd, nbytes, offset), out))
            return parts
        finally:
            os.close(fd)

    def _decode(self, raw: bytes, out: np.ndarray | None = None) -> np.ndarray:
        buf = raw
        for k, decode in enumerate(self.decoders):
            last = k == len(self.decoders) - 1
            buf = decode(buf, out) if last and out is not None else decode(buf)
        return np.frombuffer(buf, dtype=self.dtype)


def _decoder(codec: dict):
    name, conf = codec["name"], codec.get("configuration", {})
    if name == "zstd":
        return numcodecs.Zstd().decode
    if name == "gzip":
        return numcodecs.GZip().decode
    if name == "blosc":
        return numcodecs.Blosc().decode
    if name == "crc32c":
        return lambda b, out=None: memoryview(b)[:-4]
    raise SystemExit(f"ceiling: codec {name!r} ({conf}) is not supported here")


def csr_pass(pool: ThreadPoolExecutor, arrays: list[Chunks]) -> None:
    futures = [pool.submit(a.read, i, True) for a in arrays for i in range(a.n_inner)]
    for f in futures:
        f.result()


class DecodedCache:
    """Decoded inner chunks shared by the batches that overlap them, each decoded once."""

    def __init__(self, array: Chunks, users: np.ndarray) -> None:
        self.array = array
        self.users = users.copy()  # batches still to read chunk i
        self.entries: dict[int, tuple[threading.Event, list]] = {}
        self.lock = threading.Lock()

    def get(self, i: int) -> np.ndarray:
        with self.lock:
            entry = self.entries.get(i)
            owner = entry is None
            if owner:
                entry = self.entries[i] = (threading.Event(), [])
        event, slot = entry
        if owner:
            slot.append(self.array.read(i))
            event.set()
        else:
            event.wait()
        value = slot[0]
        with self.lock:
            self.users[i] -= 1
            if self.users[i] == 0:
                del self.entries[i]
        return value


def dense_pass(
    pool: ThreadPoolExecutor,
    data: Chunks,
    indices: Chunks,
    indptr: np.ndarray,
    n_genes: int,
    batch_size: int,
    local: threading.local,
) -> None:
    n_obs = len(indptr) - 1
    starts = np.arange(0, n_obs, batch_size)
    stops = np.minimum(starts + batch_size, n_obs)
    span = data.inner[0]
    assert indices.inner[0] == span, "data and indices chunked alike"
    first = indptr[starts] // span
    last = np.maximum(indptr[stops] - 1, indptr[starts]) // span
    users = np.zeros(data.n_inner + 1, dtype=np.int64)
    for a, b in zip(first, last, strict=True):
        users[a : b + 1] += 1
    caches = [DecodedCache(data, users), DecodedCache(indices, users)]

    def batch(r0: int, r1: int, c0: int, c1: int) -> None:
        e0, e1 = int(indptr[r0]), int(indptr[r1])
        pieces = [[cache.get(i) for i in range(c0, c1 + 1)] for cache in caches]
        base = c0 * span
        vals, cols = (np.concatenate(p)[e0 - base : e1 - base] for p in pieces)
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(batch_size * n_genes, dtype=np.float32)
        out = buf[: (r1 - r0) * n_genes]
        _densify(out, indptr[r0 : r1 + 1] - e0, cols, vals, n_genes)

    futures = [
        pool.submit(batch, int(r0), int(r1), int(c0), int(c1))
        for r0, r1, c0, c1 in zip(starts, stops, first, last, strict=True)
    ]
    for f in futures:
        f.result()


def main() -> None:
    store, settings = parse()
    kind = settings.get("kind", "csr")
    threads = int(settings.get("threads") or os.cpu_count() or 1)
    min_seconds = float(settings.get("min_seconds", 1.0))
    local = threading.local()
    with ThreadPoolExecutor(threads) as pool:
        if kind == "cube":
            arrays = [Chunks(store)]
            n_obs = arrays[0].shape[0]

            def one_pass() -> None:
                csr_pass(pool, arrays)

        else:
            x = os.path.join(store, "X")
            data, indices = Chunks(os.path.join(x, "data")), Chunks(os.path.join(x, "indices"))
            ip = Chunks(os.path.join(x, "indptr"))
            indptr = np.concatenate([ip.read(i) for i in range(ip.n_inner)])[: ip.shape[0]]
            indptr = indptr.astype(np.int64)
            n_obs = len(indptr) - 1
            with open(os.path.join(x, "zarr.json")) as f:
                n_genes = int(json.load(f)["attributes"]["shape"][1])
            batch_size = int(settings.get("batch_size", 4096))
            if kind == "csr":

                def one_pass() -> None:
                    csr_pass(pool, [data, indices])

            else:

                def one_pass() -> None:
                    dense_pass(pool, data, indices, indptr, n_genes, batch_size, local)

        one_pass()  # warm-up: shard indexes, pool threads, page cache
        rows = passes = 0
        start = time.perf_counter()
        while passes == 0 or time.perf_counter() - start < min_seconds:
            one_pass()
            rows += n_obs
            passes += 1
        seconds = time.perf_counter() - start
    emit({"rows": rows, "seconds": seconds, "batches": passes, "bytes": 0, "threads": threads})


if __name__ == "__main__":
    main()
