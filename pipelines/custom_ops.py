"""Adding your own DALI ops after dali_zarr's: log1p-normalise X inside the DALI graph.

    python pipelines/custom_ops.py --data runs/demo.zarr

``Loader(transform=...)`` receives the named outputs of our graph as DALI ``DataNode``s
(``X``, obs columns, ``index``) and returns the dict to emit; anything DALI offers can go
there (math, casts, random augmentations). On the GPU path the same ops run on the GPU.
"""

from __future__ import annotations

import argparse
import os

import torch
from nvidia.dali import math as dmath

import dali_zarr as dz
from dali_zarr import synthetic


def log1p_counts(outputs: dict) -> dict:
    """X := log(1 + X), the usual single-cell count transform, as a DALI op."""
    outputs["X"] = dmath.log(outputs["X"] + 1.0)
    return outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/custom_ops.zarr")
    p.add_argument("--batches", type=int, default=5)
    args = p.parse_args()
    if not os.path.exists(args.data):  # never over a store that exists but fails to open
        synthetic.make_single_cell(args.data, n_obs=5_000)
    dataset = dz.open_dataset(args.data)
    sampler = dz.ChunkSampler(chunk_size=512, preload_nchunks=4, batch_size=256, seed=0)
    loader = dz.Loader(
        dataset, sampler, obs=["cell_type"], return_index=True, transform=log1p_counts
    )
    for i, batch in enumerate(loader):
        x = batch["X"]
        print(
            f"batch {i}: X {tuple(x.shape)} {x.dtype}, max log1p count {x.max().item():.3f}, "
            # code -1: a cell without a label (a missing value)
            f"labels {torch.bincount(batch['cell_type'][batch['cell_type'] >= 0]).tolist()}"
        )
        if i + 1 >= args.batches:
            break
    loader.close()


if __name__ == "__main__":
    main()
