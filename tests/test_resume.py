"""Resuming: Loader.state_dict / load_state_dict and the pure remainder planning.

Same world size: the continued stream is the uninterrupted one, batch for batch, and windows
before the resume point are never read. Another world size (4 -> 2, 2 -> 3, 3 -> 1, and
twice in one epoch): the rest of the epoch is delivered exactly once across the new ranks,
with exact accounting of the rows an equal-batch split leaves out, and later epochs follow
the normal plan. States of another dataset or other settings are refused. DALI's own
checkpoint carries the state of random ops in a user transform.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.errors import ConfigError
from dali_zarr.planning import (
    PlanSettings,
    Segment,
    batch_counts,
    iter_batches,
    plan_epoch,
    plan_resumed_epoch,
)
from dali_zarr.planning.resume import make_state, resume_point
from tests.stores import csr_reference

N_OBS = 997
CFG = dict(chunk_size=32, preload_nchunks=4, batch_size=30)  # windows of 4 batches (120 rows)
BPW = 4


def noisy(outputs: dict) -> dict:
    """A transform with a random op, whose state only a DALI checkpoint carries."""
    from nvidia.dali import fn

    outputs["noise"] = fn.random.uniform(range=[0.0, 1.0], shape=[2])
    return outputs


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("resume") / "sc.zarr"
    return synthetic.make_single_cell(path, n_obs=N_OBS, n_features=32, chunk_elements=512)


@pytest.fixture(scope="module")
def reference(store: str) -> np.ndarray:
    return csr_reference(store).toarray().astype(np.float32)


def sampler(world: int | None = None, rank: int = 0, **over) -> dz.ChunkSampler:
    """A ChunkSampler (world None) or rank ``rank`` of a DistributedSampler of ``world``."""
    enforce = over.pop("enforce", True)
    shard = over.pop("shard", "chunks")
    base = dz.ChunkSampler(**{**CFG, "seed": 3, **over})
    if world is None:
        return base
    return dz.DistributedSampler(
        base, dist_info=lambda: (rank, world), enforce_equal_batches=enforce, shard=shard
    )


def loader(store: str, s, **kwargs) -> dz.Loader:
    return dz.Loader(dz.open_dataset(store), s, return_index=True, num_threads=1, **kwargs)


def take(
    ld: dz.Loader, epoch: int, stop: int | None = None, saves: dict[int, dict] | None = None
) -> list[dict[str, np.ndarray]]:
    """Batches of ``epoch`` (the first ``stop`` only, then leave the loop); with ``saves``,
    ``saves[k]`` is the state after ``k`` batches, taken while the loop goes on."""
    ld.set_epoch(epoch)
    out = []
    for batch in ld:
        out.append({k: v.numpy() for k, v in batch.items()})
        if saves is not None:
            saves[len(out)] = ld.state_dict()
        if stop is not None and len(out) == stop:
            break
    return out


def roundtrip(state):
    """Through torch.save / torch.load, as a job saves it with its model."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def plan_ids(plan, start: int = 0, stop: int | None = None) -> list[np.ndarray]:
    return list(iter_batches(plan, start))[: None if stop is None else stop - start]


def cat(batches) -> np.ndarray:
    return np.concatenate([np.zeros(0, np.int64), *batches])


# --------------------------------------------------------------------------- same world size


@pytest.mark.parametrize(
    "world,rank,stop,over",
    [
        pytest.param(None, 0, 5, {}, id="1rank-mid-window"),
        pytest.param(2, 1, 8, {}, id="2ranks-window-border"),
        pytest.param(
            3, 2, None, dict(enforce=False, drop_last=True, shard="contiguous"), id="3ranks-at-end"
        ),
    ],
)
def test_same_world_resume_is_identical(store, reference, world, rank, stop, over) -> None:
    s = sampler(world, rank, **over)
    plan1, plan2 = s.plan_epoch(N_OBS, 1), s.plan_epoch(N_OBS, 2)
    first = loader(store, s, prefetch_queue_depth=4)
    calls: list[int] = []
    batch_fn = first._source._batch
    first._source._batch = lambda e, i: (calls.append(i), batch_fn(e, i))[1]
    got = take(first, 1, stop)
    stop = plan1.n_batches if stop is None else stop
    assert len(got) == stop
    if stop < plan1.n_batches:
        time.sleep(0.3)  # let DALI run ahead: the state must count what the user consumed
        assert max(calls) >= stop, "DALI prefetched past the consumed batches"
    state = roundtrip(first.state_dict())
    assert (state["epoch"], state["consumed"], state["rank"]) == (1, stop, rank)
    assert state["n_batches"] == plan1.n_batches and state["dali"] is None
    if world is None:  # the uninterrupted stream, from the same loader
        rest_ref = take(first, 1)
        assert len(rest_ref) == plan1.n_batches
        rest_ref = rest_ref[stop:]
    first.close()

    second = loader(store, s)
    reads: list[np.ndarray] = []
    read_rows = second.dataset.read_rows
    second.dataset.read_rows = lambda r: (reads.append(np.array(r)), read_rows(r))[1]
    second.load_state_dict(state)
    assert second.epoch == 1 and len(second) == plan1.n_batches - stop
    rest = take(second, 1)
    assert [b["index"].tolist() for b in rest] == [b.tolist() for b in plan_ids(plan1, stop)]
    if world is None:
        for a, b in zip(rest, rest_ref, strict=True):
            np.testing.assert_array_equal(a["index"], b["index"])
            np.testing.assert_array_equal(a["X"], b["X"])
    for b in rest:
        np.testing.assert_array_equal(b["X"], reference[b["index"]])
    # windows before the resume point were never read (none at all after the last batch),
    # the others once; near the end the loader may have read epoch 2's first windows ahead
    w0 = stop // BPW if stop < plan1.n_batches else plan1.n_windows
    read = [r.tobytes() for r in reads]
    wanted = [plan1.window(w).row_ranges.tobytes() for w in range(w0, plan1.n_windows)]
    n_ahead = min(second._source.prefetch_windows, plan2.n_windows)
    ahead = {plan2.window(w).row_ranges.tobytes() for w in range(n_ahead)}
    assert sorted(r for r in read if r not in ahead) == sorted(wanted)
    # later epochs as usual
    assert [b["index"].tolist() for b in take(second, 2)] == [b.tolist() for b in plan_ids(plan2)]
    with pytest.raises(ConfigError, match="fresh Loader"):
        second.load_state_dict(state)
    second.close()


