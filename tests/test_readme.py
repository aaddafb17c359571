"""README.md's examples run as written: its "Use", "Resuming" and JAX blocks under torchrun on
two CPU ranks, against a store the loader's synthetic writer makes as ``cells.zarr``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dali_zarr import synthetic
from tests.processes import ROOT, child_env, start, wait_all

WORKER = ROOT / "tests" / "readme_worker.py"


def test_readme_use_and_resume_examples_run_as_written(tmp_path: Path) -> None:
    synthetic.make_single_cell(tmp_path / "cells.zarr", n_obs=3_000, n_features=40)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*torchrun, str(WORKER), str(ROOT / "README.md"), str(tmp_path)]
    ((code, out, err),) = wait_all([start(cmd, env=child_env(GLOO_SOCKET_IFNAME="lo"))], 300)
    assert code == 0, out[-3000:] + err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # equal batches on 2 ranks: floor(3,000 / 2 / 256) = 5 full batches each, as README says
    for seen in ranks:
        assert seen["device"] == "cpu" and seen["batches"] == 5, seen
        assert seen["x_shape"] == [256, 40] and seen["index_dtype"] == "torch.int64", seen
        assert seen["resumed_epoch"] == 3 and seen["saved"] == ["rank0.pt", "rank1.pt"], seen
        # JAX: one process, every row once: 11 batches of 256 and the last of 184 rows
        assert seen["jax_batches"] == 12 and seen["jax_x_shape"] == [184, 40], seen
