"""One rank of the test of ranks that disagree (``test_multinode.py``): under torchrun, or
with ``--jax`` one of the JAX processes the test starts (``jax.distributed``, JaxLoader).

Runs every scenario in turn over one gloo process group (or JAX's processes) and writes
``--out/rank{R}.json``: per scenario, the ConfigError text this rank raised, or ``"ok"``
(plus what the scenario reports). Each scenario builds what a user would: a
DistributedSampler and a Loader, in which one rank differs from the others (its seed, its
batch size, its store, the step its state was saved at), and the ranks must all raise the
same error instead of planning apart. ``--stores`` gives a store and a smaller one.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr

import dali_zarr as dz
from dali_zarr import distributed, synthetic

#: "torch" or "jax": whose processes the ranks are (set by main)
FRAMEWORK = ["torch"]


def sampler(*, seed: int | None = 0, batch_size: int = 32, dist_info=None, shuffle=True,
            enforce_equal_batches=True, drop_last=True, shard="chunks"):  # fmt: skip
    inner = dz.ChunkSampler(chunk_size=40, preload_nchunks=4, batch_size=batch_size, seed=seed,
                            shuffle=shuffle, drop_last=drop_last)  # fmt: skip
    return dz.DistributedSampler(
        inner,
        dist_info=dist_info or FRAMEWORK[0],
        enforce_equal_batches=enforce_equal_batches,
        shard=shard,
    )


def loader(data, s: dz.DistributedSampler, **kwargs) -> dz.Loader:
    """A Loader (JaxLoader under JAX) over ``data``, a store's path or a dataset."""
    ds = dz.open_dataset(data) if isinstance(data, str) else data
    if FRAMEWORK[0] == "jax":
        from dali_zarr.jax_loader import JaxLoader

        return JaxLoader(ds, s, num_threads=1, return_index=True, **kwargs)
    return dz.Loader(ds, s, num_threads=1, return_index=True, **kwargs)


