"""The plain baseline: torch ``DataLoader`` + ``DistributedSampler`` indexing the zarr array.

A map-style ``Dataset`` whose ``__getitem__(i)`` reads observation ``i`` through
zarr-python (default codec pipeline): for the sparse store ``X/data[a:b]`` and
``X/indices[a:b]`` with ``a, b = indptr[i], indptr[i + 1]`` (``indptr`` read once), densified
into a float32 row; for the dense cube ``array[i]``. ``DistributedSampler(num_replicas=1,
rank=0, shuffle=True)``, ``num_workers`` worker processes (default 2), default collate.
Zarr arrays are opened in each worker (not inherited across fork).

Settings: ``batch_size``, ``num_workers``, ``warmup``, ``max_batches``, ``max_seconds``.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from _common import emit, epochs, measure, parse


class ZarrRows:
    """Map-style dataset over a sparse AnnData ``X`` or a dense zarr array (axis 0)."""

    def __init__(self, store: str) -> None:
        import zarr

        self.store = store
        self.sparse = os.path.isdir(os.path.join(store, "X"))
        if self.sparse:
            x = zarr.open_group(store, mode="r")["X"]
            self.indptr = x["indptr"][...].astype(np.int64)
            self.n_genes = int(x.attrs["shape"][1])
            self.n = len(self.indptr) - 1
        else:
            self.n = zarr.open_array(store, mode="r").shape[0]
        self._pid = None

    def _open(self) -> None:
        import zarr

        if self.sparse:
            x = zarr.open_group(self.store, mode="r")["X"]
            self.data, self.indices = x["data"], x["indices"]
        else:
            self.array = zarr.open_array(self.store, mode="r")
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self._pid != os.getpid():
            self._open()
        if not self.sparse:
            return self.array[i]
        a, b = int(self.indptr[i]), int(self.indptr[i + 1])
        row = np.zeros(self.n_genes, dtype=np.float32)
        row[self.indices[a:b]] = self.data[a:b]
        return row


def main() -> None:
    store, s = parse()
    warnings.filterwarnings("ignore")
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = ZarrRows(store)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    workers = int(s.get("num_workers", 2))
    loader = DataLoader(
        dataset,
        batch_size=s["batch_size"],
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
    )

    def make_epoch(epoch: int):
        sampler.set_epoch(epoch)
        return loader

    result = measure(
        epochs(make_epoch),
        lambda x: (x.shape[0], x.numel() * x.element_size()),
        warmup=s.get("warmup", 1),
        max_batches=s["max_batches"],
        max_seconds=s["max_seconds"],
    )
    result["num_workers"] = workers
    emit(result)


if __name__ == "__main__":
    main()
