"""Resuming an epoch part-way, on the same or on another number of ranks (pure functions).

A loader state is a small dict of plain Python values (:func:`make_state`): the epoch, the
batches this rank has handed out in it, the sampler settings, the rank and world size, and
a fingerprint of the dataset. Since a plan is a pure function of its inputs, that is all a
restarted job needs:

- **Same world size.** Rank ``r`` replans the epoch and starts at batch ``consumed``; the
  rest of the stream is identical, batch for batch, to the uninterrupted one, and windows
  before the resume point are never read.
- **Another world size** (elastic restart, ``W -> W'``). Every new rank replans, without
  communication, every old rank's epoch and removes the first ``consumed[r]`` batches of
  old rank ``r``: what is left (the rows the epoch had not yet delivered; rows the old plan
  skipped anyway stay skipped) is the *remainder* of the epoch. :func:`plan_remainder`
  splits it among the ``W'`` new ranks with the usual rules (equal batch counts, windows,
  in-window shuffles), so the epoch is finished exactly once across the new ranks; later
  epochs follow the normal plan for ``W'``. With ``enforce_equal_batches`` the split may
  leave fewer than ``W' * batch_size`` remainder rows undelivered: the remainder plan's
  ``rows_skipped`` counts them (together with the rows the old plan skipped), so that
  ``rows_done + sum(n_rows over new ranks) + rows_skipped == n_obs`` holds exactly.

An epoch may be resumed elastically more than once: the state keeps the earlier runs of the
epoch as a ``history`` of :class:`Segment` (world size and batches consumed per rank), and
the remainder of the remainder is planned the same way. A run that delivered nothing of the
epoch (saved before its first batch) is no segment: its split would only leave rows out.

**How many batches each old rank consumed.** :func:`resume_point` takes one state or the
list of all old ranks' states. A list gives every rank's exact count. A single state
(any rank's) is read as "every rank ran ``consumed`` steps in lockstep", each old rank having
delivered ``min(consumed, its batch count)``: exact whenever the ranks have equal batch
counts, which ``enforce_equal_batches=True`` (the default) guarantees and DDP needs. When the
counts differ and that single state cannot tell how far the other ranks got (its own rank
had finished its epoch), it is refused: pass the list of all states.

Cost of an elastic resume, once per restart: every old rank's plan (O(n_chunks) each) and
one window per old rank; a same-size resume costs one plan, like any epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dali_zarr.errors import ConfigError
from dali_zarr.planning.partition import (
    global_chunk_order,
    offsets_of,
    order_digest,
    rank_bounds,
    slice_ranges,
    validate_count,
    validate_int,
    validate_seed,
    validate_sizes,
    window_rows_of,
)
from dali_zarr.planning.plan import EpochPlan
from dali_zarr.planning.samplers import PlanSettings

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "ResumePoint",
    "Segment",
    "batch_counts",
    "dataset_fingerprint",
    "make_state",
    "plan_remainder",
    "plan_resumed_epoch",
    "remainder_ranges",
    "resume_point",
    "undelivered_ranges",
]

STATE_FORMAT = "dali_zarr.loader_state"
STATE_VERSION = 1

# Stream tag of the window shuffles of a remainder epoch: rng([seed, epoch, TAG, depth, rank,
# window]); next to the tags of partition.py, and fixed forever for the same reason.
TAG_RESUME_WINDOW = 3


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Segment:
    """An earlier, interrupted run of an epoch: its world size and the batches each of its
    ranks had delivered when it stopped."""

    world_size: int
    consumed: tuple[int, ...]

    def __post_init__(self) -> None:
        world = validate_count("history world_size", self.world_size)
        consumed = tuple(_non_negative("history consumed", c) for c in self.consumed)
        if len(consumed) != world:
            raise ConfigError(
                f"a history segment of world_size={world} must list {world} consumed counts, "
                f"got {len(consumed)}"
            )
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "consumed", consumed)

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "consumed": list(self.consumed)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Segment:
        try:
            return cls(int(d["world_size"]), tuple(int(c) for c in d["consumed"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed loader state: bad history entry {d!r} ({e})") from None


def _non_negative(name: str, value: object) -> int:
    return validate_int(name, value, low=0, what="a non-negative integer")


# --------------------------------------------------------------------------- remainders


def _runs(rows: np.ndarray, chunk_size: int) -> np.ndarray:
    """Sorted unique row ids -> ``(k, 2)`` ranges of consecutive ids, cut at chunk borders."""
    if rows.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(rows) != 1) | (rows[1:] % chunk_size == 0)) + 1
    starts = rows[np.concatenate(([0], breaks))]
    stops = rows[np.concatenate((breaks - 1, [rows.shape[0] - 1]))] + 1
    return np.stack([starts, stops], axis=1).astype(np.int64, copy=False)


def undelivered_ranges(plan: EpochPlan, consumed: int) -> np.ndarray:
    """Row ranges of ``plan`` not delivered by its first ``consumed`` batches.

    The untouched windows stay as they are (whole chunks, read order); the rest of a window
    cut mid-way is a scattered subset of it, given as runs of consecutive ids in id order.
    O(one window + ranges of the rank).
    """
    consumed = _non_negative("consumed", consumed)
    if consumed > plan.n_batches:
        raise ConfigError(
            f"consumed={consumed} batches but rank {plan.rank} of {plan.world_size} has only "
            f"{plan.n_batches} in epoch {plan.epoch}"
        )
    if consumed == plan.n_batches:
        return np.zeros((0, 2), dtype=np.int64)
    w, j = plan.window_of_batch(consumed)
    whole_from = w * plan.window_rows
    parts = []
    if j > 0:
        window = plan.window(w)
        rest = window.order[window.batch_offsets[j] :]
        parts.append(_runs(np.sort(window.global_rows()[rest]), plan.chunk_size))
        whole_from = min((w + 1) * plan.window_rows, plan.n_rows)
    tail, _ = slice_ranges(plan.row_ranges, plan.range_offsets, whole_from, plan.n_rows)
    parts.append(tail)
    return np.concatenate(parts).reshape(-1, 2)


def plan_remainder(
    row_ranges: np.ndarray,
    *,
    n_obs: int,
    epoch: int,
    rank: int,
    world_size: int,
    settings: PlanSettings,
    rows_done: int,
    depth: int = 1,
    offsets: np.ndarray | None = None,
) -> EpochPlan:
    """Plan ``rank``'s part of the rows in ``row_ranges`` (in that order) for one epoch.

    The sequence of rows is split into ``world_size`` contiguous pieces exactly like a normal
    epoch splits its shuffled chunk sequence (equal batch counts under
    ``enforce_equal_batches``, else whole shares, cut to full batches with ``drop_last``);
    windows and their shuffles are derived as usual, from a stream of their own (``depth``:
    how many times the epoch has been resumed on another world size). ``rows_done`` are the
    rows of the epoch delivered before (kept for the accounting of ``rows_skipped``).
    ``offsets``: ``offsets_of(row_ranges)`` where the caller has them (one pass for a world).
    """
    s = settings
    validate_sizes(
        chunk_size=s.chunk_size, preload_nchunks=s.preload_nchunks, batch_size=s.batch_size
    )
    world_size = validate_count("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    ranges = np.asarray(row_ranges, dtype=np.int64).reshape(-1, 2)
    if offsets is None:  # given where every rank of a world is planned from the same ranges
        offsets = offsets_of(ranges)
    n_rem = int(offsets[-1])
    delivered = s.rows_delivered(n_rem, world_size)
    n_rows = int(delivered[rank])
    lo = int(rank_bounds(n_rem, world_size)[rank])
    mine, mine_offsets = slice_ranges(ranges, offsets, lo, lo + n_rows)
    window_rows = window_rows_of(s.chunk_size, s.preload_nchunks, s.batch_size)
    return EpochPlan(
        epoch=int(epoch),
        rank=int(rank),
        world_size=world_size,
        n_obs=int(n_obs),
        batch_size=s.batch_size,
        seed=validate_seed(s.seed),
        n_batches=-(-n_rows // s.batch_size),
        n_windows=-(-n_rows // window_rows),
        n_rows=n_rows,
        rows_skipped=int(n_obs) - int(rows_done) - int(delivered.sum()),
        chunk_size=s.chunk_size,
        window_rows=window_rows,
        shuffle=s.shuffle,
        row_ranges=mine,
        range_offsets=mine_offsets,
        rows_done=int(rows_done),
        stream=(TAG_RESUME_WINDOW, int(depth)),
    )


def _segment_plans(
    settings: PlanSettings,
    *,
    n_obs: int,
    epoch: int,
    history: Sequence[Segment],
    k: int,
    ranges: np.ndarray | None,
    rows_done: int,
) -> list[EpochPlan]:
    """All ranks' plans of run ``k`` of the epoch (run 0: the normal plans)."""
    world = history[k].world_size
    if k == 0:
        return settings.plan_world(n_obs=n_obs, epoch=epoch, world_size=world)
    assert ranges is not None
    offsets = offsets_of(ranges)  # once, not once a rank
    return [
        plan_remainder(
            ranges,
            offsets=offsets,
            n_obs=n_obs,
            epoch=epoch,
            rank=r,
            world_size=world,
            settings=settings,
            rows_done=rows_done,
            depth=k,
        )
        for r in range(world)
    ]


