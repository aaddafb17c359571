"""The DDP main job's checkpoints (pipelines/ddp_train.py --checkpoint-dir / --resume).

A run stopped in the middle of an epoch (by --stop-after-steps, or by SIGKILL) and resumed
trains on every row of that epoch exactly once in all, the same batches as an uninterrupted
run, and its model and optimizer continue where the checkpoint left them; on another number
of ranks the rest of the epoch is split among the new ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dali_zarr import synthetic
from tests.processes import child_env, free_port, run_ok, start, wait_all

N_OBS = 640  # 16 chunks of 40 rows, 8 per rank: 10 whole batches of 32 on each of 2 ranks
SETTINGS = ["--batch-size", "32", "--chunk-size", "40", "--preload-nchunks", "2"]
STEPS_PER_EPOCH = N_OBS // 32 // 2


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("train_resume") / "sc.zarr"
    return synthetic.make_single_cell(path, n_obs=N_OBS, n_features=20, n_types=4)


def train(store: str, *flags: str, nproc: int = 2) -> str:
    """ddp_train.py under torchrun (gloo) on ``nproc`` ranks; its stdout."""
    return run_ok(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            f"--nproc_per_node={nproc}",
            *("pipelines/ddp_train.py", "--data", store, *SETTINGS, *flags),
        ],
        timeout=300,
    )


def logged(prefix: Path, ranks: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(rank, epoch, step, obs ids) of every step --log-indices wrote, on every rank."""
    return [
        (rank, e["epoch"], e["step"], tuple(e["index"]))
        for rank in range(ranks)
        if Path(f"{prefix}.{rank}").exists()
        for e in map(json.loads, Path(f"{prefix}.{rank}").read_text().splitlines())
    ]


def rows_of(entries, epoch: int) -> list[int]:
    return sorted(i for _, e, _, index in entries if e == epoch for i in index)


def load(directory: Path) -> dict:
    return torch.load(directory / "checkpoint.pt", map_location="cpu")


