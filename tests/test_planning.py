"""Tests of the pure planning layer (no I/O, no torch.distributed needed)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dali_zarr.distributed import (
    broadcast_seed,
    cgroup_cpus,
    cgroup_cpuset,
    cpu_share,
    resolve_rank_world,
)
from dali_zarr.errors import ConfigError
from dali_zarr.planning import (
    ChunkSampler,
    DistributedSampler,
    EpochPlan,
    PlanSettings,
    iter_batches,
    plan_epoch,
    ranges_to_rows,
)

PRIMES = [1, 2, 3, 7, 61, 97, 101, 509, 1009, 2003, 3001, 4099]


def world(rank: int, world_size: int):
    """A dist_info callable, so no process group is needed."""
    return lambda: (rank, world_size)


def samplers(cfg: dict) -> list[DistributedSampler]:
    """One independent DistributedSampler per rank of cfg's world."""
    out = []
    for r in range(cfg["world_size"]):
        base = ChunkSampler(
            chunk_size=cfg["chunk_size"],
            preload_nchunks=cfg["preload_nchunks"],
            batch_size=cfg["batch_size"],
            shuffle=cfg["shuffle"],
            drop_last=cfg["drop_last"],
            seed=cfg["seed"],
        )
        out.append(
            DistributedSampler(
                base,
                dist_info=world(r, cfg["world_size"]),
                enforce_equal_batches=cfg["enforce"],
                shard=cfg["shard"],
            )
        )
    return out