def scenarios(rank: int, big: str, small: str, link: str) -> dict[str, Callable[[], object]]:
    def seed_per_rank():
        sampler(seed=rank)

    def batch_per_rank():
        sampler(batch_size=32 * (rank + 1))

    def mixed_drawn_seed():
        sampler(seed=None if rank == 0 else 7)

    def drawn_seed():
        return sampler(seed=None).seed

    def own_world():  # each process its own world of one: nothing is exchanged
        s = sampler(seed=rank, dist_info=lambda: (0, 1))
        return s.ranks_checked

    def store_per_rank():
        loader(big if rank == 0 else small, sampler()).close()

    def same_store_other_paths():  # a node-local copy under another path is the same data
        with loader(big if rank == 0 else link, sampler()) as ld:
            return len(ld)

    def resume(steps: int, **settings) -> Callable[[], object]:
        # 960 rows: 480 a rank, 15 batches each also without enforce_equal_batches
        data = dz.Subset(dz.open_dataset(big), np.arange(960)) if settings else big

        def run():
            s = sampler(**settings)
            with loader(data, s) as first:
                first.set_epoch(1)
                for k, _ in enumerate(first, 1):
                    if k == steps:
                        break
                state = first.state_dict()
            with loader(data, s) as again:
                again.load_state_dict(state)
                return [int(np.asarray(b["index"]).size) for b in again]

        return run

    def seed_per_rank_unshuffled():  # the seed orders nothing then
        return sampler(seed=rank, shuffle=False).ranks_checked

    def sampler_refused_on_one_rank():  # rank 1's own argument check fails
        sampler(shard="chunks" if rank == 0 else "rows")

    def path_on_one_rank():  # rank 1 passes the store's path, not an opened dataset
        dz.Loader(dz.open_dataset(big) if rank == 0 else big, sampler(), num_threads=1)

    def refused_on_one_rank():  # rank 1 alone asks what its store cannot give
        loader(big, sampler(), output="dense" if rank == 0 else "sideways")

    def uneven_counts():  # 961 rows: 480 and 481 a rank, 15 and 16 batches of 32
        ds = dz.Subset(dz.open_dataset(big), np.arange(961))
        with loader(ds, sampler(enforce_equal_batches=False, drop_last=False)) as ld:
            return sum(1 for _ in ld)

    def state_refused_on_one_rank():
        s = sampler()
        with loader(big, s) as first:
            state = first.state_dict()
        if rank == 1:
            state = {**state, "sampler": {**state["sampler"], "batch_size": 64}}
        with loader(big, s) as again:
            again.load_state_dict(state)

    def raw_error_on_one_rank():  # not a ConfigError: it must reach the exchange all the same
        ds = dz.open_dataset(big)
        if rank == 1:  # its store fails as the loader looks at it (a disk gone, say)

            class Unreadable(type(ds)):
                @property
                def n_obs(self) -> int:
                    raise OSError("disk gone")

            ds.__class__ = Unreadable
        try:
            loader(ds, sampler())
        except OSError as e:
            return f"OSError: {e}"

    def obs_refused_on_one_rank():  # rank 1's copy of the store lacks a column it asks for
        try:
            loader(big, sampler(), obs=["cell_type" if rank == 0 else "no_such_column"])
        except dz.DatasetError as e:
            return f"DatasetError: {e}"

    def state_into_a_used_loader_on_one_rank():  # rank 1 took a batch before loading
        s = sampler()
        with loader(big, s) as first:
            state = first.state_dict()
        with loader(big, s) as again:
            if rank == 1:
                next(iter(again))
            again.load_state_dict(state)

    def subset_per_rank():  # a split drawn on each rank (an unseeded RNG): same size, other rows
        rows = np.random.default_rng(rank).choice(1_000, 600, replace=False)
        loader(dz.Subset(dz.open_dataset(big), rows), sampler()).close()

    def features_per_rank():  # as many genes on each rank, other ones
        loader(dz.FeatureSubset(dz.open_dataset(big), [rank, 2]), sampler()).close()

    def env_stale_on_one_rank():  # a wrapper on rank 1's node left RANK=0 WORLD_SIZE=1
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        os.environ.update(RANK="0", WORLD_SIZE="2" if rank == 0 else "1")
        try:
            sampler(dist_info="env")
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.update({k: v})

    def element_per_rank():  # one store read as X on rank 0, as layers/counts on rank 1
        path = Path(big).parent / f"layers_rank{rank}.zarr"
        if not path.exists():
            import anndata as ad
            import scipy.sparse as sp

            x = sp.random(1_000, 16, density=0.1, format="csr", dtype=np.float32, random_state=0)
            ad.AnnData(X=x, layers={"counts": x.copy()}).write_zarr(path)
        element = "X" if rank == 0 else "layers/counts"
        loader(dz.open_dataset(str(path), element=element), sampler()).close()

    def collection_order_per_rank():  # a glob listed in another order on rank 1's node
        parts = [dz.open_dataset(big), dz.open_dataset(small)]
        loader(dz.Collection(parts if rank == 0 else parts[::-1]), sampler()).close()

    def equal_parts(order: str) -> Callable[[], object]:
        """Two stores of one size, written by each rank to a path of its own (node-local
        copies of the same data): joined in the same order (``"same"``) or, on rank 1, in
        the other (``"swapped"``, which sizes alone did not tell apart)."""

        def scenario():
            parts = []
            for seed in (1, 2):
                path = Path(big).parent / f"equal_seed{seed}_rank{rank}.zarr"
                if not path.exists():
                    synthetic.make_single_cell(
                        path, n_obs=400, n_features=16, chunk_elements=256, seed=seed
                    )
                parts.append(dz.open_dataset(str(path)))
            swapped = order == "swapped" and rank == 1
            with loader(dz.Collection(parts[::-1] if swapped else parts), sampler()) as ld:
                return len(ld)

        return scenario

    def chunk_sampler_under_a_world():  # every rank reads every row: said, not refused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inner = dz.ChunkSampler(chunk_size=40, preload_nchunks=4, batch_size=32, seed=0)
            with loader(big, inner) as ld:
                rows = len(ld) * 32
        return [rows, [str(w.message) for w in caught if "every rank reads" in str(w.message)]]

    def int32_refused_on_one_rank():  # JaxLoader: rank 1's copy holds values int32 wraps
        path = Path(big).parent / f"int64_obs_rank{rank}.zarr"
        if not path.exists():
            synthetic.make_single_cell(path, n_obs=1_000, n_features=16, chunk_elements=256)
            obs = zarr.open_group(path, mode="r+")["obs"]
            counts = np.arange(1_000, dtype=np.int64) + (2**40 if rank == 1 else 0)
            obs.create_array("count", data=counts).attrs.update(
                {"encoding-type": "array", "encoding-version": "0.2.0"}
            )
        loader(str(path), sampler(), obs=["count"]).close()

    return {
        "subset_per_rank": subset_per_rank,
        "features_per_rank": features_per_rank,
        "collection_order_per_rank": collection_order_per_rank,
        "equal_parts_swapped": equal_parts("swapped"),
        "equal_parts_copies": equal_parts("same"),
        "chunk_sampler_under_a_world": chunk_sampler_under_a_world,
        "env_stale_on_one_rank": env_stale_on_one_rank,
        "element_per_rank": element_per_rank,
        "obs_refused_on_one_rank": obs_refused_on_one_rank,
        "state_into_a_used_loader_on_one_rank": state_into_a_used_loader_on_one_rank,
        "raw_error_on_one_rank": raw_error_on_one_rank,
        "seed_per_rank_unshuffled": seed_per_rank_unshuffled,
        "refused_on_one_rank": refused_on_one_rank,
        "sampler_refused_on_one_rank": sampler_refused_on_one_rank,
        "path_on_one_rank": path_on_one_rank,
        "state_refused_on_one_rank": state_refused_on_one_rank,
        "uneven_counts": uneven_counts,
        "seed_per_rank": seed_per_rank,
        "batch_per_rank": batch_per_rank,
        "mixed_drawn_seed": mixed_drawn_seed,
        "drawn_seed": drawn_seed,
        "own_world": own_world,
        "store_per_rank": store_per_rank,
        "same_store_other_paths": same_store_other_paths,
        "resume_other_steps": resume(2 + rank),
        "resume_same_step": resume(2),
        "resume_other_steps_unenforced": resume(2 + rank, enforce_equal_batches=False),
        "int32_refused_on_one_rank": int32_refused_on_one_rank,
    }


