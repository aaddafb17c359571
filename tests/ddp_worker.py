"""One rank of the torchrun tests: multi-node, uneven batches, resume, a drawn seed.

Runs every case of ``--cases`` (a JSON list) in turn over one gloo process group: a
DistributedSampler + Loader over the case's store, a small DDP model trained on every batch,
and ``--out/c{K}_rank{R}.npz`` with the global ids this rank saw per epoch, its step counts,
the seed its sampler used (``"seed": null`` draws one on rank 0) and the trained weights.
Options stop a case mid-epoch after saving ``Loader.state_dict()`` to
``--out/{name}_rank{R}.pt`` (``stop_epoch``/``stop_after``), resume a case from all old
ranks' saved states (``resume``: their directory), wrap the loop in
``torch.distributed.algorithms.Join`` (``join``), or first check that uneven batch counts
are refused (``probe_uneven``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import dali_zarr as dz
from dali_zarr.distributed import DistInfo


def sampler_of(case: dict, dist_info: DistInfo = "torch") -> dz.DistributedSampler:
    """The case's sampler; the tests plan with it too, passing ``dist_info=lambda: (r, w)``."""
    return dz.DistributedSampler(
        dz.ChunkSampler(
            chunk_size=case["chunk_size"],
            preload_nchunks=case["preload_nchunks"],
            batch_size=case["batch_size"],
            drop_last=case.get("drop_last", False),
            seed=case.get("seed", 0),
        ),
        dist_info=dist_info,
        enforce_equal_batches=case.get("enforce", True),
        shard=case.get("shard", "chunks"),
    )


def run_case(k: int, case: dict, out: Path) -> None:
    rank = dist.get_rank()
    dataset = dz.open_dataset(case["data"])
    sampler = sampler_of(case)
    result: dict[str, object] = {
        "world_size": dist.get_world_size(),
        "rank": rank,
        "seed": sampler.seed,
    }
    if case.get("probe_uneven"):
        probe = dz.Loader(dataset, sampler, num_threads=1)
        try:
            for _ in probe:
                pass
            result["probe_error"] = ""
        except dz.ConfigError as e:
            result["probe_error"] = str(e)
        probe.close()
    loader = dz.Loader(
        dataset,
        sampler,
        obs=["cell_type"],
        return_index=True,
        num_threads=1,
        allow_uneven_batches=case.get("allow_uneven", False),
    )
    start = 0
    name = case.get("name", f"c{k}")
    if case.get("resume"):
        saved = sorted(Path(case["resume"]).glob(f"{name}_rank*.pt"))
        states = [torch.load(p, weights_only=False) for p in saved]
        loader.load_state_dict(states)
        start = loader.epoch
        result["resumed_epoch"] = start
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(dataset.n_features, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(start, case.get("epochs", 2)):
        loader.set_epoch(epoch)
        result[f"len{epoch}"] = len(loader)
        ids, steps, stop = [], 0, False
        join = Join([model]) if case.get("join") else contextlib.nullcontext()
        with join:
            for batch in loader:
                logits = model(torch.log1p(batch["X"]))
                loss = nn.functional.cross_entropy(logits, batch["cell_type"] % 8)
                optimizer.zero_grad()
                loss.backward()  # all-reduce: a rank with a batch more would wait here forever
                optimizer.step()
                ids.append(batch["index"].numpy())
                steps += 1
                if epoch == case.get("stop_epoch") and steps == case.get("stop_after"):
                    torch.save(loader.state_dict(), out / f"{name}_rank{rank}.pt")
                    stop = True
                    break
        result[f"epoch{epoch}"] = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        result[f"steps{epoch}"] = steps
        if stop:
            break
    result["weights"] = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    np.savez(out / f"c{k}_rank{rank}.npz", **result)
    loader.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="JSON file: a list of case dicts")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    cases = json.loads(Path(args.cases).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k, case in enumerate(cases):
        run_case(k, case, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
