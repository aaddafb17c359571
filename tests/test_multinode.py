"""Real torchrun jobs on loopback (gloo, CPU DALI pipelines, DDP training).

- One node, two ranks, ``seed=None``: rank 0's drawn seed reaches every rank; shards are
  disjoint, batch counts equal and complete, for both shard modes.
- Two torchrun launchers as two "nodes" (c10d rendezvous on 127.0.0.1): every rank's ids
  equal its planned shard exactly (so shards are disjoint and cover the expected rows),
  batch counts are equal, and DDP training finishes with the same weights on every rank.
- ``enforce_equal_batches=False`` with uneven counts: every rank gets a ConfigError at the
  first epoch instead of a hung job; with ``allow_uneven_batches=True`` and torch's Join the
  uneven epoch trains to the end.
- Resume: a 2-rank job saves ``Loader.state_dict()`` mid-epoch and stops; a 3-rank job loads
  those states and finishes that epoch exactly once across its ranks, then the next epoch
  follows the normal 3-rank plan.

Every subprocess wait has a timeout, so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.planning import EpochPlan, PlanSettings, Segment, iter_batches, plan_resumed_epoch
from tests.ddp_worker import sampler_of
from tests.processes import child_env, free_port, start, wait_all

WORKER = Path(__file__).with_name("ddp_worker.py")
AGREEMENT_WORKER = Path(__file__).with_name("agreement_worker.py")
TIMEOUT = 240  # seconds for one job; a hang fails instead of blocking

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return child_env(GLOO_SOCKET_IFNAME="lo")


def launch(
    cases: list[dict],
    out: Path,
    *,
    nnodes: int,
    nproc: int,
) -> list[list[dict]]:
    """Run the worker on ``nnodes`` launchers of ``nproc`` processes; per case, per rank."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "cases.json"
    spec.write_text(json.dumps(cases))
    worker = [str(WORKER), "--cases", str(spec), "--out", str(out)]
    if nnodes == 1:
        launchers = [["--standalone", f"--nproc_per_node={nproc}"]]
    else:
        port, run_id = free_port(), uuid.uuid4().hex[:8]
        launchers = [
            [
                f"--nnodes={nnodes}",
                f"--nproc_per_node={nproc}",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={run_id}",
                f"--rdzv_conf=is_host={int(node == 0)},join_timeout=60",
                "--local_addr=127.0.0.1",
                "--max_restarts=0",
            ]
            for node in range(nnodes)
        ]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs = [start([*torchrun, *args, *worker], env=_env()) for args in launchers]
    for code, stdout, stderr in wait_all(procs, TIMEOUT):
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    world = nnodes * nproc
    return [
        [dict(np.load(out / f"c{k}_rank{r}.npz")) for r in range(world)] for k in range(len(cases))
    ]


def _sampler(case: dict, rank: int, world: int) -> dz.DistributedSampler:
    return sampler_of(case, dist_info=lambda: (rank, world))


def ids_of(plan: EpochPlan) -> np.ndarray:
    return np.concatenate([np.zeros(0, np.int64), *iter_batches(plan)])


def planned_ids(case: dict, n_obs: int, epoch: int, rank: int, world: int) -> np.ndarray:
    return ids_of(_sampler(case, rank, world).plan_epoch(n_obs, epoch))


def store(tmp_path: Path, n_obs: int) -> str:
    return synthetic.make_single_cell(
        tmp_path / f"sc{n_obs}.zarr", n_obs=n_obs, n_features=32, chunk_elements=512
    )


