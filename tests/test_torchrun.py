"""Real torchrun processes (gloo, CPU DALI pipelines): disjoint shards, equal batch counts,
complete coverage, and DDP steps that finish."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dali_zarr import synthetic

WORKER = Path(__file__).with_name("torchrun_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, data: Path, out: Path, *extra: str, timeout: int = 300) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        "--data",
        str(data),
        "--out",
        str(out),
        *extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["chunks", "contiguous"])
def test_two_ranks_disjoint_equal_complete(tmp_path: Path, shard: str) -> None:
    n_obs = 2_999
    data = synthetic.make_single_cell(
        tmp_path / "sc.zarr", n_obs=n_obs, n_features=64, chunk_elements=1_024
    )
    ranks = torchrun(2, data, tmp_path / "out", "--shard", shard, "--epochs", "2")
    batch = 128
    per_rank = (n_obs // 2) // batch  # enforce_equal_batches: complete batches only
    assert ranks[0]["seed"] == ranks[1]["seed"], "seed=None must be broadcast from rank 0"
    for epoch in range(2):
        a, b = (r[f"epoch{epoch}"] for r in ranks)
        assert [r["steps"][epoch] for r in ranks] == [per_rank, per_rank]
        assert int(ranks[0]["len"]) == per_rank
        assert len(a) == len(b) == per_rank * batch
        assert not set(a.tolist()) & set(b.tolist()), "ranks overlap"
        assert len(np.unique(np.concatenate([a, b]))) == 2 * per_rank * batch
    if shard == "chunks":  # shards move between epochs; contiguous shards stay put
        assert set(ranks[0]["epoch0"].tolist()) != set(ranks[0]["epoch1"].tolist())
    else:
        assert ranks[0]["epoch0"].max() < n_obs // 2 <= ranks[1]["epoch0"].min()