# --------------------------------------------------------------------------- elastic restarts


def delivered_by(plans, consumed) -> np.ndarray:
    return cat(b for p, c in zip(plans, consumed, strict=True) for b in plan_ids(p, 0, c))


@pytest.mark.parametrize(
    "old_world,new_world,stop,as_list,over",
    [
        pytest.param(4, 2, 3, False, {}, id="4to2-one-state"),
        pytest.param(2, 3, 6, True, dict(shard="contiguous"), id="2to3-all-states"),
    ],
)
def test_elastic_resume(store, reference, old_world, new_world, stop, as_list, over) -> None:
    epoch = 2
    old_plans = [sampler(old_world, r, **over).plan_epoch(N_OBS, epoch) for r in range(old_world)]
    # the old job: with as_list every old rank runs and saves; else only rank 0's state is used
    states = []
    for r in range(old_world if as_list else 1):
        ld = loader(store, sampler(old_world, r, **over))
        got = take(ld, epoch, stop)
        assert [b["index"].tolist() for b in got] == [
            b.tolist() for b in plan_ids(old_plans[r], 0, stop)
        ]
        states.append(roundtrip(ld.state_dict()))
        ld.close()
    done = delivered_by(old_plans, [stop] * old_world)

    new_plans = [
        sampler(new_world, r, **over).plan_epoch(N_OBS, epoch + 1) for r in range(new_world)
    ]
    rest, lens, mid_states, skipped = [], [], [], []
    for r in range(new_world):
        ld = loader(store, sampler(new_world, r, **over))
        ld.load_state_dict(states if as_list else states[0])
        assert ld.epoch == epoch
        lens.append(len(ld))
        skipped.append((ld.plan().rows_done, ld.plan().rows_skipped))
        saves: dict[int, dict] = {}
        got = take(ld, epoch, saves=saves)
        for b in got:
            np.testing.assert_array_equal(b["X"], reference[b["index"]])
        rest.append(cat(b["index"] for b in got))
        if 1 in saves:  # a state saved in the remainder epoch
            mid_states.append(saves[1])
        # later epochs: the normal plan of the new world
        assert [b["index"].tolist() for b in take(ld, epoch + 1)] == [
            b.tolist() for b in plan_ids(new_plans[r])
        ]
        ld.close()

    plan = plan_resumed_epoch(
        PlanSettings.of(sampler(new_world, 0, **over)),
        n_obs=N_OBS,
        epoch=epoch,
        history=(Segment(old_world, (stop,) * old_world),),
        rank=0,
        world_size=new_world,
    )
    everything = np.concatenate([done, *rest])
    assert len(np.unique(everything)) == len(everything), "a row was delivered twice"
    assert len(set(lens)) == 1 and lens[0] == plan.n_batches, "equal batch counts"
    assert plan.rows_done == len(done) == old_world * stop * CFG["batch_size"]
    assert N_OBS - len(everything) == plan.rows_skipped, "exact accounting of skipped rows"
    assert set(skipped) == {(plan.rows_done, plan.rows_skipped)}, "Loader.plan() tells"
    owed = sum(p.n_rows for p in old_plans) - len(done)
    assert 0 <= owed - sum(len(r) for r in rest) < new_world * CFG["batch_size"]
    # a state saved in the remainder epoch carries the interrupted run as history; loading
    # it on yet another world size finishes the epoch (pure planning, checked at length in
    # test_remainder_plans_deliver_every_owed_row_exactly_once)
    assert mid_states and mid_states[0]["history"] == [
        {"world_size": old_world, "consumed": [stop] * old_world}
    ]
    assert mid_states[0]["consumed"] == 1 and mid_states[0]["world_size"] == new_world
    third = sampler(1, 0, **over)
    point = _point(mid_states[0], third, fingerprint=mid_states[0]["dataset"])
    assert point.history == (
        Segment(old_world, (stop,) * old_world),
        Segment(new_world, (1,) * new_world),
    )