def check_equal_disjoint_expected(case: dict, n_obs: int, ranks: list[dict]) -> None:
    world = len(ranks)
    per_rank = (n_obs // world) // case["batch_size"]
    for epoch in range(case["epochs"]):
        assert [int(r[f"steps{epoch}"]) for r in ranks] == [per_rank] * world
        assert [int(r[f"len{epoch}"]) for r in ranks] == [per_rank] * world
        seen = [r[f"epoch{epoch}"] for r in ranks]
        for rank, ids in enumerate(seen):
            np.testing.assert_array_equal(ids, planned_ids(case, n_obs, epoch, rank, world))
        union = np.concatenate(seen)
        assert len(np.unique(union)) == len(union) == world * per_rank * case["batch_size"]
        assert union.max() < n_obs
    for r in ranks[1:]:  # DDP kept every replica identical: all steps ran everywhere
        np.testing.assert_array_equal(r["weights"], ranks[0]["weights"])


# (n_obs, chunk_size, preload_nchunks, batch_size, shard): n_obs prime or odd; few chunks per
# rank (fewer than preload_nchunks); chunk sizes not dividing anything; contiguous shards.
FOUR_RANKS = [  # 2 nodes x 2 processes
    dict(n_obs=997, chunk_size=50, preload_nchunks=8, batch_size=24, shard="chunks"),
    dict(n_obs=613, chunk_size=17, preload_nchunks=3, batch_size=16, shard="contiguous"),
]
TWO_RANKS = [  # 2 nodes x 1 process
    dict(n_obs=509, chunk_size=100, preload_nchunks=4, batch_size=40, shard="chunks"),
    dict(n_obs=777, chunk_size=33, preload_nchunks=2, batch_size=60, shard="contiguous"),
]


def loopback_cases(tmp: Path, settings: list[dict]) -> list[dict]:
    cases = []
    for k, setting in enumerate(settings):
        case = {key: v for key, v in setting.items() if key != "n_obs"}
        case.update(data=store(tmp, setting["n_obs"]), seed=100 + k, epochs=2)
        cases.append(case)
    return cases


def test_four_ranks_on_two_nodes(tmp_path: Path) -> None:
    cases = loopback_cases(tmp_path, FOUR_RANKS)
    results = launch(cases, tmp_path / "out", nnodes=2, nproc=2)
    for setting, case, ranks in zip(FOUR_RANKS, cases, results, strict=True):
        assert [int(r["world_size"]) for r in ranks] == [4] * 4
        check_equal_disjoint_expected(case, setting["n_obs"], ranks)


# One job of 2 nodes x 1 process runs the 2-rank loopback cases and the cases of the
# uneven-batches and resume tests (fewer launches: each costs seconds of imports and JIT).
W2_EVEN, W2_UNEVEN = 1_003, 1_001  # shares 501/502 rows (11/11 batches of 50); 500/501 (10/11)
W2_RESUME = 1_201  # 600 rows a rank, 18 batches of 32, windows of 3 batches


@pytest.fixture(scope="module")
def w2_job(tmp_path_factory) -> tuple[list[dict], list[list[dict]], Path]:
    tmp = tmp_path_factory.mktemp("w2")
    even = dict(
        data=store(tmp, W2_EVEN),
        chunk_size=64,
        preload_nchunks=4,
        batch_size=50,
        enforce=False,
        seed=5,
        epochs=2,
    )
    uneven = dict(even, data=store(tmp, W2_UNEVEN), probe_uneven=True, allow_uneven=True)
    uneven["join"] = True
    resume = dict(
        data=store(tmp, W2_RESUME),
        chunk_size=40,
        preload_nchunks=3,
        batch_size=32,
        seed=9,
        epochs=3,
        name="resume",
        stop_epoch=1,
        stop_after=7,  # inside window 2 of 6
    )
    cases = [even, uneven, resume, *loopback_cases(tmp, TWO_RANKS)]
    return cases, launch(cases, tmp / "out", nnodes=2, nproc=1), tmp / "out"


def test_two_ranks_on_two_nodes(w2_job) -> None:
    cases, results, _ = w2_job
    for setting, case, ranks in zip(TWO_RANKS, cases[3:], results[3:], strict=True):
        assert [int(r["world_size"]) for r in ranks] == [2, 2]
        check_equal_disjoint_expected(case, setting["n_obs"], ranks)


def test_uneven_batches_refused_then_join(w2_job) -> None:
    _, (even, ranks, *_), _ = w2_job
    # even counts with enforce_equal_batches=False are fine: every row exactly once
    for epoch in range(2):
        assert [int(r[f"steps{epoch}"]) for r in even] == [11, 11]
        union = np.concatenate([r[f"epoch{epoch}"] for r in even])
        assert np.array_equal(np.sort(union), np.arange(W2_EVEN))
    # uneven: both ranks refused the epoch (clear error, nobody entered a collective) ...
    for r in ranks:
        message = str(r["probe_error"])
        assert "different numbers of batches [10, 11]" in message
        assert "allow_uneven_batches=True" in message and "Join" in message
    # ... and with the opt-in and Join the job trains through the uneven ends
    for epoch in range(2):
        assert [int(r[f"steps{epoch}"]) for r in ranks] == [10, 11]
        union = np.concatenate([r[f"epoch{epoch}"] for r in ranks])
        assert np.array_equal(np.sort(union), np.arange(W2_UNEVEN)), "every row exactly once"
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[1]["weights"])


