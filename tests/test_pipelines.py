"""The runnable scripts in pipelines/: the DDP main job (loss falls) and the custom-ops example."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.processes import run_ok


def run(args: list[str], timeout: int = 300) -> str:
    return run_ok([sys.executable, *args], timeout=timeout)


@pytest.mark.slow
def test_ddp_train_two_ranks_loss_falls(tmp_path: Path) -> None:
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "pipelines/ddp_train.py",
            "--data",
            str(tmp_path / "demo.zarr"),
            "--generate",
            "--n-obs",
            "6000",
            "--n-features",
            "200",
            "--epochs",
            "3",
            "--batch-size",
            "128",
            "--preload-nchunks",
            "8",
        ]
    )
    losses = [float(m) for m in re.findall(r"\[all\] epoch \d+: mean loss ([0-9.]+)", out)]
    assert len(losses) == 3, out
    assert losses[2] < losses[0] * 0.8, f"loss did not fall: {losses}"
    per_rank = re.findall(r"\[rank (\d)\] epoch 2: (\d+) steps, ([0-9,]+) rows/s", out)
    assert sorted(r for r, _, _ in per_rank) == ["0", "1"]
    assert len({steps for _, steps, _ in per_rank}) == 1, "ranks ran different step counts"


def test_custom_ops_example(tmp_path: Path) -> None:
    out = run(["pipelines/custom_ops.py", "--data", str(tmp_path / "c.zarr"), "--batches", "2"])
    lines = [line for line in out.splitlines() if line.startswith("batch ")]
    assert len(lines) == 2 and "X (256, 2000) torch.float32" in lines[0], out
