"""One rank of the torchrun tests: load with DistributedSampler, train a few DDP steps, and
write the global ids this rank saw per epoch to ``--out/rank{R}.npz`` for the test to check."""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dali_zarr as dz


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--preload-nchunks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--shard", default="chunks")
    p.add_argument("--dist-info", default="torch")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = dz.open_dataset(args.data)
    sampler = dz.DistributedSampler(
        dz.ChunkSampler(
            chunk_size=args.chunk_size,
            preload_nchunks=args.preload_nchunks,
            batch_size=args.batch_size,
            seed=None,
        ),
        dist_info=args.dist_info,
        shard=args.shard,
    )
    loader = dz.Loader(dataset, sampler, obs=["cell_type"], return_index=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(dataset.n_features, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen, steps = {}, []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        ids, n = [], 0
        for batch in loader:
            loss = nn.functional.cross_entropy(model(torch.log1p(batch["X"])), batch["cell_type"])
            optimizer.zero_grad()
            loss.backward()  # a collective: a rank with one batch more would hang here
            optimizer.step()
            ids.append(batch["index"].numpy())
            n += 1
        seen[f"epoch{epoch}"] = np.concatenate(ids)
        steps.append(n)
    np.savez(
        f"{args.out}/rank{rank}.npz",
        steps=np.array(steps),
        len=len(loader),
        seed=sampler.seed,
        **seen,
    )
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