def remainder_ranges(
    settings: PlanSettings, *, n_obs: int, epoch: int, history: Sequence[Segment]
) -> tuple[np.ndarray, int]:
    """Rows of ``epoch`` still to deliver after the interrupted runs in ``history``.

    Returns ``(row_ranges, rows_done)``: the undelivered rows, old rank by old rank in their
    read order, and how many rows the runs delivered. Rows a run's plan skipped are not in
    it (they were never due). Cached (read-only ranges): a resume asks for them to count
    every rank's batches and again to plan its own, and they cost a plan of every old rank.
    """
    if not history:
        raise ValueError("remainder_ranges needs at least one interrupted run")
    return _remainder_ranges(settings, int(n_obs), int(epoch), tuple(history))


@functools.lru_cache(maxsize=2)
def _remainder_ranges(
    settings: PlanSettings, n_obs: int, epoch: int, history: tuple[Segment, ...]
) -> tuple[np.ndarray, int]:
    ranges: np.ndarray | None = None
    rows_done = 0
    for k, segment in enumerate(history):
        plans = _segment_plans(
            settings,
            n_obs=n_obs,
            epoch=epoch,
            history=history,
            k=k,
            ranges=ranges,
            rows_done=rows_done,
        )
        parts = []
        for plan, consumed in zip(plans, segment.consumed, strict=True):
            parts.append(undelivered_ranges(plan, consumed))
            rows_done += min(consumed * plan.batch_size, plan.n_rows)
        ranges = np.concatenate(parts).reshape(-1, 2)
    assert ranges is not None
    ranges.flags.writeable = False
    return ranges, rows_done


