"""zarr-torch-dataset (``zarrdataset``): its ``ZarrIterableDataset`` + ``ZarrDataLoader``.

Dense arrays only, chunked on axis 0, not sharded. Installed without dependencies into
``benchmarks/.venv-zarr-torch-dataset`` (a ``pip --target`` folder: it needs only torch,
zarr and NumPy, which come from the environment running the benchmark); settings ``site``
names that folder.

Its design: at the start of an epoch each worker reads *all* of its chunks into memory
(``array.blocks[i]``), then serves shuffled samples from there; with persistent workers,
later epochs are served from memory without reading the store again. So what is timed here
is one whole first epoch, from ``iter(loader)`` to its last batch (reading and delivering
every sample once), with ``shuffle_chunks=True``, ``shuffle_buffer=True``,
``num_workers`` workers (default 2) and ``batch_size`` as for the other contenders.
"""

from __future__ import annotations

import sys
import time
import warnings

from _common import emit, parse, skip


def main() -> None:
    store, s = parse()
    warnings.filterwarnings("ignore")
    if s.get("site"):
        sys.path.append(s["site"])
    try:
        from zarrdataset import ZarrDataLoader, ZarrIterableDataset
    except ImportError as exc:
        skip(f"zarr-torch-dataset is not installed: {exc}")
        return
    import zarr

    array = zarr.open_array(store, mode="r")
    dataset = ZarrIterableDataset(
        samples=array,
        targets=None,
        shuffle_chunks=True,
        chunks_shuffle_seed=0,
        shuffle_buffer=True,
        buffer_shuffle_seed=0,
    )
    loader = ZarrDataLoader(
        dataset=dataset, num_workers=int(s.get("num_workers", 2)), batch_size=s["batch_size"]
    )
    rows = nbytes = batches = 0
    start = time.perf_counter()
    for x in loader:
        rows += x.shape[0]
        nbytes += x.numel() * x.element_size()
        batches += 1
    seconds = time.perf_counter() - start
    emit({"rows": rows, "seconds": seconds, "batches": batches, "bytes": nbytes})


if __name__ == "__main__":
    main()