def start_two_ranks(store: str, tmp_path: Path, *flags: str) -> list[subprocess.Popen]:
    """ddp_train.py on two ranks launched as srun would (RANK, WORLD_SIZE; no torchrun) for
    1000 epochs, checkpointing to ``tmp_path/ck`` and logging ids to ``tmp_path/a.<rank>``."""
    cmd = [
        *(sys.executable, "pipelines/ddp_train.py", "--data", store, *SETTINGS),
        *("--epochs", "1000", "--checkpoint-dir", str(tmp_path / "ck"), *flags),
        *("--log-indices", str(tmp_path / "a")),
    ]
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [
        start(cmd, env=child_env(**launch, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(2)
    ]


def wait_for_logged_steps(procs: list[subprocess.Popen], log: Path, steps: int) -> None:
    """Until ``log`` holds ``steps`` steps; fails (killing ``procs``) if a run ends first."""
    deadline = time.monotonic() + 240  # a guard against a hang, not a timing assertion
    while not (log.exists() and len(log.read_text().splitlines()) >= steps):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            logs = ["".join(p.communicate())[-2000:] for p in procs]
            pytest.fail(f"the run ended or hung before step {steps}:\n" + "\n".join(logs))
        time.sleep(0.05)


@pytest.mark.slow
def test_stopped_mid_epoch_resumes_with_the_same_batches_and_model(
    store: str, tmp_path: Path
) -> None:
    # uninterrupted: 2 epochs of 10 steps per rank
    train(store, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "ref"),
          "--log-indices", str(tmp_path / "ref.log"))  # fmt: skip
    # preempted at step 14 (epoch 1, its 4th batch); the last checkpoint is step 12's
    flags = ["--epochs", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"]
    out = train(store, *flags, "--stop-after-steps", "14", "--log-indices", str(tmp_path / "a"))
    assert "stopped after step 14" in out and "[all] epoch 1" not in out, out
    saved = load(tmp_path / "ck")
    assert (saved["step"], saved["epoch_step"]) == (12, 2)
    assert [s["consumed"] for s in saved["loaders"]] == [2, 2]

    out = train(store, *flags, "--resume", "--log-indices", str(tmp_path / "b"))
    assert "resumed" in out and "step 12, epoch 1 after 2 of its batches" in out, out
    assert "[all] epoch 0" not in out and "[all] epoch 1" in out, out

    reference = logged(tmp_path / "ref.log", 2)
    before = [e for e in logged(tmp_path / "a", 2) if e[2] <= saved["step"]]
    after = logged(tmp_path / "b", 2)
    assert min(step for _, _, step, _ in after) == 13  # the step counter continues
    # batch for batch the uninterrupted stream: each row of epoch 1 exactly once
    assert sorted(before + after) == sorted(reference)
    assert rows_of(before + after, 1) == list(range(N_OBS))

    # the model and Adam's moments continued: the same weights as the uninterrupted run
    resumed, uninterrupted = load(tmp_path / "ck"), load(tmp_path / "ref")
    assert resumed["step"] == uninterrupted["step"] == 2 * STEPS_PER_EPOCH
    assert resumed["optimizer"]["state"][0]["step"] == 2 * STEPS_PER_EPOCH
    for name, weights in uninterrupted["model"].items():
        assert torch.allclose(resumed["model"][name], weights, rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_killed_run_resumes_on_another_number_of_ranks(store: str, tmp_path: Path) -> None:
    """Two ranks launched as srun would (RANK, WORLD_SIZE), killed with SIGKILL wherever
    they are (mid-step or mid-save), resume from the last whole checkpoint on one rank."""
    ck = tmp_path / "ck"
    procs = start_two_ranks(store, tmp_path, "--checkpoint-every", "3")
    wait_for_logged_steps(procs, Path(f"{tmp_path / 'a'}.0"), 2 * STEPS_PER_EPOCH + 5)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    wait_all(procs, timeout=60)

    saved = load(ck)  # whole, wherever the kill landed
    epoch, step = saved["loaders"][0]["epoch"], saved["step"]
    assert epoch >= 1 and step >= 2 * STEPS_PER_EPOCH, (epoch, step)
    out = train(store, "--epochs", str(epoch + 1), "--checkpoint-dir", str(ck), "--resume",
                "--log-indices", str(tmp_path / "b"), nproc=1)  # fmt: skip
    assert f"step {step}, epoch {epoch} after {saved['epoch_step']}" in out, out
    assert "saved by 2 ranks" in out, out

    before = [e for e in logged(tmp_path / "a", 2) if e[2] <= step]
    after = logged(tmp_path / "b", 1)
    assert {e for _, e, _, _ in after} <= {epoch}
    # the step counter continues (nothing comes after a checkpoint at the epoch's last batch)
    assert [s for _, _, s, _ in after] == list(range(step + 1, step + 1 + len(after)))
    # every row of the interrupted epoch exactly once: before the last checkpoint, or after
    assert rows_of(before + after, epoch) == list(range(N_OBS))
    assert load(ck)["world_size"] == 1


@pytest.mark.slow
def test_a_signal_to_one_rank_saves_every_rank_at_one_step(store: str, tmp_path: Path) -> None:
    """SIGTERM (a preemption) killed the ranks wherever they were: the work since the last
    checkpoint was lost, and a rank that saved alone would have hung the others. Now a
    signal to one rank makes both save one checkpoint after the same step and exit 0, and
    the resumed run trains on each row of the interrupted epoch once."""
    ck = tmp_path / "ck"
    procs = start_two_ranks(store, tmp_path)  # epoch-end saves only
    wait_for_logged_steps(procs, Path(f"{tmp_path / 'a'}.1"), STEPS_PER_EPOCH + 4)
    os.kill(procs[1].pid, signal.SIGTERM)
    results = wait_all(procs, timeout=120)
    assert [code for code, _, _ in results] == [0, 0], [out + err for _, out, err in results]
    outs = [out for _, out, _ in results]
    saved = load(ck)
    step, epoch = saved["step"], saved["loaders"][0]["epoch"]
    for rank, out in enumerate(outs):
        assert f"saved {ck / 'checkpoint.pt'} after step {step} and stopped" in out, (rank, out)
    assert "got SIGTERM" in outs[1], outs[1]
    assert epoch >= 1 and step > STEPS_PER_EPOCH, (step, epoch)
    assert [s["consumed"] for s in saved["loaders"]] == [saved["epoch_step"]] * 2
    before = logged(tmp_path / "a", 2)
    assert max(s for _, _, s, _ in before) == step  # no rank trained past the saved step

    out = train(store, "--epochs", str(epoch + 1), "--checkpoint-dir", str(ck), "--resume",
                "--log-indices", str(tmp_path / "b"))  # fmt: skip
    assert f"step {step}, epoch {epoch} after {saved['epoch_step']}" in out, out
    after = logged(tmp_path / "b", 2)
    assert rows_of(before + after, epoch) == list(range(N_OBS))


def test_a_checkpoint_at_the_max_steps_step_resumes_with_that_epoch_done(
    store: str, tmp_path: Path
) -> None:
    """--max-steps ends each epoch after N steps. A run stopped at a checkpoint of step N
    (the epoch's last, by --max-steps) trained one more batch of that epoch when resumed:
    5 steps in epoch 0 where the uninterrupted run took 4, and every later step shifted."""
    flags = ["--epochs", "2", "--max-steps", "4"]
    train(store, *flags, "--checkpoint-dir", str(tmp_path / "ref"),
          "--log-indices", str(tmp_path / "ref.log"), nproc=1)  # fmt: skip
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"]
    train(store, *flags, *ck, "--stop-after-steps", "4", "--log-indices", str(tmp_path / "a"),
          nproc=1)  # fmt: skip
    out = train(store, *flags, *ck, "--resume", "--lr", "0.0025",
                "--log-indices", str(tmp_path / "b"), nproc=1)  # fmt: skip
    assert "step 4, epoch 0 after 4 of its batches" in out, out
    # --lr given on resume holds (the checkpoint's optimizer state had replaced it)
    assert load(tmp_path / "ck")["optimizer"]["param_groups"][0]["lr"] == 0.0025
    # the resumed epoch 0 had no step left: its loss is unknown, not 0 (a dip in a plot)
    assert "epoch 0: 0 steps" in out and "loss n/a (no step)" in out, out
    assert "[all] epoch 0: mean loss n/a" in out, out
    reference = logged(tmp_path / "ref.log", 1)
    assert [(e, s) for _, e, s, _ in reference] == [(0, 1), (0, 2), (0, 3), (0, 4)] + [
        (1, s) for s in range(5, 9)
    ]
    assert logged(tmp_path / "a", 1) + logged(tmp_path / "b", 1) == reference


@pytest.mark.slow
def test_ranks_that_see_other_checkpoints_stop_with_an_error_not_a_hang(
    store: str, tmp_path: Path
) -> None:
    """--checkpoint-dir on node-local disks: rank 0 found the checkpoint and resumed, rank 1
    found none and started afresh, and both waited forever in their first collectives that
    differed. A checkpoint no rank can read was torch's bare error. Both are named, on every
    rank, and every rank stops."""
    ck = tmp_path / "ck"
    train(store, "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
          "--stop-after-steps", "2", nproc=1)  # fmt: skip
    port = str(free_port())
    base = [sys.executable, "pipelines/ddp_train.py", "--data", store, *SETTINGS, "--resume"]
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = []
    for rank, where in enumerate((ck, tmp_path / "empty")):
        env = child_env(**launch, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(start([*base, "--checkpoint-dir", str(where)], env=env))
    for code, out, err in wait_all(procs, timeout=120):  # a guard against the hang
        assert code != 0, out
        assert "rank 0: step 2; rank 1: no checkpoint" in err, err[-3000:]
        assert "a directory every rank shares" in err, err[-3000:]

    # a checkpoint of other data: refused by what differs (was torch's weight size mismatch)
    other = synthetic.make_single_cell(tmp_path / "other.zarr", n_obs=N_OBS, n_features=30)
    with pytest.raises(AssertionError, match=r"feature_shape: saved \[20\], now \[30\]"):
        train(other, "--checkpoint-dir", str(ck), "--resume", nproc=1)

    whole = (ck / "checkpoint.pt").read_bytes()
    (ck / "checkpoint.pt").write_bytes(whole[: len(whole) // 2])  # e.g. a copy cut short
    with pytest.raises(AssertionError, match=r"checkpoint\.pt cannot be read"):
        train(store, "--checkpoint-dir", str(ck), "--resume", nproc=2)
    torch.save({"step": 5, "model": {}}, ck / "checkpoint.pt")  # another program's
    with pytest.raises(AssertionError, match=r"cannot be read .*it lacks loaders, optimizer"):
        train(store, "--checkpoint-dir", str(ck), "--resume", nproc=1)


def test_a_resume_on_more_ranks_than_the_checkpoint_allows_says_so(
    store: str, tmp_path: Path
) -> None:
    """A checkpoint of 2 chunks (one rank) resumed on 3 ranks failed in the script's first
    print (len(loader), before load_state_dict) with the planner's advice for a new run,
    "lower chunk_size to at most 213 or run on at most 2 ranks", where a resume refuses
    another chunk_size. The loader's refusal of the resume is what is said now."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    big = ["--chunk-size", "320", "--preload-nchunks", "1"]  # 2 chunks of 640 rows
    train(store, *big, *ck, "--stop-after-steps", "2", nproc=1)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = ["pipelines/ddp_train.py", "--data", store, *SETTINGS, *big, *ck, "--resume"]
    ((code, _, err),) = wait_all([start([*torchrun, "--nproc_per_node=3", *script])], 300)
    assert code != 0
    for rank in range(3):  # every rank says it (rank 0 alone failed, the others waited)
        said = f"[rank{rank}]: dali_zarr.errors.ConfigError: sc.zarr/X: cannot resume epoch 0 on 3"
        assert said in err, err[-3000:]
    assert "Resume on at most 2 ranks (a resume may change only the number" in err
    # two ranks resume it
    out = train(store, *big, *ck, "--resume", nproc=2)
    assert "2 ranks x 10 batches/epoch" in out and "resumed" in out, out


def test_a_checkpoint_is_not_overwritten_without_resume(tmp_path: Path) -> None:
    """Without --resume, a checkpoint in the directory is refused before anything starts
    (the new run's first save would replace it); --resume needs a directory. A directory
    that cannot be one (a file, or below a file) was found at the first save, after the
    epoch it was to keep (with --resume the run even said "no checkpoint yet")."""
    store = str(tmp_path / "never.zarr")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint.pt").write_bytes(b"")
    (tmp_path / "afile").write_bytes(b"")
    for flags, said in (
        (["--checkpoint-dir", str(tmp_path / "ck")], "exists: pass --resume to continue"),
        (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
        (["--checkpoint-dir", str(tmp_path / "afile"), "--resume"], "afile is not a directory"),
        (["--checkpoint-dir", str(tmp_path / "afile" / "ck")], "afile is not a directory"),
    ):
        done = subprocess.run(
            [sys.executable, "pipelines/ddp_train.py", "--data", store, *flags],
            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
        )  # fmt: skip
        assert done.returncode == 2 and said in done.stderr, done.stderr