def plan_resumed_epoch(
    settings: PlanSettings,
    *,
    n_obs: int,
    epoch: int,
    history: Sequence[Segment],
    rank: int,
    world_size: int,
) -> EpochPlan:
    """``rank``'s plan of ``epoch`` after the interrupted runs in ``history`` (none: the
    normal plan). Pure: every new rank gets its part without communication."""
    if not history:
        return settings.plan(n_obs=n_obs, epoch=epoch, rank=rank, world_size=world_size)
    # the remainder alone would spread over more ranks than the dataset has chunks, but the
    # next epoch could not: refuse such a world now, not an epoch into the restarted job
    try:
        settings.check_world(n_obs=n_obs, world_size=world_size)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot resume epoch {epoch} on {world_size} ranks: the epochs after this one "
            f"could not be planned ({exc}). Resume on at most "
            f"{settings.max_world(n_obs=n_obs)} ranks (a resume may change only the number "
            "of ranks)."
        ) from exc
    ranges, rows_done = remainder_ranges(settings, n_obs=n_obs, epoch=epoch, history=history)
    return plan_remainder(
        ranges,
        n_obs=n_obs,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        settings=settings,
        rows_done=rows_done,
        depth=len(history),
    )


def batch_counts(
    settings: PlanSettings,
    *,
    n_obs: int,
    epoch: int,
    world_size: int,
    history: Sequence[Segment] = (),
) -> np.ndarray:
    """``(world_size,)`` batches every rank yields in ``epoch`` (resumed after ``history``).

    Lets each rank check, locally, whether all ranks will run the same number of steps.
    """
    s = settings
    if history:
        ranges, _ = remainder_ranges(s, n_obs=n_obs, epoch=epoch, history=history)
        n = int((ranges[:, 1] - ranges[:, 0]).sum())
    else:
        s.plan(n_obs=n_obs, epoch=epoch, rank=0, world_size=world_size)  # validates
        n = int(n_obs)
    return s.batches(n, world_size)