def test_a_run_that_delivered_nothing_of_the_epoch_adds_no_split(store) -> None:
    """A state saved at an epoch's start (after set_epoch, before its first batch) and
    loaded on another number of ranks was replanned as the remainder of a run that had
    delivered nothing: the old world's split and then the new one's each left rows out
    (2 -> 3 ranks: 900 rows where a 3-rank epoch delivers 990), in other batches than the
    new world's epoch; a restart that saved before its first step lost rows again. Such a
    run is no segment of the epoch's history: the new world runs the epoch's normal plan
    (or the remainder of the runs before)."""
    states = []
    for r in range(2):
        with loader(store, sampler(2, r)) as ld:
            take(ld, 0)
            ld.set_epoch(1)
            states.append(roundtrip(ld.state_dict()))
    for r in range(3):
        with loader(store, sampler(3, r)) as ld:
            ld.load_state_dict(states if r else states[0])
            got = [b["index"].tolist() for b in take(ld, 1)]
        assert got == [b.tolist() for b in plan_ids(sampler(3, r).plan_epoch(N_OBS, 1))]
    # 2 ranks stop after 3 batches; 3 ranks load it and save before their first step; 2
    # ranks finish the epoch: the rows of going 2 -> 2 directly (in the remainder plan's
    # batches), none left out on the way
    done, mid, chained, direct = [], [], [], []
    for r in range(2):
        with loader(store, sampler(2, r)) as ld:
            done += [b["index"] for b in take(ld, 0, stop=3)]
            states[r] = roundtrip(ld.state_dict())
    for r in range(3):
        with loader(store, sampler(3, r)) as ld:
            ld.load_state_dict(states)
            mid.append(roundtrip(ld.state_dict()))
    for r in range(2):
        for loaded, out in ((mid, chained), (states, direct)):
            with loader(store, sampler(2, r)) as ld:
                ld.load_state_dict(loaded)
                out += [b["index"] for b in take(ld, 0)]
    np.testing.assert_array_equal(np.sort(cat(chained)), np.sort(cat(direct)))
    everything = cat(done + chained)
    assert len(np.unique(everything)) == len(everything)


def test_states_of_other_steps_on_the_same_world_are_refused_without_a_group(store) -> None:
    """Every rank's states, saved after different steps, loaded on as many ranks without a
    process group to compare them (dist_info a callable): each rank resumed from its own
    step, so the ranks had other batch counts left ([7, 8, 8] in an audit) and DDP waits
    forever on the last step. Refused now, as the ranks' exchange refuses it where there
    is one; the same steps resume."""
    for steps, refused in (([3, 2], True), ([2, 2], False)):
        states = []
        for r, stop in enumerate(steps):
            with loader(store, sampler(2, r)) as ld:
                take(ld, 0, stop=stop)
                states.append(roundtrip(ld.state_dict()))
        for r in range(2):
            with loader(store, sampler(2, r)) as ld:
                if refused:
                    with pytest.raises(ConfigError, match=r"saved after different steps"):
                        ld.load_state_dict(states)
                else:
                    ld.load_state_dict(states)
                    assert len(ld) == sampler(2, r).plan_epoch(N_OBS, 0).n_batches - 2


# --------------------------------------------------------------------------- DALI checkpoints


def test_dali_checkpoint_restores_random_ops(store) -> None:
    def make() -> dz.Loader:
        return loader(store, sampler(), transform=noisy, enable_checkpointing=True)

    run = make()
    run.set_epoch(0)
    full0, mid = [], None
    for batch in run:
        full0.append({k: v.numpy() for k, v in batch.items()})
        if len(full0) == 6:
            mid = run.state_dict()  # mid-epoch, while the loop goes on
    run.set_epoch(1)
    between = run.state_dict()  # after the epoch, before the next one started
    full1 = take(run, 1)
    run.close()
    assert mid["dali"]["iteration"] == 6 and isinstance(mid["dali"]["checkpoint"], bytes)
    assert between["epoch"] == 1 and between["consumed"] == 0

    resumed = make()
    resumed.load_state_dict(roundtrip(mid))
    rest0, rest1 = take(resumed, 0), take(resumed, 1)
    resumed.close()
    resumed2 = make()
    resumed2.load_state_dict(roundtrip(between))
    again1 = take(resumed2, 1)
    resumed2.close()
    for got, want in ((rest0, full0[6:]), (rest1, full1), (again1, full1)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a["index"], b["index"])
            np.testing.assert_array_equal(a["noise"], b["noise"])  # DALI's RNG state restored
            np.testing.assert_array_equal(a["X"], b["X"])


def test_a_dali_checkpoint_after_a_loop_left_early_continues_the_random_ops(store) -> None:
    """A loop left early (break) leaves batches DALI had prefetched, the transform's random
    ops already drawn for them; the next loop drains them first. A state saved before that
    loop restored the ops at the last batch handed out, short of those draws, so the resumed
    epoch's random values differed from the uninterrupted run's."""

    def make() -> dz.Loader:
        return loader(store, sampler(), transform=noisy, enable_checkpointing=True)

    for stop in (1, 3):
        with make() as run:
            take(run, 0, stop=stop)
            run.set_epoch(1)
            state = roundtrip(run.state_dict())
            want = take(run, 1)
        assert (state["epoch"], state["consumed"]) == (1, 0)
        with make() as resumed:
            resumed.load_state_dict(state)
            got = take(resumed, 1)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a["index"], b["index"])
            np.testing.assert_array_equal(a["noise"], b["noise"])


