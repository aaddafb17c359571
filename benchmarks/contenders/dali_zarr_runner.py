"""dali_zarr: ``dz.Loader`` over ``dz.ChunkSampler`` (one process, shuffled), dense or CSR.

Settings: ``output`` ("dense" | "csr"), ``device`` ("cpu" | "gpu"), ``chunk_size``,
``preload_nchunks``, ``batch_size``, ``warmup``, ``max_batches``, ``max_seconds``. The
loader keeps its defaults otherwise (DALI CPU pipeline, the direct read path). A batch
counts when the loader hands it out as a torch tensor (dense ``[B, n_genes]`` float32, or a
torch sparse CSR tensor); with ``device="gpu"`` the clock also waits for the GPU.
"""

from __future__ import annotations

import warnings

from _common import emit, epochs, measure, parse, skip


def main() -> None:
    store, s = parse()
    warnings.filterwarnings("ignore")
    import torch

    import dali_zarr as dz
    from dali_zarr.cli import batch_nbytes

    device = s.get("device", "cpu")
    if device == "gpu" and not torch.cuda.is_available():
        skip("no CUDA device")
        return
    dataset = dz.open_dataset(store)
    sampler = dz.ChunkSampler(
        chunk_size=s["chunk_size"],
        preload_nchunks=s["preload_nchunks"],
        batch_size=s["batch_size"],
        shuffle=True,
        drop_last=False,
        seed=0,
    )
    try:
        loader = dz.Loader(dataset, sampler, device=device, output=s["output"])
    except dz.ConfigError as exc:
        skip(f"device={device!r}: {exc}")
        return
    except Exception as exc:  # the GPU path's own dependencies (kvikio, cupy) may be missing
        if device != "gpu":
            raise
        skip(f"device='gpu': {type(exc).__name__}: {exc}")
        return

    def make_epoch(epoch: int):
        loader.set_epoch(epoch)
        return loader

    def consume(batch) -> tuple[int, int]:
        x = batch["X"]
        if x.is_cuda:
            torch.cuda.synchronize()
        return x.shape[0], batch_nbytes(x)

    result = measure(
        epochs(make_epoch),
        consume,
        warmup=s.get("warmup", 2),
        max_batches=s["max_batches"],
        max_seconds=s["max_seconds"],
    )
    result["read_paths"] = sorted(set(loader.read_paths().values()))
    emit(result)
    loader.close()


if __name__ == "__main__":
    main()