# --------------------------------------------------------------------------- state dicts


def dataset_fingerprint(dataset: object) -> dict[str, Any]:
    """What identifies a dataset for resuming: name, size, feature shape, dtype, layout."""
    return {
        "name": str(dataset.name),  # type: ignore[attr-defined]
        "n_obs": int(dataset.n_obs),  # type: ignore[attr-defined]
        "feature_shape": [int(s) for s in dataset.feature_shape],  # type: ignore[attr-defined]
        "dtype": str(np.dtype(dataset.dtype)),  # type: ignore[attr-defined]
        "layout": str(getattr(dataset, "layout", "")),
    }


def make_state(
    *,
    settings: PlanSettings,
    dataset: Mapping[str, Any],
    epoch: int,
    consumed: int,
    n_batches: int,
    rank: int,
    world_size: int,
    history: Sequence[Segment] = (),
    **extra: Any,
) -> dict[str, Any]:
    """A loader state: plain Python values (plus whatever ``extra`` carries)."""
    order = epoch_order_digest(settings, n_obs=int(dataset["n_obs"]), epoch=int(epoch))
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "consumed": int(consumed),
        "n_batches": int(n_batches),
        "rank": int(rank),
        "world_size": int(world_size),
        "history": [seg.as_dict() for seg in history],
        "sampler": settings.as_dict(),
        "dataset": dict(dataset),
        "order": order,
        "numpy": np.__version__,
        **extra,
    }