def test_a_dali_checkpoint_of_another_transform_is_refused_by_name(store) -> None:
    """A state whose DALI checkpoint came from a pipeline with other operators (another
    transform) failed at the first batch with DALI's bare RuntimeError ("There's no
    checkpoint for operator ..."); it is a ConfigError that says what to change, and the
    loaded position stays: a retry raises again instead of restarting the epoch at batch 0."""
    saved = {}
    for name, transform in (("noisy", noisy), ("plain", None)):
        with loader(store, sampler(), transform=transform, enable_checkpointing=True) as run:
            take(run, 0, stop=5)
            saved[name] = roundtrip(run.state_dict())
    for state, transform in ((saved["noisy"], None), (saved["plain"], noisy)):
        with loader(store, sampler(), transform=transform, enable_checkpointing=True) as ld:
            ld.load_state_dict(state)
            for _ in range(2):  # again: still refused, not the epoch from its start
                with pytest.raises(ConfigError, match=r"another transform.*DALI said"):
                    take(ld, 0)
            assert ld.state_dict()["consumed"] == 5
        with loader(store, sampler(), transform=transform) as ld:  # without DALI's state
            ld.load_state_dict(state)
            assert len(take(ld, 0)) == ld.plan().n_batches - 5


def test_a_dali_checkpoint_of_other_loader_arguments_is_named_or_not_needed(store) -> None:
    """A DALI checkpoint fits only a pipeline of the same operators: one saved with other
    obs columns, dtype, output or device was refused as if the transform had changed ("saved
    by a Loader with another transform"), also where neither loader has a transform, whose
    pipeline holds no operator state to continue. Without a transform on either side the
    checkpoint is not needed and the rows resume; with one, the refusal names what differs."""
    full = cat(b["index"] for b in take(loader(store, sampler()), 0))
    saved = {}
    for name, transform in (("plain", None), ("noisy", noisy)):
        with loader(store, sampler(), transform=transform, enable_checkpointing=True) as run:
            got = take(run, 0, stop=5)
            saved[name] = roundtrip(run.state_dict())
    for changed in (dict(obs=["cell_type"]), dict(dtype="float16"), dict(output="csr")):
        with loader(store, sampler(), enable_checkpointing=True, **changed) as ld:
            ld.load_state_dict(saved["plain"])
            rest = [b["index"].numpy() for b in ld]
        np.testing.assert_array_equal(cat([b["index"] for b in got] + rest), full)
    with loader(
        store, sampler(), transform=noisy, enable_checkpointing=True, obs=["cell_type"]
    ) as ld:
        ld.load_state_dict(saved["noisy"])
        with pytest.raises(ConfigError, match=r"obs: saved \[\], now \['cell_type'\]"):
            take(ld, 0)


def test_a_dali_checkpoint_a_loader_without_checkpointing_drops_is_said(store, caplog) -> None:
    """README: a state's DALI checkpoint is restored where the same rank of the same world
    loads it. Into a loader with a transform but enable_checkpointing=False (README's own
    resume example passes none) it was dropped with an INFO line only: the transform's
    random ops restarted, unlike the run that saved the state. That now warns, naming
    enable_checkpointing; without a transform nothing is lost and it stays an INFO line."""
    import logging

    with loader(store, sampler(), transform=noisy, enable_checkpointing=True) as run:
        take(run, 0, stop=3)
        state = roundtrip(run.state_dict())
    assert state["dali"]
    for transform, warns in ((noisy, True), (None, False)):
        caplog.clear()
        at_info = caplog.at_level(logging.INFO, logger="dali_zarr.loader")
        with at_info, loader(store, sampler(), transform=transform) as ld:
            ld.load_state_dict(state)
        said = [r for r in caplog.records if "DALI checkpoint" in r.getMessage()]
        assert said, "the dropped checkpoint is mentioned"
        assert (said[0].levelno == logging.WARNING) == warns, said[0].getMessage()
        if warns:
            assert "enable_checkpointing=True" in said[0].getMessage()