def stale_env(mode: str, store: str, out: Path) -> None:
    """Every rank's RANK=0 is stale (a wrapper's, exported to every task), with WORLD_SIZE=2
    (or 1: ``before-world-1``), and ``dist_info="env"``: the sampler built after
    ``init_process_group`` (``after``) or before it. Writes this rank's outcome and the ids
    it would deliver (a short timeout: a rank left waiting fails, it does not hang)."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(RANK="0", WORLD_SIZE="1" if mode == "before-world-1" else "2")
    group = {"backend": "gloo", "rank": rank, "world_size": world}
    timeout = datetime.timedelta(seconds=60)
    if mode != "after":
        s = sampler(dist_info="env")
    dist.init_process_group(**group, timeout=timeout)
    try:
        if mode == "after":
            s = sampler(dist_info="env")
        with loader(store, s) as ld:
            outcome = ["ok", np.concatenate([b["index"].numpy() for b in ld]).tolist()]
    except dz.ConfigError as e:
        outcome = ["error", str(e)]
    (out / f"rank{rank}.json").write_text(json.dumps({"stale_env": outcome}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stores", nargs=3, required=True, help="a store, a smaller one, a link")
    p.add_argument("--out", required=True)
    p.add_argument("--nccl", action="store_true", help="take the default group for NCCL's")
    jax_help = "one of 2 JAX processes (coordinator on 127.0.0.1:PORT), not torchrun"
    p.add_argument("--jax", nargs=2, type=int, metavar=("PORT", "PROCESS_ID"), help=jax_help)
    p.add_argument("--absent", action="store_true", help="rank 1 leaves before its Loader")
    first = "build each rank's sampler (seed=rank) before init_process_group"
    p.add_argument("--sampler-first", action="store_true", help=first)
    stale = "RANK=0 (and WORLD_SIZE as given) left on every rank by a wrapper"
    p.add_argument("--stale-env", choices=["after", "before", "before-world-1"], help=stale)
    args = p.parse_args()
    if args.stale_env:
        stale_env(args.stale_env, args.stores[0], Path(args.out))
        return
    if args.sampler_first:  # dist_info="env" needs no group: nothing is compared then
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        s = sampler(seed=rank, dist_info="env")
        dist.init_process_group("gloo")
        try:
            with loader(args.stores[rank], s) as ld:
                outcome = ["ok", len(ld)]
        except dz.ConfigError as e:
            outcome = ["error", str(e)]
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({"sampler_first": outcome}))
        dist.barrier()
        dist.destroy_process_group()
        return
    if args.jax:
        import jax

        FRAMEWORK[0] = "jax"
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.jax[0]}",
            num_processes=2,
            process_id=args.jax[1],
            initialization_timeout=60,
        )
        rank = jax.process_index()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if args.nccl:  # the checks must then make and use a gloo group of their own
            distributed.__dict__["_backend_name"] = lambda: "nccl"
        rank = dist.get_rank()
    if args.absent:  # rank 0 waits in the Loader's exchange for a rank that left
        if rank == 1:
            os._exit(0)
        try:
            alone = dz.DistributedSampler(
                dz.ChunkSampler(chunk_size=100, preload_nchunks=2, batch_size=50),
                dist_info="torch",
            )
            dz.Loader(dz.open_dataset(args.stores[0]), alone, device="cpu")
            outcome = "built"
        except RuntimeError as e:
            outcome = str(e)
        Path(args.out, "rank0.json").write_text(json.dumps({"absent": outcome}))
        os._exit(0)  # the group is broken: no barrier, no teardown
    results: dict[str, object] = {}
    for name, run in scenarios(rank, *args.stores).items():
        try:
            results[name] = ["ok", run()]
        except dz.ConfigError as e:
            results[name] = ["error", str(e)]
    results["cpu_group_made"] = bool(distributed._CPU_GROUP)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    if args.jax:
        jax.distributed.shutdown()
    else:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