def test_resume_two_ranks_on_three(w2_job, tmp_path: Path) -> None:
    cases, (_, _, old, *_), saved = w2_job
    case = {k: v for k, v in cases[2].items() if k not in ("stop_epoch", "stop_after")}
    assert [int(r["steps1"]) for r in old] == [7, 7]
    assert not any("epoch2" in r for r in old)
    # the new job resumes from the states the old one saved (resume_rank*.pt)
    (new,) = launch([dict(case, resume=str(saved))], tmp_path, nnodes=1, nproc=3)
    assert [int(r["resumed_epoch"]) for r in new] == [1, 1, 1]
    assert not any("epoch0" in r for r in new)
    # epoch 1: what the old ranks delivered plus what the new ranks delivered, exactly once
    done = np.concatenate([r["epoch1"] for r in old])
    rest = [r["epoch1"] for r in new]
    steps = [int(r["steps1"]) for r in new]
    assert len(set(steps)) == 1, "equal batch counts on the new ranks"
    delivered = np.concatenate([done, *rest])
    assert len(np.unique(delivered)) == len(delivered), "no row delivered twice"
    old_plan = _sampler(case, 0, 2).plan_epoch(W2_RESUME, 1)
    remaining = 2 * (old_plan.n_rows - 7 * 32)  # rows the old run still owed
    assert len(done) == 2 * 7 * 32
    # the new ranks deliver the remainder but for fewer than 3 x 32 rows (equal batches)
    assert 0 <= remaining - sum(len(r) for r in rest) < 3 * 32
    assert steps[0] == (remaining // 3) // 32
    # ... and each new rank exactly the rows its remainder plan gives it, in that order
    settings = PlanSettings.of(_sampler(case, 0, 3))
    history = (Segment(2, (7, 7)),)
    for rank, got in enumerate(rest):
        plan = plan_resumed_epoch(
            settings, n_obs=W2_RESUME, epoch=1, history=history, rank=rank, world_size=3
        )
        np.testing.assert_array_equal(got, ids_of(plan))
    # epoch 2 follows the normal plan for 3 ranks
    for rank, r in enumerate(new):
        np.testing.assert_array_equal(r["epoch2"], planned_ids(case, W2_RESUME, 2, rank, 3))
    for r in new[1:]:
        np.testing.assert_array_equal(r["weights"], new[0]["weights"])


@pytest.mark.parametrize("shard", ["chunks", "contiguous"])
def test_one_node_drawn_seed_disjoint_equal_complete(tmp_path: Path, shard: str) -> None:
    n_obs = 2_999
    data = synthetic.make_single_cell(
        tmp_path / "sc.zarr", n_obs=n_obs, n_features=64, chunk_elements=1_024
    )
    batch = 128
    case = {"data": str(data), "chunk_size": 64, "preload_nchunks": 4, "batch_size": batch}
    (ranks,) = launch([{**case, "seed": None, "shard": shard}], tmp_path, nnodes=1, nproc=2)
    assert ranks[0]["seed"] == ranks[1]["seed"], "seed=None must be broadcast from rank 0"
    # every rank's ids are its plan under the broadcast seed: equal, disjoint, complete
    drawn = {**case, "shard": shard, "seed": int(ranks[0]["seed"]), "epochs": 2}
    check_equal_disjoint_expected(drawn, n_obs, ranks)
    if shard == "chunks":  # shards move between epochs; contiguous shards stay put
        assert set(ranks[0]["epoch0"].tolist()) != set(ranks[0]["epoch1"].tolist())
    else:
        assert ranks[0]["epoch0"].max() < n_obs // 2 <= ranks[1]["epoch0"].min()


def test_a_rank_that_never_builds_its_loader_is_named(tmp_path: Path) -> None:
    """The ranks' exchange at construction waited for a rank that had left, then raised
    gloo's bare "Connection closed by peer" (or a timeout after 30 minutes) without saying
    which step of dali_zarr waited, or why."""
    store = synthetic.make_single_cell(tmp_path / "s.zarr", n_obs=600, n_features=8)
    worker = [str(AGREEMENT_WORKER), "--stores", store, store, store, "--out", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for code, stdout, stderr in wait_all(
        [start([*torchrun, "--nproc_per_node=2", *worker, "--absent"], env=_env())], TIMEOUT
    ):
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    outcome = json.loads((tmp_path / "rank0.json").read_text())["absent"]
    assert "rank 0 of 2 waited in vain" in outcome and "DistributedSampler and Loader" in outcome


@pytest.mark.parametrize("mode", ["after", "before", "before-world-1"])
def test_a_stale_rank_in_the_environment_is_refused_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    """``dist_info="env"`` with RANK=0 left on every rank (a wrapper's export) under a
    2-process torch.distributed: rank 0 exchanged its settings and rank 1, "rank 0" too,
    did not, so rank 0's exchange paired with rank 1's next collective (DDP's "Rank 1 has 2
    params, while rank 0 has inconsistent 164 params", or garbage). A sampler built before
    init_process_group was not checked by its Loader either: both ranks delivered rank 0's
    rows (with WORLD_SIZE=1: every row, on both). Every rank now raises, naming the
    variables."""
    store = synthetic.make_single_cell(tmp_path / "s.zarr", n_obs=1_000, n_features=8)
    worker = [str(AGREEMENT_WORKER), "--stores", store, store, store, "--out", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node=2", *worker, "--stale-env", mode]
    for code, stdout, stderr in wait_all([start(cmd, env=_env())], TIMEOUT):
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text())["stale_env"] for r in (0, 1)]
    world = "1" if mode == "before-world-1" else "2"
    for kind, text in outcomes:
        assert kind == "error", outcomes
        assert f"RANK/WORLD_SIZE say rank 0 of {world}, but torch.distributed" in text, text
    # rank 1's own words; rank 0's name rank 1 (it could not go on), unless its own
    # world size was stale too
    assert "this one is rank 1" in outcomes[1][1], outcomes[1][1]
    if mode != "before-world-1":
        assert "rank 1 could not go on" in outcomes[0][1], outcomes[0][1]


def test_a_sampler_built_before_the_group_is_checked_by_the_loader(tmp_path: Path) -> None:
    """A DistributedSampler(dist_info="env") built before init_process_group (it needs no
    group) exchanged nothing, and its Loader then checked nothing either: a seed per rank
    over another store on each rank ran 15 and 14 batches (rows twice or never, and DDP
    waiting forever on the last steps)."""
    big = synthetic.make_single_cell(tmp_path / "big.zarr", n_obs=1_000, n_features=8)
    small = synthetic.make_single_cell(tmp_path / "small.zarr", n_obs=900, n_features=8)
    worker = [str(AGREEMENT_WORKER), "--stores", big, small, big, "--out", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node=2", *worker, "--sampler-first"]
    for code, stdout, stderr in wait_all([start(cmd, env=_env())], TIMEOUT):
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    outcomes = [
        json.loads((tmp_path / f"rank{r}.json").read_text())["sampler_first"] for r in (0, 1)
    ]
    for kind, text in outcomes:
        assert kind == "error", outcomes
        assert "n_obs (rank 0: 1000; rank 1: 900)" in text, text
        assert "sampler seed (rank 0: 0; rank 1: 1)" in text and "seed + rank" in text, text
        # seed=None is refused in a sampler built before the group: the hint says when it works
        assert "DistributedSampler after torch.distributed.init_process_group" in text, text


@pytest.mark.parametrize("world", ["gloo", "nccl-default-group", "jax"])
def test_ranks_that_disagree_are_refused_on_every_rank(tmp_path: Path, world: str) -> None:
    """A rank with its own seed, batch size, store or resume step would plan alone (rows
    twice or never, DDP waiting forever); every rank raises the same error instead. With
    an NCCL default group the checks run on a gloo group of their own; JAX's processes
    (jax.distributed, JaxLoader) exchange through JAX."""
    nccl = world == "nccl-default-group"
    big = synthetic.make_single_cell(
        tmp_path / "big.zarr", n_obs=1_000, n_features=16, chunk_elements=256
    )
    small = synthetic.make_single_cell(
        tmp_path / "small.zarr", n_obs=900, n_features=16, chunk_elements=256
    )
    link = tmp_path / "node-local-copy.zarr"
    link.symlink_to(big)
    worker = [str(AGREEMENT_WORKER), "--stores", str(big), str(small), str(link)]
    worker += ["--out", str(tmp_path), *(["--nccl"] if nccl else [])]
    if world == "jax":
        port = str(free_port())
        env = child_env(JAX_PLATFORMS="cpu")
        procs = [start([sys.executable, *worker, "--jax", port, str(i)], env=env) for i in (0, 1)]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        procs = [start([*torchrun, "--nproc_per_node=2", *worker], env=_env())]
    for code, stdout, stderr in wait_all(procs, TIMEOUT):
        assert code == 0, stdout[-2000:] + stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, words in {
        "seed_per_rank": ["DistributedSampler", "seed (rank 0: 0; rank 1: 1)", "seed + rank"],
        "batch_per_rank": ["batch_size (rank 0: 32; rank 1: 64)"],
        "mixed_drawn_seed": ["seed (rank 0: None; rank 1: 7)"],
        "store_per_rank": ["n_obs (rank 0: 1000; rank 1: 900)", "same store"],
        # the same size but other rows or genes (their digests): rows twice or never
        "subset_per_rank": ["selection (rank 0: ['600 of 1000 rows #", "same rows"],
        "features_per_rank": ["selection (rank 0: ['2 of 16 features #", "same rows"],
        # the same stores joined in another order: each rank numbers the rows otherwise
        "collection_order_per_rank": ["selection (rank 0: [{'rows': 1000", "same order"],
        # ... also stores of one size, which sizes alone took for the same order
        "equal_parts_swapped": ["stores' sampled rows (rank 0: ['", "same order"],
        # the same store and size, another matrix (X, layers/counts): other values, unsaid
        "element_per_rank": [
            "selection (rank 0: ['element X']; rank 1: ['element layers",
            "element=",
        ],
        "resume_other_steps": ["load_state_dict", "batches left (rank 0: ", "same step"],
        # equal counts without enforce_equal_batches: the epoch runs under DDP, so the
        # steps must agree too (they were not compared: rows twice, then a hang)
        "resume_other_steps_unenforced": ["load_state_dict", "batches left (rank 0: "],
    }.items():
        (kind, text), (kind1, text1) = ranks[0][name], ranks[1][name]
        # the same error on every rank (a loader names its own rank's store)
        assert kind1 == kind and text1.split(": the ")[1] == text.split(": the ")[1], name
        assert kind == "error" and all(w in text for w in words), (name, text)
    # a rank refused on its own still takes part in the exchange: no rank is left waiting
    for name in (
        "refused_on_one_rank",
        "state_refused_on_one_rank",
        "sampler_refused_on_one_rank",
        "path_on_one_rank",
        # rank 1 alone took stale launcher variables for its world: it went on as the only
        # rank (every row) while rank 0 waited for it
        "env_stale_on_one_rank",
    ):
        (kind0, text0), (kind1, text1) = ranks[0][name], ranks[1][name]
        assert kind0 == kind1 == "error", name
        assert text0.split(": ", 1)[1].startswith("rank 1 could not go on"), text0
        assert "rank 1" not in text1.split(": ", 1)[0], text1  # rank 1 raises its own
    # ... also where the refusal comes from the loader's reader (an obs column missing
    # from rank 1's store; rank 0 went on alone and waited in its first DDP step), or from
    # loading a state into a loader rank 1 had already iterated (rank 0 waited in the
    # exchange of load_state_dict)
    obs = [r["obs_refused_on_one_rank"] for r in ranks]
    assert obs[0][0] == "error" and "rank 1 could not go on (DatasetError: " in obs[0][1], obs
    assert obs[1][0] == "ok" and "no column 'no_such_column'" in obs[1][1], obs
    used = [r["state_into_a_used_loader_on_one_rank"] for r in ranks]
    assert used[0][0] == used[1][0] == "error", used
    assert "rank 1 could not go on" in used[0][1] and "fresh Loader" in used[0][1], used
    assert "fresh Loader" in used[1][1] and "rank 1" not in used[1][1].split(": ", 1)[0], used
    assert ranks[0]["refused_on_one_rank"][1].count("sideways") == 1
    assert "unknown shard 'rows'" in ranks[0]["sampler_refused_on_one_rank"][1]
    assert "open the store first" in ranks[0]["path_on_one_rank"][1]
    stale = "RANK/WORLD_SIZE say rank 0 of 1, but "
    assert (
        stale in ranks[0]["env_stale_on_one_rank"][1]
        and stale in ranks[1]["env_stale_on_one_rank"][1]
    )
    # ... also with an error that is not ours (it skipped the exchange: rank 0 waited)
    (kind0, text0), (kind1, text1) = (
        ranks[0]["raw_error_on_one_rank"],
        ranks[1]["raw_error_on_one_rank"],
    )
    assert kind0 == "error" and "rank 1 could not go on (OSError: disk gone" in text0, text0
    assert kind1 == "ok" and text1 == "OSError: disk gone", text1
    # JaxLoader's refusal of values its 32-bit mode would wrap (rank 1's copy of the store)
    # came after the exchange: rank 0 went on alone
    wrapped = [r["int32_refused_on_one_rank"] for r in ranks]
    if world == "jax":
        assert wrapped[0][0] == wrapped[1][0] == "error", wrapped
        assert "rank 1 could not go on" in wrapped[0][1], wrapped
        assert "beyond int32" in wrapped[1][1], wrapped
    else:  # torch's int64 holds them
        assert wrapped[0][0] == wrapped[1][0] == "ok", wrapped
    # uneven counts are refused on every rank before a batch (DDP or JAX would wait forever)
    uneven = [r["uneven_counts"] for r in ranks]
    assert uneven[0] == uneven[1] and uneven[0][0] == "error", uneven
    assert "batches [15, 16]" in uneven[0][1] and "wait forever" in uneven[0][1], uneven
    assert [r["seed_per_rank_unshuffled"] for r in ranks] == [["ok", True]] * 2
    seeds = [r["drawn_seed"] for r in ranks]
    assert seeds[0] == seeds[1] and seeds[0][0] == "ok"  # rank 0's draw, on both
    assert [r["own_world"] for r in ranks] == [["ok", False]] * 2  # not the world: unchecked
    # a plain ChunkSampler under a world of 2: every rank reads all 1,000 rows, and is told
    for kind, (rows, said) in (r["chunk_sampler_under_a_world"] for r in ranks):
        assert kind == "ok" and rows >= 960 and len(said) == 1, (rows, said)
        assert "processes, so every rank reads every row" in said[0], said
        assert "dz.DistributedSampler(sampler, dist_info=" in said[0], said
    for name in ("same_store_other_paths", "equal_parts_copies"):  # copies at other paths
        lens = [r[name] for r in ranks]
        assert lens[0] == lens[1] and lens[0][0] == "ok" and lens[0][1] > 0, (name, lens)
    # states of one step resume: each rank gets the rest of its epoch, as many batches
    rest = [r["resume_same_step"] for r in ranks]
    assert rest[0][0] == rest[1][0] == "ok" and len(rest[0][1]) == len(rest[1][1]) > 0
    assert [r["cpu_group_made"] for r in ranks] == [nccl, nccl]