def test_a_state_saved_after_close_says_it_has_no_dali_checkpoint(store, caplog) -> None:
    """close() lets the pipeline, and its operators' state, go: a state saved after a `with`
    block had no DALI checkpoint, without a word, so the transform's random ops restarted on
    resume (README: with enable_checkpointing they continue exactly). It warns now, saying
    to save before close(); the rows still resume exactly."""
    import logging

    with loader(store, sampler(), transform=noisy, enable_checkpointing=True) as run:
        first = take(run, 0, stop=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dali_zarr.loader"):
        state = roundtrip(run.state_dict())
    assert state["dali"] is None
    said = [r.getMessage() for r in caplog.records if "was closed" in r.getMessage()]
    assert said and "before close()" in said[0]
    with loader(store, sampler(), transform=noisy, enable_checkpointing=True) as fresh:
        whole = take(fresh, 0)
    with loader(store, sampler(), transform=noisy, enable_checkpointing=True) as ld:
        ld.load_state_dict(state)
        rest = take(ld, 0)
    np.testing.assert_array_equal(
        np.concatenate([b["index"] for b in first + rest]),
        np.concatenate([b["index"] for b in whole]),
    )


def test_a_state_saved_after_close_without_a_transform_says_nothing(store, caplog) -> None:
    """Without a transform no DALI operator keeps a state (the rows come from the plan), so
    the "closed ... the transform's random ops restart" warning told a loader with
    enable_checkpointing=True and no transform to move its state_dict() for nothing."""
    import logging

    with loader(store, sampler(), enable_checkpointing=True) as run:
        take(run, 0, stop=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dali_zarr.loader"):
        state = roundtrip(run.state_dict())
    assert state["consumed"] == 3
    assert not [r for r in caplog.records if "was closed" in r.getMessage()]


def test_a_dali_checkpoint_after_a_failed_batch_loses_no_batch(tmp_path: Path) -> None:
    """DALI's iterator counts a batch before the read behind it fails; its checkpoint then
    resumed one batch late, and that batch was never delivered. The state is saved without
    it after a failure (the position is ours and exact)."""
    path = synthetic.make_single_cell(
        tmp_path / "bad.zarr", n_obs=N_OBS, n_features=32, chunk_elements=512, shard_chunks=None
    )
    chunks = sorted((Path(path) / "X" / "data" / "c").iterdir(), key=lambda c: int(c.name))
    chunk = chunks[-2]  # rows read late in an unshuffled epoch
    intact = chunk.read_bytes()
    expected = cat(
        b["index"] for b in take(loader(path, sampler(shuffle=False), enable_checkpointing=True), 0)
    )
    chunk.write_bytes(b"garbage" * 50)
    failed = loader(path, sampler(shuffle=False), enable_checkpointing=True)
    got = []
    with pytest.raises(dz.ChunkReadError, match="X/data"):
        for batch in failed:
            got.append(batch["index"].numpy())
    state = roundtrip(failed.state_dict())
    failed.close()
    assert 0 < state["consumed"] == len(got)
    chunk.write_bytes(intact)  # restored from a backup
    resumed = loader(path, sampler(shuffle=False), enable_checkpointing=True)
    resumed.load_state_dict(state)
    rest = [b["index"] for b in take(resumed, 0)]
    np.testing.assert_array_equal(cat(got + rest), expected)
    assert state["dali"] is None  # DALI's had counted the failed batch


def test_set_epoch_inside_the_loop_does_not_move_the_state(store) -> None:
    """set_epoch(e + 1) called while epoch e's loop still runs made state_dict() report
    epoch e + 1 at batch 0: a checkpoint then never delivered the rest of epoch e. The loop
    that runs is what the state describes; once it is left, the next epoch is."""
    full = cat(b["index"] for b in take(loader(store, sampler()), 0))
    run = loader(store, sampler())
    got = []
    for batch in run:
        got.append(batch["index"].numpy())
        if len(got) == 5:
            run.set_epoch(1)  # too early: epoch 0 is still being delivered
            mid = roundtrip(run.state_dict())
    assert (mid["epoch"], mid["consumed"]) == (0, 5)
    for _batch in run:  # the loop of epoch 1, left at once: the state moves on with it
        break
    after = run.state_dict()
    run.close()
    assert (after["epoch"], after["consumed"]) == (1, 1)
    resumed = loader(store, sampler())
    resumed.load_state_dict(mid)
    rest = [b["index"] for b in take(resumed, 0)]
    resumed.close()
    np.testing.assert_array_equal(cat(got[:5] + rest), full)


# --------------------------------------------------------------------------- refused states


def _state(s, epoch=1, consumed=2, **over) -> dict:
    fingerprint = dict(name="sc.zarr", n_obs=N_OBS, feature_shape=[32], dtype="float32")
    fingerprint["layout"] = "csr"
    state = make_state(
        settings=PlanSettings.of(s),
        dataset=fingerprint,
        epoch=epoch,
        consumed=consumed,
        n_batches=s.num_batches(N_OBS),
        rank=s.rank,
        world_size=s.world_size,
    )
    state.update(over)
    return state


def _point(state, s, n_obs=N_OBS, name="sc.zarr", fingerprint=None):
    if fingerprint is None:
        fingerprint = dict(name=name, n_obs=n_obs, feature_shape=[32], dtype="float32")
        fingerprint["layout"] = "csr"
    return resume_point(
        state,
        settings=PlanSettings.of(s),
        dataset=fingerprint,
        rank=s.rank,
        world_size=s.world_size,
    )


def test_refuses_other_dataset_or_settings(store, tmp_path: Path) -> None:
    s = sampler(2, 0)
    state = _state(s)
    assert _point(state, s).start == 2
    with pytest.raises(ConfigError, match=r"dataset n_obs: saved 997, now 998"):
        _point(state, s, n_obs=998)
    with pytest.raises(ConfigError, match=r"dataset name: saved 'sc.zarr', now 'other.zarr'"):
        _point(state, s, name="other.zarr")
    with pytest.raises(ConfigError, match=r"sampler batch_size: saved 30, now 31"):
        _point(state, sampler(2, 0, batch_size=31))
    with pytest.raises(ConfigError, match=r"sampler seed: saved 3, now 4.*seed=state"):
        _point(state, sampler(2, 0, seed=4))
    with pytest.raises(
        ConfigError,
        match=r"enforce_equal_batches: saved True, now False.*Build the DistributedSampler "
        r"with enforce_equal_batches=True, shard='chunks'$",
    ):
        _point(state, sampler(2, 0, enforce=False))
    with pytest.raises(  # onto one rank: wrap the plain ChunkSampler (never on several)
        ConfigError,
        match=r"shard: saved 'contiguous', now 'chunks'.*wrap it: DistributedSampler\("
        r"sampler, dist_info=lambda: \(0, 1\), enforce_equal_batches=True, shard='contiguous'\)",
    ):
        _point(_state(sampler(2, 0, shard="contiguous")), sampler())
    with pytest.raises(ConfigError, match="not a dali_zarr loader state"):
        _point({"epoch": 1}, s)
    with pytest.raises(ConfigError, match="version 99"):
        _point({**state, "version": 99}, s)
    with pytest.raises(ConfigError, match="consumed 99 batches"):
        _point({**state, "consumed": 99}, s)
    with pytest.raises(ConfigError, match="one state per rank"):
        _point([state, state], sampler(3, 0))
    with pytest.raises(ConfigError, match="do not belong to one run"):
        _point([state, _state(sampler(2, 1), epoch=2)], s)
    with pytest.raises(ConfigError, match="does not match its epoch and sampler settings"):
        _point({**state, "epoch": 2}, s)  # an edited state: its order digest is epoch 1's
    with pytest.raises(ConfigError, match="does not match its epoch and sampler settings"):
        _point({**state, "epoch": np.int64(2)}, s)  # (a NumPy epoch skipped the check)
    # through the Loader: a store of another size (and name) is refused at load time
    other = synthetic.make_single_cell(tmp_path / "other.zarr", n_obs=998, n_features=32)
    ld = loader(store, s)
    real_state = ld.state_dict()
    ld.close()
    with pytest.raises(
        ConfigError, match=r"name: saved 'sc.zarr/X', now 'other.zarr/X'; dataset n_obs: saved 997"
    ):
        loader(other, s).load_state_dict(real_state)


def test_a_state_whose_dataset_or_sampler_is_no_dict_is_named() -> None:
    """dict(None) raised a bare TypeError, which also escaped the Loader's exchange of
    refusals (it passes ConfigErrors on): the other ranks were left waiting for this one."""
    s = sampler(2, 0)
    for key in ("dataset", "sampler"):
        with pytest.raises(ConfigError, match=f"malformed loader state: {key} must be a dict"):
            _point({**_state(s), key: None}, s)


def test_a_numpy_that_permutes_otherwise_is_refused(monkeypatch) -> None:
    """The state carries a digest of its epoch's chunk order: resumed where NumPy's
    permutation stream differs, the plan would not be the one the saving run followed."""
    s = sampler(2, 0)
    state = _state(s, epoch=3)
    assert state["numpy"] == np.__version__ and len(state["order"]) == 16
    assert _point(state, s).start == 2
    from dali_zarr.planning import resume

    real = resume.global_chunk_order
    monkeypatch.setattr(resume, "global_chunk_order", lambda n, **kw: real(n, **kw)[::-1])
    resume.epoch_order_digest.cache_clear()  # a fresh process under that NumPy
    monkeypatch.setattr(np, "__version__", "9.0.0")
    with pytest.raises(ConfigError, match=r"epoch 3's chunk order .* \(NumPy .* then, 9\.0\.0 now"):
        _point(state, s)
    legacy = {k: v for k, v in state.items() if k not in ("order", "numpy")}
    assert _point(legacy, s).start == 2  # states saved before the digest: not checked


def test_an_unshuffled_run_resumes_whatever_the_ranks_seeds(store) -> None:
    """Without shuffling the seed orders nothing, so ranks may hold different ones (the
    samplers' exchange lets seed + rank through) and a restart may draw another; the state's
    seed was still compared, which refused every resume of such a run, and a list of states
    of different seeds could match no sampler at all."""
    states, done = [], []
    for r in range(2):  # seed + rank
        with loader(store, sampler(2, r, seed=r, shuffle=False)) as ld:
            done += [b["index"] for b in take(ld, 1, 3)]
            states.append(roundtrip(ld.state_dict()))
    rest, skipped = [], set()
    for r in range(3):  # another world, other seeds again
        with loader(store, sampler(3, r, seed=10 + r, shuffle=False)) as ld:
            ld.load_state_dict(states)
            skipped.add(ld.plan().rows_skipped)
            rest += [b["index"] for b in take(ld, 1)]
    everything = cat(done + rest)
    assert len(np.unique(everything)) == len(everything), "a row was delivered twice"
    assert len(skipped) == 1 and N_OBS - len(everything) == skipped.pop()
    with loader(store, sampler(2, 1, seed=7, shuffle=False)) as ld:  # its own state
        ld.load_state_dict(states[1])
        assert [b["index"].tolist() for b in take(ld, 1)] == [
            b.tolist() for b in plan_ids(sampler(2, 1, shuffle=False).plan_epoch(N_OBS, 1), 3)
        ]
    with pytest.raises(ConfigError, match="sampler seed: saved 3, now 1"):  # shuffled: compared
        _point(_state(sampler(2, 0)), sampler(2, 0, seed=1))


def test_one_state_of_uneven_ranks() -> None:
    """enforce_equal_batches=False, n_obs 997 over 2 ranks in batches of 83: shares of 498 and
    499 rows give 6 and 7 batches. A single state is read as "all ranks ran in lockstep"."""
    old = [sampler(2, r, enforce=False, batch_size=83, preload_nchunks=3) for r in range(2)]
    assert [o.num_batches(N_OBS) for o in old] == [6, 7]
    new = sampler(3, 0, enforce=False, batch_size=83, preload_nchunks=3)
    # rank 0 still running: all ranks did 4 steps in lockstep
    point = _point(_state(old[0], consumed=4), new)
    assert point.history == (Segment(2, (4, 4)),)
    # rank 0 finished (6 of 6) while rank 1 has 7: one state cannot tell, the list can
    with pytest.raises(ConfigError, match="pass the list of all ranks' states"):
        _point(_state(old[0], consumed=6), new)
    states = [_state(old[0], consumed=6), _state(old[1], consumed=7)]
    assert _point(states, new).history == (Segment(2, (6, 7)),)
    # rank 1's state with 6 steps: rank 0 had finished its 6 too
    assert _point(_state(old[1], consumed=6), new).history == (Segment(2, (6, 6)),)
    # the same world: this rank's own count
    assert _point(states, old[1]).start == 7 and _point(states, old[0]).start == 6
    # ... from its own state alone too (each rank reloads its own file), finished or not;
    # another rank's finished state still cannot tell this rank's count
    assert _point(_state(old[0], consumed=6), old[0]).start == 6
    assert _point(_state(old[1], consumed=7), old[1]).start == 7
    with pytest.raises(ConfigError, match="pass the list of all ranks' states"):
        _point(_state(old[0], consumed=6), old[1])


# --------------------------------------------------------------------------- pure planning


@st.composite
def elastic_cases(draw) -> dict:
    chunk = draw(st.integers(1, 60))
    pre = draw(st.integers(1, 6))
    return dict(
        n_obs=draw(st.integers(20, 2_500)),
        settings=PlanSettings(
            seed=draw(st.integers(0, 2**32)),
            chunk_size=chunk,
            preload_nchunks=pre,
            batch_size=draw(st.integers(1, chunk * pre)),
            shuffle=draw(st.booleans()),
            drop_last=draw(st.booleans()),
            enforce_equal_batches=draw(st.booleans()),
            shard=draw(st.sampled_from(["chunks", "contiguous"])),
        ),
        epoch=draw(st.integers(0, 5)),
        worlds=draw(st.lists(st.integers(1, 6), min_size=2, max_size=3)),
        fractions=draw(st.lists(st.floats(0, 1), min_size=12, max_size=12)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elastic_cases())
def test_remainder_plans_deliver_every_owed_row_exactly_once(case: dict) -> None:
    """Hop from world to world (2 or 3 runs of one epoch): every row delivered at most once,
    only rows the first plan owed, rows_done + delivered + rows_skipped == n_obs, and each
    hop leaves out fewer than world x batch_size rows (none without enforce/drop_last)."""
    s, n_obs, epoch, worlds = case["settings"], case["n_obs"], case["epoch"], case["worlds"]
    try:  # every world must be one whose epochs can be planned (else refused on resume)
        first = [
            s.plan(n_obs=n_obs, epoch=epoch, rank=r, world_size=worlds[0]) for r in range(worlds[0])
        ]
        for world in worlds[1:]:
            s.plan(n_obs=n_obs, epoch=epoch, rank=0, world_size=world)
    except ConfigError:
        assume(False)
    owed = cat(cat(plan_ids(p)) for p in first)
    history: tuple[Segment, ...] = ()
    delivered: list[np.ndarray] = []
    fractions = iter(case["fractions"])
    skipped = n_obs - len(owed)
    for k, world in enumerate(worlds):
        plans = [
            plan_resumed_epoch(
                s, n_obs=n_obs, epoch=epoch, history=history, rank=r, world_size=world
            )
            for r in range(world)
        ]
        counts = [p.n_batches for p in plans]
        got = batch_counts(s, n_obs=n_obs, epoch=epoch, world_size=world, history=history)
        assert got.tolist() == counts
        if s.enforce_equal_batches:
            assert len(set(counts)) == 1
        assert {p.rows_skipped for p in plans} == {plans[0].rows_skipped}
        assert plans[0].rows_done == sum(len(d) for d in delivered)
        assert plans[0].rows_done + sum(p.n_rows for p in plans) + plans[0].rows_skipped == n_obs
        extra, skipped = plans[0].rows_skipped - skipped, plans[0].rows_skipped
        if k > 0:  # rows this hop's split left out
            if (s.enforce_equal_batches and world > 1) or s.drop_last:
                assert 0 <= extra < world * s.batch_size
            else:
                assert extra == 0
        for p in plans:  # batches of batch_size (the last may be short), ranges inside chunks
            sizes = [len(b) for b in plan_ids(p)]
            assert all(n == s.batch_size for n in sizes[:-1]) and sum(sizes) == p.n_rows
            for w in p.windows():
                cs = s.chunk_size
                assert (w.row_ranges[:, 0] // cs == (w.row_ranges[:, 1] - 1) // cs).all()
        if k == len(worlds) - 1:
            delivered += [cat(plan_ids(p)) for p in plans]
            break
        if s.enforce_equal_batches:  # a DDP job stops every rank at the same step
            consumed = (min(int(next(fractions) * (counts[0] + 1)), counts[0]),) * world
        else:
            consumed = tuple(min(int(next(fractions) * (n + 1)), n) for n in counts)
        delivered += [cat(plan_ids(p, 0, c)) for p, c in zip(plans, consumed, strict=True)]
        history = (*history, Segment(world, consumed))
    everything = cat(delivered)
    assert len(np.unique(everything)) == len(everything), "a row was delivered twice"
    assert np.isin(everything, owed).all(), "a row the epoch skipped anyway was delivered"
    assert n_obs - len(everything) == skipped, "exact accounting"


def test_resume_same_world_is_the_plan_tail() -> None:
    s = sampler(3, 1)
    plan = s.plan_epoch(N_OBS, 4)
    point = _point(_state(s, epoch=4, consumed=5), s)
    assert (point.epoch, point.history, point.start) == (4, (), 5)
    again = plan_resumed_epoch(
        PlanSettings.of(s), n_obs=N_OBS, epoch=4, history=(), rank=1, world_size=3
    )
    assert again == plan == plan_epoch(n_obs=N_OBS, epoch=4, rank=1, world_size=3, seed=3, **CFG)


def test_a_restart_on_a_world_its_epochs_cannot_use_is_refused_at_load(tmp_path: Path) -> None:
    """A restart on more ranks than the dataset has chunks was accepted: the rest of the
    epoch ran, and the job failed at the next epoch. It is refused in load_state_dict."""
    data = tmp_path / "five.zarr"
    arr = zarr.create_array(data, shape=(5, 2), dtype="float32", chunks=(5, 2))
    arr[...] = np.arange(10, dtype=np.float32).reshape(5, 2)
    ds = dz.open_dataset(data)
    settings = {"chunk_size": 16, "preload_nchunks": 1, "batch_size": 1, "seed": 0}
    with dz.Loader(ds, dz.ChunkSampler(**settings)) as first:
        next(iter(first))
        state = first.state_dict()
    three = dz.DistributedSampler(dz.ChunkSampler(**settings), dist_info=lambda: (0, 3))
    refused = (
        r"cannot resume epoch 0 on 3 ranks: .*n_obs=5 with chunk_size=16 gives 1 chunk\(s\)"
        r".*Resume on at most 1 ranks"
    )
    with dz.Loader(ds, three) as again, pytest.raises(ConfigError, match=refused):
        again.load_state_dict(state)
    # the bound set by drop_last is named as such, not blamed on the chunks
    s = PlanSettings(
        seed=0, chunk_size=10, preload_nchunks=3, batch_size=30, shuffle=True, drop_last=True,
        enforce_equal_batches=False,
    )  # fmt: skip
    history = (Segment(2, (1, 1)),)
    with pytest.raises(
        ConfigError,
        match=r"on 4 ranks: .*at most 25 rows per rank.*drop_last=True.*at most 3 ranks",
    ):
        plan_resumed_epoch(s, n_obs=100, epoch=0, history=history, rank=0, world_size=4)


def test_len_inside_the_loop_of_a_resumed_epoch_counts_that_loop(store) -> None:
    """Before the loop len() is the batches still to come; once the loop had started it
    was the normal epoch's count (10 of which 7 remained; 6 for 3 ranks, of which the
    remainder plan has 4), so `i + 1 == len(loader)` never found the last batch."""
    states = []
    for r in range(2):
        ld = loader(store, sampler(2, r))
        take(ld, 0, stop=3)
        states.append(ld.state_dict())
        ld.close()
    for world, state in ((2, states[0]), (3, states)):
        ld = loader(store, sampler(world, 0))
        ld.load_state_dict(state)
        before, resumed = len(ld), ld.plan()
        inside = [(len(ld), ld.plan()) for _ in ld]
        assert before > 0 and inside == [(before, resumed)] * before, (world, before, inside)
        assert before == resumed.n_batches - (3 if world == 2 else 0)
        # once that loop is over, both tell of the next loop: the epoch's normal plan (the
        # plan stayed the remainder's while len() told of the next loop)
        assert len(ld) == ld.plan().n_batches == sampler(world, 0).num_batches(N_OBS)
        ld.close()


def test_a_loop_left_early_after_a_resume_warns_that_the_epoch_restarts(store, caplog) -> None:
    """A peek (one batch) after load_state_dict is a loop left early, and the next loop
    started the epoch afresh: the rows delivered before the saved state came again, with no
    word (README: a loop left early makes the next start its epoch afresh). It warns now,
    saying how to go on instead; and that advice resumes exactly. A loop left early in
    an epoch not resumed restarts it as before, silently."""
    import logging

    with loader(store, sampler()) as first:
        saves: dict[int, dict] = {}
        done = take(first, 0, stop=4, saves=saves)
        whole = take(first, 0)
    state = roundtrip(saves[4])
    with loader(store, sampler()) as ld:
        ld.load_state_dict(state)
        ld.set_epoch(0)
        peeked = next(iter(ld))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dali_zarr.loader"):
            again = take(ld, 0)
        said = [r.getMessage() for r in caplog.records if "from a loaded state" in r.getMessage()]
        assert said and "left after 1 batch(es)" in said[0], said
        assert ids(again) == ids(whole)  # afresh, as before
    with loader(store, sampler()) as ld:
        ld.load_state_dict(state)
        ld.set_epoch(0)
        next(iter(ld))
        after_peek = roundtrip(ld.state_dict())
    with loader(store, sampler()) as ld:  # the advice: go on from the peeked batch
        ld.load_state_dict(after_peek)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dali_zarr.loader"):
            rest = take(ld, 0)
            take(ld, 0, stop=1)  # left early, not resumed: restarts without a word
            take(ld, 0)
        assert not [r for r in caplog.records if "from a loaded state" in r.getMessage()]
    assert ids([*done, {"index": peeked["index"].numpy()}, *rest]) == ids(whole)


def ids(batches: list[dict[str, np.ndarray]]) -> list[int]:
    """The observation ids of ``batches``, in order."""
    return cat([b["index"] for b in batches]).tolist()
