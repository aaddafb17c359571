"""One JAX process of tests/test_jax.py: joins a 2-process JAX CPU cluster on localhost,
iterates a JaxLoader over ``DistributedSampler(dist_info="jax")`` and writes the global ids
it saw per epoch to ``--out/rank{R}.npz``."""

from __future__ import annotations

import argparse

import jax
import numpy as np

import dali_zarr as dz
from dali_zarr.jax_loader import JaxLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    sampler = dz.DistributedSampler(
        dz.ChunkSampler(chunk_size=32, preload_nchunks=4, batch_size=args.batch_size, seed=5),
        dist_info="jax",
    )
    loader = JaxLoader(dz.open_dataset(args.data), sampler, obs=["cell_type"], return_index=True)
    seen, steps = {}, []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        ids = []
        for batch in loader:
            assert isinstance(batch["X"], jax.Array) and batch["X"].shape[0] == args.batch_size
            ids.append(np.asarray(batch["index"]))
        seen[f"epoch{epoch}"] = np.concatenate(ids)
        steps.append(len(ids))
    np.savez(
        f"{args.out}/rank{jax.process_index()}.npz",
        steps=np.array(steps),
        len=len(loader),
        rank=sampler.rank,
        world=sampler.world_size,
        **seen,
    )
    loader.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