@st.composite
def configs(draw) -> dict:
    w = draw(st.integers(1, 8))
    cs = draw(st.integers(1, 64))
    preload = draw(st.integers(1, 8))
    n_obs = draw(st.one_of(st.sampled_from(PRIMES), st.integers(1, 4000)))
    if -(-n_obs // cs) < w:  # need at least one chunk per rank
        n_obs += (w - 1) * cs
    enforce = draw(st.booleans())
    max_bs = preload * cs
    if w > 1 and enforce:
        max_bs = min(max_bs, n_obs // w)  # at least one full batch per rank
    drop_last = draw(st.booleans())
    if drop_last:  # a full batch for the largest share (else nothing to deliver: refused)
        max_bs = min(max_bs, -(-n_obs // w))
    bs = draw(st.integers(1, max_bs))
    return {
        "n_obs": n_obs,
        "world_size": w,
        "chunk_size": cs,
        "preload_nchunks": preload,
        "batch_size": bs,
        "shuffle": draw(st.booleans()),
        "drop_last": drop_last,
        "enforce": enforce,
        "shard": draw(st.sampled_from(["chunks", "contiguous"])),
        "seed": draw(st.integers(0, 2**63 - 1)),
    }


def check_window_chunks(plan: EpochPlan, cfg: dict) -> None:
    """Each range sits in one chunk; a window touches at most preload_nchunks + 1 chunks.

    A short chunk (the dataset's last chunk, or in contiguous mode a chunk clipped to the
    rank's range) can sit inside a window once shuffled; each such chunk may add one more.
    """
    cs, n = cfg["chunk_size"], cfg["n_obs"]
    extra = int(n % cs != 0) if cfg["shard"] == "chunks" else 2
    for w in range(plan.n_windows):
        win = plan.window(w)
        rr = win.row_ranges
        assert np.all(rr[:, 1] > rr[:, 0])
        assert np.array_equal(rr[:, 0] // cs, (rr[:, 1] - 1) // cs)
        ids = win.chunk_ids()
        assert np.unique(ids).size == ids.size
        assert ids.size <= cfg["preload_nchunks"] + 1 + extra
        if extra == 0:
            assert ids.size <= cfg["preload_nchunks"] + 1


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), epoch=st.integers(0, 50))
def test_plan_properties(cfg: dict, epoch: int) -> None:
    n, w, bs = cfg["n_obs"], cfg["world_size"], cfg["batch_size"]
    equal = w > 1 and cfg["enforce"]
    full_only = equal or cfg["drop_last"]
    plans = [s.plan_epoch(n, epoch) for s in samplers(cfg)]
    again = [s.plan_epoch(n, epoch) for s in samplers(cfg)]  # independent objects
    skipped = plans[0].rows_skipped
    seen = []
    for r, (plan, twin) in enumerate(zip(plans, again, strict=True)):
        assert plan == twin
        assert plan.rank == r and plan.world_size == w and plan.rows_skipped == skipped
        batches = list(iter_batches(plan))
        assert [b.tolist() for b in batches] == [b.tolist() for b in iter_batches(twin)]
        assert len(batches) == plan.n_batches == samplers(cfg)[r].num_batches(n)
        sizes = [b.size for b in batches]
        assert sum(sizes) == plan.n_rows
        assert all(s == bs for s in sizes[:-1])
        if full_only:
            assert all(s == bs for s in sizes)
        if sizes:
            assert 1 <= sizes[-1] <= bs
        if equal:
            assert plan.n_batches == (n // w) // bs
        rows = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        assert rows.dtype == np.int64
        assert np.all((rows >= 0) & (rows < n))
        if cfg["shard"] == "contiguous":
            assert np.all((rows >= r * n // w) & (rows < (r + 1) * n // w))
        seen.append(rows)

        # any window planned alone, in any order, equals sequential iteration
        wins = [plan.window(i) for i in reversed(range(plan.n_windows))][::-1]
        seq = [b for win in wins for b in map(win.batch_global_rows, range(win.n_batches))]
        assert [b.tolist() for b in seq] == [b.tolist() for b in batches]
        for win in wins:
            assert np.array_equal(np.sort(win.order), np.arange(win.n_rows))
            assert np.array_equal(win.global_rows(), ranges_to_rows(win.row_ranges))
            assert win.n_rows <= plan.window_rows
            if not cfg["shuffle"]:
                assert np.array_equal(win.order, np.arange(win.n_rows))
        for i in {0, plan.n_batches // 2, plan.n_batches - 1} if plan.n_batches else ():
            wi, j = plan.window_of_batch(i)
            assert wins[wi].first_batch + j == i
            assert np.array_equal(wins[wi].batch_global_rows(j), batches[i])
        check_window_chunks(plan, cfg)

    allrows = np.concatenate(seen)
    assert np.unique(allrows).size == allrows.size  # ranks disjoint, no repeats
    assert allrows.size == n - skipped
    if w == 1 and not cfg["drop_last"]:
        assert skipped == 0
        assert np.array_equal(np.sort(allrows), np.arange(n))
    if equal:
        assert len({p.n_batches for p in plans}) == 1


@pytest.mark.parametrize("shard", ["chunks", "contiguous"])
@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**62 + 3])
def test_39_batches_per_rank(seed: int, shard: str) -> None:
    cfg = {
        "n_obs": 20_000,
        "world_size": 2,
        "chunk_size": 64,
        "preload_nchunks": 32,
        "batch_size": 256,
        "shuffle": True,
        "drop_last": False,
        "enforce": True,
        "shard": shard,
        "seed": seed,
    }
    skipped_sets = []
    for epoch in range(6):
        plans = [s.plan_epoch(20_000, epoch) for s in samplers(cfg)]
        rows = []
        for p in plans:
            batches = list(iter_batches(p))
            assert p.n_batches == len(batches) == 39
            assert all(b.size == 256 for b in batches)
            rows.append(np.concatenate(batches))
        assert plans[0].rows_skipped == 20_000 - 2 * 39 * 256
        skipped_sets.append(np.setdiff1d(np.arange(20_000), np.concatenate(rows)))
    # the skipped rows are a different set each epoch
    assert len({s.tobytes() for s in skipped_sets}) == len(skipped_sets)


@pytest.mark.parametrize("shard", ["chunks", "contiguous"])
def test_plan_changes_across_epochs(shard: str) -> None:
    cfg = {
        "n_obs": 10_007,
        "world_size": 4,
        "chunk_size": 16,
        "preload_nchunks": 8,
        "batch_size": 32,
        "shuffle": True,
        "drop_last": False,
        "enforce": True,
        "shard": shard,
        "seed": 3,
    }
    s = samplers(cfg)[1]
    p0, p1 = s.plan_epoch(cfg["n_obs"], 0), s.plan_epoch(cfg["n_obs"], 1)
    assert p0 != p1
    assert not np.array_equal(p0.row_ranges[:10], p1.row_ranges[:10])
    assert not np.array_equal(p0.window(0).order, p1.window(0).order)
    b0, b1 = next(iter_batches(p0)), next(iter_batches(p1))
    assert not np.array_equal(b0, b1)
    set0 = set(np.concatenate(list(iter_batches(p0))).tolist())
    set1 = set(np.concatenate(list(iter_batches(p1))).tolist())
    if shard == "chunks":
        assert set0 != set1  # a rank's shard moves around the dataset
    else:
        lo, hi = cfg["n_obs"] // 4, 2 * cfg["n_obs"] // 4
        assert set0 | set1 <= set(range(lo, hi))  # a rank keeps its rows
    # different seeds, different plans
    other = ChunkSampler(chunk_size=16, preload_nchunks=8, batch_size=32, seed=4)
    same = ChunkSampler(chunk_size=16, preload_nchunks=8, batch_size=32, seed=3)
    assert other.plan_epoch(10_007, 0) != same.plan_epoch(10_007, 0)


def test_no_shuffle_single_rank_is_sequential() -> None:
    s = ChunkSampler(chunk_size=10, preload_nchunks=3, batch_size=7, shuffle=False)
    batches = list(iter_batches(s.plan_epoch(100, 0)))
    assert np.array_equal(np.concatenate(batches), np.arange(100))
    assert [b.size for b in batches] == [7] * 14 + [2]
    assert s.window_rows == 28
    dropped = ChunkSampler(chunk_size=10, preload_nchunks=3, batch_size=7, drop_last=True)
    p = dropped.plan_epoch(100, 0)
    assert (p.n_batches, p.n_rows, p.rows_skipped) == (14, 98, 2)


def test_iter_batches_resume() -> None:
    s = ChunkSampler(chunk_size=8, preload_nchunks=4, batch_size=5, seed=11)
    plan = s.plan_epoch(1001, 2)
    full = list(iter_batches(plan))
    for start in (0, 1, 6, 7, 13, len(full) - 1, len(full)):
        tail = list(iter_batches(plan, start_batch=start))
        assert [b.tolist() for b in tail] == [b.tolist() for b in full[start:]]


def test_plans_are_immutable() -> None:
    s = ChunkSampler(chunk_size=8, preload_nchunks=4, batch_size=5)
    plan = s.plan_epoch(100, 0)
    win = plan.window(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.n_rows = 3  # type: ignore[misc]
    for arr in (plan.row_ranges, plan.range_offsets, win.order, win.row_ranges, win.global_rows()):
        with pytest.raises(ValueError):
            arr[0] = 1
    d = DistributedSampler(s, dist_info=world(0, 1))
    with pytest.raises(AttributeError):
        d.seed = 1  # type: ignore[misc]
    with pytest.raises(IndexError):
        plan.window(plan.n_windows)
    with pytest.raises(IndexError):
        plan.window_of_batch(plan.n_batches)


def test_pickle_roundtrip() -> None:
    """Samplers and plans travel to DALI worker processes by pickle, unchanged."""
    drawn = ChunkSampler(chunk_size=8, preload_nchunks=4, batch_size=5, seed=None)
    assert pickle.loads(pickle.dumps(drawn)) == drawn  # the drawn seed is kept, not redrawn
    s = ChunkSampler(chunk_size=8, preload_nchunks=4, batch_size=5, seed=77)
    d = DistributedSampler(s, dist_info=world(1, 3), shard="contiguous")
    d2 = pickle.loads(pickle.dumps(d))
    assert (d2.rank, d2.world_size, d2.seed, d2.shard) == (1, 3, d.seed, "contiguous")
    assert pickle.loads(pickle.dumps(s)) == s
    plan = d.plan_epoch(1000, 1)
    assert pickle.loads(pickle.dumps(plan)) == plan == d2.plan_epoch(1000, 1)
    assert pickle.loads(pickle.dumps(plan.window(1))) == plan.window(1)


def test_large_dataset_is_fast() -> None:
    """O(n_chunks) per epoch, O(window) per window: 100M rows plan in well under a second."""
    s = ChunkSampler(chunk_size=64, preload_nchunks=32, batch_size=256, seed=1)
    d = DistributedSampler(s, dist_info=world(5, 8))
    t0 = time.perf_counter()
    plan = d.plan_epoch(100_000_000, 3)
    t1 = time.perf_counter()
    win = plan.window(plan.n_windows // 2)
    rows = win.batch_global_rows(0)
    t2 = time.perf_counter()
    assert plan.n_batches == (100_000_000 // 8) // 256
    assert rows.size == 256 and win.n_rows == 2048
    assert t1 - t0 < 5.0 and t2 - t1 < 0.5  # loose: shared 2-core CI machines


# --------------------------------------------------------------------------- seeds


def test_seed_none_draws_and_distributed_refuses_without_torch() -> None:
    a = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4, seed=None)
    b = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4, seed=None)
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**63 and a.seed_was_drawn
    assert a.seed != b.seed  # 63 random bits
    assert DistributedSampler(a, dist_info=world(0, 1)).seed == a.seed
    with pytest.raises(ConfigError, match="pass an explicit seed"):
        DistributedSampler(a, dist_info=world(0, 2))
    fixed = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4, seed=5)
    assert not fixed.seed_was_drawn
    assert DistributedSampler(fixed, dist_info=world(1, 2)).seed == 5


def test_broadcast_seed_needs_torch_distributed() -> None:
    with pytest.raises(ConfigError, match="init_process_group"):
        broadcast_seed(3)


# --------------------------------------------------------------------------- dist_info


def test_dist_info_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="neither RANK and WORLD_SIZE"):
        resolve_rank_world("env")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert resolve_rank_world("env") == (2, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank_world("env") == (1, 3)  # torchrun variables win
    s = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4, seed=0)
    d = DistributedSampler(s, dist_info="env")
    assert (d.rank, d.world_size, d.batch_size, d.chunk_size) == (1, 3, 4, 4)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match=r"0 <= rank < world_size"):
        resolve_rank_world("env")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        resolve_rank_world("env")


def test_dist_info_env_refuses_half_of_torchruns_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK without WORLD_SIZE (or the reverse) fell back to srun's variables: inside an
    allocation (SLURM_PROCID=0, SLURM_NTASKS=1) RANK=3 became rank 0 of 1, delivering every
    row on every such process."""
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match="RANK='3' is set but WORLD_SIZE is not"):
        resolve_rank_world("env")
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="WORLD_SIZE='4' is set but RANK is not"):
        resolve_rank_world("env")
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("SLURM_NTASKS")
    with pytest.raises(ConfigError, match="WORLD_SIZE='4' is set but RANK is not"):
        resolve_rank_world("env")


def test_dist_info_callable_must_give_integers() -> None:
    """int() would make rank 0 of 0.7 and world 2 of 2.9 without a word."""
    assert resolve_rank_world(lambda: (np.int64(1), 3)) == (1, 3)
    for bad in ((0.7, 2.9), (True, 2), (0, "2x"), (None, 2)):
        with pytest.raises(ConfigError, match="both must be integers"):
            resolve_rank_world(lambda bad=bad: bad)


def test_cpu_share_splits_the_node_between_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_NODEID",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr("dali_zarr.distributed.cgroup_cpus", lambda: None)
    monkeypatch.setattr("dali_zarr.distributed.cgroup_cpuset", lambda: None)
    assert cpu_share() == 64  # one process: the whole node
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2),2")  # 4 tasks on 2 nodes, 2 on one
    assert cpu_share() == 16
    monkeypatch.setenv("SLURM_NODEID", "2")  # the third node: its own count, not the first's
    assert cpu_share() == 32
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1,4(x3)")  # was 1: the whole node for each
    assert cpu_share() == 16
    monkeypatch.setenv("SLURM_NODEID", "7")  # not in the list: the first node's count
    assert cpu_share() == 64
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2),2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")  # srun --ntasks-per-node: wins
    assert cpu_share() == 32
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's count wins
    assert cpu_share() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")  # unreadable: the next variable
    assert cpu_share() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")  # more ranks than cores: still one each
    assert cpu_share() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # a launcher that bound this rank to 6 cores has made the split already
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    assert cpu_share() == 6
    # a container with a quota of 16 cores on this 64-core host: 2 each for 8 ranks
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr("dali_zarr.distributed.cgroup_cpus", lambda: 16)
    assert cpu_share() == 2
    # docker --cpuset-cpus or a SLURM job cgroup of 32 cores that every rank shares: split it
    monkeypatch.setattr("dali_zarr.distributed.cgroup_cpus", lambda: None)
    monkeypatch.setattr("dali_zarr.distributed.cgroup_cpuset", lambda: 32)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    assert cpu_share() == 4
    # ... and a rank bound to 6 of them by the launcher keeps its 6
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    assert cpu_share() == 6


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no quota
        ({"cpu.max": "250000 100000\n"}, 3),  # 2.5 cores: 3 threads' worth
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu.max": "garbled"}, None),
        ({}, None),  # no cgroup files at all
    ],
    ids=["v2-none", "v2-quota", "v1-none", "v1-quota", "garbled", "absent"],
)
def test_cgroup_cpus_reads_a_containers_quota(tmp_path, files: dict, cores: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpus(str(tmp_path)) == cores


@pytest.mark.parametrize(
    ("files", "proc", "cores"),
    [
        ({"system.slice/d.scope/cpu.max": "200000 100000\n"}, "0::/system.slice/d.scope\n", 2),
        (  # a pod's limit above its container's "max": the pod's
            {"kubepods/pod1/cpu.max": "400000 100000\n", "kubepods/pod1/c/cpu.max": "max 100000"},
            "0::/kubepods/pod1/c\n",
            4,
        ),
        (  # the tightest of the container's and the pod's
            {"kubepods/pod1/cpu.max": "400000 100000\n", "kubepods/pod1/c/cpu.max": "100000"},
            "0::/kubepods/pod1/c\n",
            4,
        ),
        (
            {
                "kubepods/pod1/cpu.max": "400000 100000\n",
                "kubepods/pod1/c/cpu.max": "150000 100000",
            },
            "0::/kubepods/pod1/c\n",
            2,
        ),
        ({"a/cpu.max": "max 100000\n"}, "0::/a\n", None),
    ],
    ids=["own-cgroup", "pod-limit", "garbled-own", "tightest", "no-quota"],
)
def test_cgroup_cpus_reads_the_quota_of_this_process_cgroup(
    tmp_path, files: dict, proc: str, cores: int | None
) -> None:
    """Only the root's cpu.max was read: a process whose cgroup v2 sits below the root (no
    cgroup namespace, ``docker --cgroupns=host``, a systemd unit's CPUQuota) or under a pod's
    limit had its quota ignored, and sized its read pools for every core of the host."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    assert cgroup_cpus(str(tmp_path), str(tmp_path / "proc_cgroup")) == cores


@pytest.mark.parametrize(
    ("files", "proc", "cpus"),
    [
        ({"a/b/cpuset.cpus.effective": "0-3,8,10-11\n"}, "0::/a/b\n", 7),  # cgroup v2
        ({"cpuset/job_7/cpuset.effective_cpus": "4-7\n"}, "3:cpuset:/job_7\n0::/\n", 4),  # v1
        ({"cpuset/j/cpuset.cpus": "0,2\n"}, "5:cpu,cpuset:/j\n", 2),  # v1, older kernels
        ({"cpuset/cpuset.effective_cpus": "0-15\n"}, "3:cpuset:/docker/abc\n", 16),  # at root
        ({}, "0::/\n", None),
        ({"cpuset.cpus.effective": "garbled"}, "0::/\n", None),
    ],
    ids=["v2", "v1", "v1-cpus", "container-root", "absent", "garbled"],
)
def test_cgroup_cpuset_counts_the_cpus_of_this_process_cgroup(
    tmp_path, files: dict, proc: str, cpus: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    assert cgroup_cpuset(str(tmp_path), str(tmp_path / "proc_cgroup")) == cpus


def test_cpu_share_follows_the_real_affinity() -> None:
    """Under ``taskset -c 0`` the process may run on one core, whatever the node has."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    code = "from dali_zarr.distributed import cpu_share; print(cpu_share())"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], env=env,
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert pinned.stdout.strip() == "1"
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "LOCAL_WORLD_SIZE": "2"}, check=True)  # fmt: skip
    mine = len(os.sched_getaffinity(0))
    split = mine if mine < (cgroup_cpuset() or os.cpu_count() or 1) else mine // 2  # bound
    quota = cgroup_cpus()  # this machine's container quota, if it has one
    assert free.stdout.strip() == str(max(1, min(split, quota // 2 if quota else split)))


def test_dist_info_torch_not_initialized() -> None:
    s = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4)
    with pytest.raises(ConfigError, match=r"not initialized.*init_process_group.*env"):
        DistributedSampler(s)  # default dist_info="torch"


def test_dist_info_jax_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` now raises ImportError
    with pytest.raises(ConfigError, match="jax is not installed"):
        resolve_rank_world("jax")


def test_dist_info_bad_values() -> None:
    s = ChunkSampler(chunk_size=4, preload_nchunks=2, batch_size=4)
    with pytest.raises(ConfigError, match="unknown dist_info 'mpi'"):
        DistributedSampler(s, dist_info="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rank=2, world_size=2"):
        DistributedSampler(s, dist_info=world(2, 2))
    with pytest.raises(ConfigError, match=r"rank=0, world_size=0"):
        DistributedSampler(s, dist_info=world(0, 0))
    with pytest.raises(ConfigError, match=r"\(rank, world_size\) pair"):
        DistributedSampler(s, dist_info=lambda: 3)  # type: ignore[arg-type,return-value]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, "chunk_size must be a positive integer, got 0"),
        ({"chunk_size": 2.5}, "chunk_size must be a positive integer"),
        ({"preload_nchunks": -1}, "preload_nchunks must be a positive integer, got -1"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"batch_size": True}, "batch_size must be a positive integer"),
        (
            {"chunk_size": 8, "preload_nchunks": 2, "batch_size": 17},
            r"a batch larger than a window.*raise preload_nchunks to at least 3 or lower "
            r"batch_size to at most 16",
        ),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*63\) or None, got -1"),
        ({"seed": 2**63}, r"seed must be an integer in \[0, 2\*\*63\)"),
        ({"seed": "1"}, "seed must be an integer"),
        ({"shuffle": 1}, "shuffle must be True or False"),
        ({"drop_last": None}, "drop_last must be True or False"),
    ],
)
def test_sampler_validation(kwargs: dict, match: str) -> None:
    args = {"chunk_size": 8, "preload_nchunks": 2, "batch_size": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        ChunkSampler(**args)


@pytest.mark.parametrize(
    ("n_obs", "chunk_size", "world_size"), [(150, 64, 4), (10, 4, 1000), (3, 1, 5), (7, 8, 7)]
)
def test_more_ranks_than_chunks_gives_advice_that_works(
    n_obs: int, chunk_size: int, world_size: int
) -> None:
    """Every way out the refusal names plans: with fewer rows than ranks no chunk_size
    does, so it must not suggest lowering it (it said "at most 1", refused again)."""
    s = ChunkSampler(chunk_size=chunk_size, preload_nchunks=4, batch_size=1, seed=0)
    with pytest.raises(ConfigError, match="more ranks than chunks") as info:
        DistributedSampler(s, dist_info=world(0, world_size)).plan_epoch(n_obs, 0)
    text = str(info.value)
    ranks = int(re.search(r"run on at most (\d+) ranks", text).group(1))
    DistributedSampler(s, dist_info=world(0, ranks)).plan_epoch(n_obs, 0)
    lower = re.search(r"lower chunk_size to at most (\d+)", text)
    assert (lower is not None) == (n_obs >= world_size), text
    if lower is not None:
        fixed = dataclasses.replace(s, chunk_size=int(lower.group(1)))
        DistributedSampler(fixed, dist_info=world(0, world_size)).plan_epoch(n_obs, 0)


def test_plan_time_validation() -> None:
    s = ChunkSampler(chunk_size=64, preload_nchunks=4, batch_size=32, seed=0)
    with pytest.raises(ConfigError, match="n_obs must be a positive integer, got 0"):
        s.plan_epoch(0, 0)
    with pytest.raises(ConfigError, match="n_obs must be a positive integer, got -5"):
        s.plan_epoch(-5, 0)
    with pytest.raises(ConfigError, match="epoch must be a non-negative integer"):
        s.plan_epoch(100, -1)
    d4 = DistributedSampler(s, dist_info=world(0, 4))
    with pytest.raises(
        ConfigError,
        match=r"more ranks than chunks.*3 chunk\(s\) for world_size=4.*lower chunk_size to at "
        r"most 37 or run on at most 3 ranks",
    ):
        d4.plan_epoch(150, 0)
    with pytest.raises(ConfigError, match="more ranks than chunks"):
        d4.num_batches(150)
    small = DistributedSampler(
        ChunkSampler(chunk_size=16, preload_nchunks=4, batch_size=32, seed=0),
        dist_info=world(0, 4),
    )
    with pytest.raises(
        ConfigError,
        match=r"dataset too small.*needs n_obs >= world_size x batch_size = 128.*lower "
        r"batch_size to at most 25, use fewer ranks, or pass enforce_equal_batches=False",
    ):
        small.plan_epoch(100, 0)
    # without enforcement the same setting is allowed: ranks yield partial/uneven batches
    loose = DistributedSampler(
        ChunkSampler(chunk_size=16, preload_nchunks=4, batch_size=32, seed=0),
        dist_info=world(0, 4),
        enforce_equal_batches=False,
    )
    assert loose.plan_epoch(100, 0).n_batches == 1
    # ... but not with drop_last: every rank's only batch is partial, so nothing at all
    # would be delivered (it planned 0 batches and skipped every row)
    dropping = DistributedSampler(
        ChunkSampler(chunk_size=16, preload_nchunks=4, batch_size=32, drop_last=True, seed=0),
        dist_info=world(0, 4),
        enforce_equal_batches=False,
    )
    with pytest.raises(ConfigError, match=r"nothing to deliver.*at most 25 rows per rank"):
        dropping.plan_epoch(100, 0)
    lone = ChunkSampler(chunk_size=16, preload_nchunks=8, batch_size=128, drop_last=True)
    with pytest.raises(ConfigError, match="lower batch_size to at most 100"):
        lone.plan_epoch(100, 0)
    with pytest.raises(ConfigError, match=r"unknown shard 'rows'.*shard=\"chunks\""):
        DistributedSampler(s, dist_info=world(0, 1), shard="rows")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="enforce_equal_batches must be True or False"):
        DistributedSampler(s, dist_info=world(0, 1), enforce_equal_batches="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="wraps a ChunkSampler"):
        DistributedSampler("sampler", dist_info=world(0, 1))  # type: ignore[arg-type]


def test_plan_epoch_function_matches_classes() -> None:
    s = ChunkSampler(chunk_size=5, preload_nchunks=3, batch_size=4, seed=9, drop_last=True)
    d = DistributedSampler(s, dist_info=world(2, 3), shard="contiguous")
    direct = plan_epoch(
        n_obs=997,
        epoch=4,
        seed=9,
        chunk_size=5,
        preload_nchunks=3,
        batch_size=4,
        rank=2,
        world_size=3,
        drop_last=True,
        shard="contiguous",
    )
    assert d.plan_epoch(997, 4) == direct


@settings(max_examples=200, deadline=None)
@given(
    n_obs=st.integers(1, 3_000),
    chunk_size=st.integers(1, 400),
    batch_size=st.integers(1, 400),
    enforce=st.booleans(),
    drop_last=st.booleans(),
)
def test_max_world_is_the_largest_world_the_planner_takes(
    n_obs, chunk_size, batch_size, enforce, drop_last
):
    """PlanSettings.max_world (resume and Lightning refuse by it) states the planner's rule
    again; it must name exactly the largest world check_world (the planner's refusal) takes."""
    s = PlanSettings(
        seed=0, chunk_size=chunk_size, preload_nchunks=1, batch_size=batch_size, shuffle=True,
        drop_last=drop_last, enforce_equal_batches=enforce, shard="chunks",
    )  # fmt: skip
    most = s.max_world(n_obs=n_obs)
    if drop_last and n_obs < batch_size:  # no full batch on any world: all refused
        assert most == 1
        with pytest.raises(ConfigError, match="nothing to deliver"):
            s.check_world(n_obs=n_obs, world_size=1)
        return
    s.check_world(n_obs=n_obs, world_size=most)
    with pytest.raises(ConfigError):
        s.check_world(n_obs=n_obs, world_size=most + 1)


@settings(max_examples=300, deadline=None)
@given(
    n_obs=st.integers(1, 500),
    chunk_size=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    given_position=st.booleans(),
)
def test_virtual_shard_is_the_slice_of_the_concatenated_chunks(
    n_obs, chunk_size, seed, cut, given_position
):
    """virtual_shard finds chunk positions by arithmetic (every chunk full but the short
    last one); it must equal slicing the rows of the chunks in order, laid end to end."""
    from dali_zarr.planning.partition import (
        global_chunk_order,
        short_chunk_position,
        virtual_shard,
    )

    n_chunks = -(-n_obs // chunk_size)
    order = global_chunk_order(n_chunks, seed=seed, epoch=0, shuffle=seed % 2 == 0)
    sequence = np.concatenate(
        [np.arange(c * chunk_size, min((c + 1) * chunk_size, n_obs)) for c in order]
    )
    lo, hi = sorted(int(f * n_obs) for f in cut)
    at = short_chunk_position(order, chunk_size=chunk_size, n_obs=n_obs) if given_position else None
    ranges, offsets = virtual_shard(
        order, chunk_size=chunk_size, n_obs=n_obs, lo=lo, hi=hi, short_at=at
    )
    np.testing.assert_array_equal(ranges_to_rows(ranges), sequence[lo:hi])
    np.testing.assert_array_equal(
        offsets, np.concatenate([[0], np.cumsum(ranges[:, 1] - ranges[:, 0])])
    )


def test_a_world_is_planned_from_one_chunk_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """An elastic resume plans every rank of the interrupted world, and a restart asks for
    the remainder more than once: one permutation of the chunks a rank made that
    O(world × n_chunks) per new rank (about an hour at 10**9 cells and 4,096 old ranks)."""
    from dali_zarr.planning import samplers as samplers_module
    from dali_zarr.planning.resume import Segment, batch_counts, plan_resumed_epoch

    drawn = []
    real = samplers_module.global_chunk_order
    monkeypatch.setattr(
        samplers_module, "global_chunk_order", lambda *a, **k: drawn.append(1) or real(*a, **k)
    )
    s = PlanSettings(
        seed=5, chunk_size=7, preload_nchunks=3, batch_size=4, shuffle=True, drop_last=False
    )
    plans = s.plan_world(n_obs=9_001, epoch=2, world_size=64)
    assert len(drawn) == 1
    assert plans == [s.plan(n_obs=9_001, epoch=2, rank=r, world_size=64) for r in range(64)]
    drawn.clear()
    history = (Segment(64, tuple(r % 30 for r in range(64))),)
    counts = batch_counts(s, n_obs=9_001, epoch=2, world_size=24, history=history)
    mine = plan_resumed_epoch(s, n_obs=9_001, epoch=2, history=history, rank=3, world_size=24)
    assert mine.n_batches == counts[3] and len(drawn) == 1


def test_numpy_unsigned_sizes_plan_as_python_ints() -> None:
    """An n_obs of NumPy uint64 (a size read from a store's metadata) wrapped in the
    ceiling division: 5 rows made 2**64 - 1 chunks of 16, so 3 ranks were let plan where
    the same int is refused, and the drop_last check passed likewise. Sizes are now taken
    as Python ints first: the same refusals, and the same plans where they plan."""
    kw = {"epoch": 0, "seed": 0, "chunk_size": 16, "preload_nchunks": 1, "batch_size": 1}
    for n_obs in (5, np.uint64(5)):
        with pytest.raises(ConfigError, match=r"more ranks than chunks: n_obs=5 .* 1 chunk"):
            plan_epoch(n_obs=n_obs, rank=2, world_size=3, enforce_equal_batches=False, **kw)
        with pytest.raises(ConfigError, match=r"nothing to deliver: n_obs=5"):
            plan_epoch(n_obs=n_obs, **{**kw, "batch_size": 16}, drop_last=True)
    sampler = DistributedSampler(
        ChunkSampler(chunk_size=16, preload_nchunks=1, batch_size=1),
        dist_info=lambda: (2, 3),
        enforce_equal_batches=False,
    )
    with pytest.raises(ConfigError, match="more ranks than chunks"):
        sampler.num_batches(np.uint64(5))
    assert sampler.num_batches(np.uint64(100)) == sampler.num_batches(100)
    assert (
        sampler.settings.max_world(n_obs=np.uint64(40)) == 3 == sampler.settings.max_world(n_obs=40)
    )
    same = plan_epoch(n_obs=np.uint64(100), rank=1, world_size=3, **kw)
    assert (
        same.row_ranges.tolist()
        == plan_epoch(n_obs=100, rank=1, world_size=3, **kw).row_ranges.tolist()
    )