@functools.lru_cache(maxsize=8)
def epoch_order_digest(settings: PlanSettings, *, n_obs: int, epoch: int) -> str:
    """:func:`order_digest` of ``epoch``'s global chunk order (cached: ``state_dict`` may be
    called every few steps). A run resumed under a NumPy that permutes otherwise would plan
    other batches and deliver rows twice or never."""
    n_chunks = -(-n_obs // settings.chunk_size)
    order = global_chunk_order(n_chunks, seed=settings.seed, epoch=epoch, shuffle=settings.shuffle)
    return order_digest([order])


@dataclass(frozen=True)
class ResumePoint:
    """Where this rank continues: the plan of (``epoch``, ``history``) from batch ``start``.

    ``own_state`` is the state this very rank saved (same world size and rank), if given;
    only that one may carry per-process extras such as a DALI pipeline checkpoint.
    """

    epoch: int
    history: tuple[Segment, ...]
    start: int
    own_state: Mapping[str, Any] | None = None


_REQUIRED = ("epoch", "consumed", "rank", "world_size", "history", "sampler", "dataset")


def _check_state(
    state: object, *, settings: PlanSettings, dataset: Mapping[str, Any], world_size: int
) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise ConfigError(
            f"a loader state is a dict from Loader.state_dict(), got {type(state).__name__}"
        )
    if state.get("format") != STATE_FORMAT:
        raise ConfigError(
            f"not a dali_zarr loader state (format={state.get('format')!r}, expected "
            f"{STATE_FORMAT!r}): pass the dict Loader.state_dict() returned"
        )
    if state.get("version") != STATE_VERSION:
        raise ConfigError(
            f"loader state version {state.get('version')!r} is not supported by this "
            f"dali_zarr (reads version {STATE_VERSION})"
        )
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ConfigError(f"malformed loader state: missing {', '.join(missing)}")
    # a raw TypeError from dict() here also escaped the Loader's exchange of refusals,
    # leaving the other ranks waiting for this one
    for key in ("dataset", "sampler"):
        if not isinstance(state[key], Mapping):
            raise ConfigError(
                f"malformed loader state: {key} must be a dict, got "
                f"{type(state[key]).__name__} {state[key]!r}"
            )
    diffs = []
    saved_ds = dict(state["dataset"])
    for key, now in dataset.items():
        if saved_ds.get(key) != now:
            diffs.append(f"dataset {key}: saved {saved_ds.get(key)!r}, now {now!r}")
    saved_s = dict(state["sampler"])
    for key, now in _compared_settings(settings, saved_s).items():
        if saved_s.get(key) != now:
            diffs.append(f"sampler {key}: saved {saved_s.get(key)!r}, now {now!r}")
    if diffs:
        hint = (
            " (build the ChunkSampler with seed=state['sampler']['seed'])"
            if any(d.startswith("sampler seed") for d in diffs)
            else ""
        )
        if any(d.startswith(("sampler enforce_equal_batches", "sampler shard")) for d in diffs):
            saved = (
                f"enforce_equal_batches={saved_s.get('enforce_equal_batches')!r}, "
                f"shard={saved_s.get('shard')!r}"
            )
            hint += (  # a plain ChunkSampler holds the defaults of these two
                ". A plain ChunkSampler (one rank) has enforce_equal_batches=True and "
                "shard='chunks'; to resume on one rank a state of other values, wrap it: "
                f"DistributedSampler(sampler, dist_info=lambda: (0, 1), {saved})"
                if world_size == 1
                else f". Build the DistributedSampler with {saved}"
            )
        raise ConfigError(
            "cannot resume from this loader state, it was saved for another dataset or other "
            "sampler settings: " + "; ".join(diffs) + ". Resume with the same dataset and "
            "sampler settings (only the number of ranks may change)" + hint
        )
    # validated first, so that every epoch (a NumPy integer's too) has its digest checked
    epoch = _non_negative("epoch", state["epoch"])
    if "order" in state:  # states of 2026-11-25 on
        here = epoch_order_digest(settings, n_obs=int(dataset["n_obs"]), epoch=epoch)
        then = state.get("numpy")
        if state["order"] != here and then == np.__version__:
            raise ConfigError(
                "cannot resume: the state's chunk order digest does not match its epoch and "
                "sampler settings; it was edited, or saved by another dali_zarr. Pass the "
                "dict Loader.state_dict() returned, unchanged."
            )
        if state["order"] != here:  # the same state, another NumPy
            raise ConfigError(
                f"cannot resume: epoch {epoch}'s chunk order computed here differs from the "
                f"one the saving run used (NumPy {then} then, {np.__version__} now: its "
                "permutation stream changed), so the resumed epoch would deliver rows twice "
                "or not at all. Resume with the NumPy version that saved the state, or leave "
                f"the state out and run epoch {epoch} from its start "
                f"(loader.set_epoch({epoch}))."
            )
    return state


def _compared_settings(settings: PlanSettings, saved: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a state must match: all but the seed where neither run shuffles. The
    seed then orders nothing (the plans are the same under any seed), so ranks may hold
    different ones (the samplers' exchange lets them) and a restart may draw another:
    comparing it refused every resume of such a run."""
    now = settings.as_dict()
    if now["shuffle"] is False and saved.get("shuffle") is False:
        del now["seed"]
    return now


def steps_must_agree(settings: PlanSettings, counts: np.ndarray) -> bool:
    """Whether the ranks must have as many batches left in a resumed epoch whose ranks
    plan ``counts`` batches: always with equal batches, and also without them wherever the
    counts are equal (the epoch then runs under DDP, and ranks resumed from other steps
    would deliver rows twice and wait forever on the last step)."""
    return settings.enforce_equal_batches or bool((counts == counts[0]).all())


def resume_point(
    states: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    settings: PlanSettings,
    dataset: Mapping[str, Any],
    rank: int,
    world_size: int,
) -> ResumePoint:
    """Where ``rank`` of ``world_size`` continues after the run that saved ``states``.

    ``states``: one loader state (this rank's, or any old rank's) or the list of all old
    ranks' states. Refuses states of another dataset, other sampler settings or a malformed
    or inconsistent set with a ConfigError that says what differs.
    """
    many = not isinstance(states, Mapping)
    if many and (isinstance(states, str | bytes) or not isinstance(states, Sequence)):
        raise ConfigError(  # None failed with "'NoneType' object is not iterable"
            f"load_state_dict takes a dict from Loader.state_dict() (or the list of every "
            f"rank's), got {type(states).__name__}"
        )
    group = list(states) if many else [states]  # type: ignore[list-item]
    if not group:
        raise ConfigError("load_state_dict got an empty list of states")
    group = [
        _check_state(s, settings=settings, dataset=dataset, world_size=world_size) for s in group
    ]
    first = group[0]
    try:
        epoch = _non_negative("epoch", first["epoch"])
        old_world = validate_count("world_size", first["world_size"])
        history = tuple(Segment.from_dict(d) for d in first["history"])
        for s in group:
            if (
                s["epoch"] != first["epoch"]
                or s["world_size"] != first["world_size"]
                or list(s["history"]) != list(first["history"])
            ):
                raise ConfigError(
                    "the loader states do not belong to one run: epochs "
                    f"{sorted({s['epoch'] for s in group})}, world sizes "
                    f"{sorted({s['world_size'] for s in group})} (or different histories)"
                )
            if not 0 <= s["rank"] < old_world:
                raise ConfigError(f"state of rank {s['rank']} in a world of {old_world}")
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"malformed loader state: {e}") from None

    n_obs = int(dataset["n_obs"])
    counts = batch_counts(settings, n_obs=n_obs, epoch=epoch, world_size=old_world, history=history)
    if many and len(group) > 1:
        ranks = sorted(int(s["rank"]) for s in group)
        if ranks != list(range(old_world)):
            raise ConfigError(
                f"a list of loader states must hold one state per rank of the run that saved "
                f"them (ranks 0..{old_world - 1}), got ranks {ranks}; or pass a single state"
            )
        consumed = [0] * old_world
        for s in group:
            consumed[int(s["rank"])] = _non_negative("consumed", s["consumed"])
        by_rank = {int(s["rank"]): s for s in group}
    else:
        s = group[0]
        r0, c = int(s["rank"]), _non_negative("consumed", s["consumed"])
        if c > counts[r0]:
            raise ConfigError(
                f"state says rank {r0} consumed {c} batches of epoch {epoch} but its plan has "
                f"{int(counts[r0])}: the state does not match this dataset and settings"
            )
        if world_size == old_world and rank == r0:  # its own state: nothing to guess
            return ResumePoint(epoch, history, c, s)
        if c == counts[r0] and (counts > c).any():
            raise ConfigError(
                f"ranks of the saved run have different batch counts {counts.tolist()} and "
                f"rank {r0} had finished its epoch, so one state cannot tell how far the "
                "others got: pass the list of all ranks' states to load_state_dict"
            )
        consumed = [min(c, int(n)) for n in counts]
        consumed[r0] = c
        by_rank = {r0: s}
    for r, (c, n) in enumerate(zip(consumed, counts, strict=True)):
        if c > n:
            raise ConfigError(
                f"state of rank {r} says {c} batches consumed in epoch {epoch}, but its plan "
                f"has {int(n)}: the state does not match this dataset and settings"
            )
    if world_size == old_world:
        left = [int(n) - c for c, n in zip(consumed, counts, strict=True)]
        if len(by_rank) > 1 and steps_must_agree(settings, counts) and len(set(left)) > 1:
            # the ranks' exchange refuses this where there is one (Loader.load_state_dict);
            # without a process group nothing did, and DDP waited forever on the last step
            raise ConfigError(
                f"the loader states were saved after different steps of epoch {epoch} "
                f"(batches consumed {consumed}), so the ranks would have {left} batches left "
                "and DDP would wait forever on the last step; save every rank's state after "
                "the same step (Loader.state_dict() on every rank at once)"
            )
        return ResumePoint(epoch, history, consumed[rank], by_rank.get(rank))
    if not any(consumed):
        # the run delivered nothing of the epoch (saved before its first step): as a segment
        # its split would only leave rows out, and the new world would not run the epoch's
        # normal plan after a checkpoint taken at its start
        return ResumePoint(epoch, history, 0, None)
    return ResumePoint(epoch, (*history, Segment(old_world, tuple(consumed))), 0, None)
