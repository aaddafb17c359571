"""Samplers: the user-facing settings objects that turn (n_obs, epoch) into an EpochPlan.

The classes only validate and hold settings (and, for DistributedSampler, discover the rank
and agree on a seed once, at construction). The plan itself comes from the pure function
:func:`plan_epoch`, so it depends on nothing but its arguments: every rank, worker or
resumed run that calls it with the same inputs gets the same plan.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dali_zarr.distributed import (
    DistInfo,
    Exchange,
    agree_or_raise,
    broadcast_seed,
    exchange_of_initialized,
    exchange_over,
    resolve_rank_world,
    torch_dist_initialized,
)
from dali_zarr.errors import ConfigError
from dali_zarr.planning.partition import (
    SEED_LIMIT,
    SHARD_MODES,
    Shard,
    contiguous_shard,
    global_chunk_order,
    n_chunks_of,
    rank_bounds,
    rows_delivered,
    short_chunk_position,
    slice_ranges,
    validate_flag,
    validate_plan_inputs,
    validate_seed,
    validate_sizes,
    virtual_shard,
    window_rows_of,
)
from dali_zarr.planning.plan import EpochPlan

__all__ = ["ChunkSampler", "DistributedSampler", "PlanSettings", "plan_epoch"]


def _check_shard(shard: object) -> None:
    if shard not in SHARD_MODES:
        raise ConfigError(
            f'unknown shard {shard!r}: use shard="chunks" (default; a fresh global shuffle of '
            'chunks is split among ranks every epoch) or shard="contiguous" (each rank keeps '
            "the same contiguous rows every epoch)"
        )


def plan_epoch(
    *,
    n_obs: int,
    epoch: int,
    seed: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
    enforce_equal_batches: bool = True,
    shard: Shard = "chunks",
) -> EpochPlan:
    """Plan one epoch for one rank: a pure function of its arguments.

    Cost: O(n_chunks) numpy work (global chunk permutation and offsets) for shard="chunks",
    O(chunks of the rank) for shard="contiguous"; windows are planned lazily by
    :meth:`EpochPlan.window`.
    """
    settings = PlanSettings(
        seed=seed,
        chunk_size=chunk_size,
        preload_nchunks=preload_nchunks,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        enforce_equal_batches=enforce_equal_batches,
        shard=shard,
    )
    (plan,) = _plan_ranks(settings, ranks=(rank,), n_obs=n_obs, epoch=epoch, world_size=world_size)
    return plan


def _plan_ranks(
    settings: PlanSettings, *, ranks: Sequence[int], n_obs: int, epoch: int, world_size: int
) -> list[EpochPlan]:
    """:func:`plan_epoch` of each of ``ranks`` (of one world): the global chunk order is drawn
    once and each rank's slice of it costs only its own chunks. An elastic resume plans every
    rank of the interrupted world; one order per rank made that O(world × n_chunks)."""
    seed, chunk_size, preload_nchunks = settings.seed, settings.chunk_size, settings.preload_nchunks
    batch_size, shuffle, drop_last = settings.batch_size, settings.shuffle, settings.drop_last
    enforce_equal_batches, shard = settings.enforce_equal_batches, settings.shard
    validate_sizes(chunk_size=chunk_size, preload_nchunks=preload_nchunks, batch_size=batch_size)
    seed = validate_seed(seed)
    _check_shard(shard)
    for name, flag in (
        ("shuffle", shuffle),
        ("drop_last", drop_last),
        ("enforce_equal_batches", enforce_equal_batches),
    ):
        validate_flag(name, flag)
    for rank in ranks:
        validate_plan_inputs(
            n_obs=n_obs,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            chunk_size=chunk_size,
            batch_size=batch_size,
            enforce_equal_batches=enforce_equal_batches,
            drop_last=drop_last,
        )
    n_obs, epoch, world_size = int(n_obs), int(epoch), int(world_size)

    delivered = rows_delivered(
        n_obs,
        world_size,
        batch_size,
        enforce_equal_batches=enforce_equal_batches,
        drop_last=drop_last,
    )
    bounds = rank_bounds(n_obs, world_size)
    window_rows = window_rows_of(chunk_size, preload_nchunks, batch_size)
    if shard == "chunks":
        order = global_chunk_order(
            n_chunks_of(n_obs, chunk_size), seed=seed, epoch=epoch, shuffle=shuffle
        )
        short_at = short_chunk_position(order, chunk_size=chunk_size, n_obs=n_obs)
    plans = []
    for rank in (int(r) for r in ranks):
        n_rows = int(delivered[rank])
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        if shard == "chunks":
            # The rank's share is [lo, hi) of the virtual sequence; rows past lo + n_rows are
            # never delivered, so they are cut before windowing and never read.
            ranges, offsets = virtual_shard(
                order,
                chunk_size=chunk_size,
                n_obs=n_obs,
                lo=lo,
                hi=lo + n_rows,
                short_at=short_at,
            )
        else:
            ranges, offsets = contiguous_shard(
                chunk_size=chunk_size,
                lo=lo,
                hi=hi,
                seed=seed,
                epoch=epoch,
                rank=rank,
                shuffle=shuffle,
            )
            ranges, offsets = slice_ranges(ranges, offsets, 0, n_rows)
        plans.append(
            EpochPlan(
                epoch=epoch,
                rank=rank,
                world_size=world_size,
                n_obs=n_obs,
                batch_size=batch_size,
                seed=seed,
                n_batches=-(-n_rows // batch_size),
                n_windows=-(-n_rows // window_rows),
                n_rows=n_rows,
                rows_skipped=n_obs - int(delivered.sum()),
                chunk_size=chunk_size,
                window_rows=window_rows,
                shuffle=shuffle,
                row_ranges=ranges,
                range_offsets=offsets,
            )
        )
    return plans


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Everything besides (n_obs, epoch, rank, world_size) that a plan depends on: what a
    sampler holds, as plain Python values (a state dict stores them as JSON and compares
    them on resume). A ChunkSampler is one rank of one, where ``enforce_equal_batches`` and
    ``shard`` change nothing."""

    seed: int
    chunk_size: int
    preload_nchunks: int
    batch_size: int
    shuffle: bool
    drop_last: bool
    enforce_equal_batches: bool = True
    shard: Shard = "chunks"

    @classmethod
    def of(cls, sampler: object) -> PlanSettings:
        """The settings of a ChunkSampler or DistributedSampler."""
        settings = getattr(sampler, "settings", None)
        if not isinstance(settings, cls):
            raise ConfigError(
                f"saving or resuming loader state needs a ChunkSampler or DistributedSampler, "
                f"got {type(sampler).__name__}"
            )
        return settings

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def batches_per_rank(self, *, n_obs: int, world_size: int) -> np.ndarray:
        """``(world_size,)`` batches each rank yields per epoch (the same every epoch),
        without planning one."""
        self.check_world(n_obs=n_obs, world_size=world_size)
        return self.batches(n_obs, world_size)

    def check_world(self, *, n_obs: int, world_size: int) -> None:
        """Refuse ``world_size`` ranks where this dataset cannot give each a chunk (and,
        with equal batches, a batch), as planning an epoch would."""
        validate_plan_inputs(
            n_obs=n_obs,
            epoch=0,
            rank=0,
            world_size=world_size,
            chunk_size=self.chunk_size,
            batch_size=self.batch_size,
            enforce_equal_batches=self.enforce_equal_batches,
            drop_last=self.drop_last,
        )

    def max_world(self, *, n_obs: int) -> int:
        """The most ranks an epoch of ``n_obs`` rows can be planned on (:meth:`check_world`):
        a chunk each and, with equal batches, a full batch each; with ``drop_last``, a full
        batch for the largest share. 1 where no world can (then every world is refused)."""
        n_obs = int(n_obs)  # a NumPy uint64 would wrap below
        most = n_chunks_of(n_obs, self.chunk_size)
        if self.enforce_equal_batches:
            most = min(most, n_obs // self.batch_size)
        if self.drop_last and self.batch_size > 1:  # ceil(n_obs / world) >= batch_size
            most = min(most, (n_obs - 1) // (self.batch_size - 1))
        return max(1, most)

    def rows_delivered(self, n_rows: int, world_size: int) -> np.ndarray:
        """``(world_size,)`` rows each rank delivers out of ``n_rows`` (not validated)."""
        return rows_delivered(
            int(n_rows),
            int(world_size),
            self.batch_size,
            enforce_equal_batches=self.enforce_equal_batches,
            drop_last=self.drop_last,
        )

    def batches(self, n_rows: int, world_size: int) -> np.ndarray:
        """``(world_size,)`` batches each rank yields out of ``n_rows`` (not validated)."""
        return -(-self.rows_delivered(n_rows, world_size) // self.batch_size)

    def plan(self, *, n_obs: int, epoch: int, rank: int, world_size: int) -> EpochPlan:
        """The normal (not resumed) plan of ``epoch`` for ``rank`` of ``world_size``."""
        return plan_epoch(
            n_obs=n_obs,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            **self.as_dict(),
        )

    def plan_world(self, *, n_obs: int, epoch: int, world_size: int) -> list[EpochPlan]:
        """The normal plans of ``epoch`` for every rank of ``world_size`` (one global order)."""
        return _plan_ranks(
            self, ranks=range(world_size), n_obs=n_obs, epoch=epoch, world_size=world_size
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkSampler:
    """Single-process sampler (rank 0 of 1): reads whole chunks, shuffles inside windows.

    Reading ``preload_nchunks`` chunks at a time and shuffling their rows gives near-random
    batches while every read stays a sequential chunk read. ``seed=None`` draws a random
    seed once, at construction; ``seed`` then holds the drawn int (log it to reproduce a run).
    Wrapped in a :class:`DistributedSampler`, every rank draws its own and rank 0's is
    broadcast: log ``DistributedSampler.seed`` (or a loader state's ``sampler.seed``) then.
    """

    chunk_size: int
    preload_nchunks: int
    batch_size: int
    shuffle: bool = True
    drop_last: bool = False
    seed: int | None = 0
    seed_was_drawn: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        sizes = validate_sizes(
            chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks,
            batch_size=self.batch_size,
        )
        for name, value in zip(("chunk_size", "preload_nchunks", "batch_size"), sizes, strict=True):
            object.__setattr__(self, name, value)  # Python ints: NumPy int32 products wrap
        validate_flag("shuffle", self.shuffle)
        validate_flag("drop_last", self.drop_last)
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbits(63))
            object.__setattr__(self, "seed_was_drawn", True)
        else:
            object.__setattr__(self, "seed", validate_seed(self.seed))
        assert 0 <= self.seed < SEED_LIMIT  # type: ignore[operator]

    @property
    def rank(self) -> int:
        """Always 0: a ChunkSampler is the whole world."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1; wrap in DistributedSampler for several ranks."""
        return 1

    @property
    def window_rows(self) -> int:
        """Rows per window (a multiple of batch_size)."""
        return window_rows_of(self.chunk_size, self.preload_nchunks, self.batch_size)

    @property
    def settings(self) -> PlanSettings:
        return PlanSettings(
            seed=int(self.seed),  # type: ignore[arg-type]
            chunk_size=int(self.chunk_size),
            preload_nchunks=int(self.preload_nchunks),
            batch_size=int(self.batch_size),
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def plan_epoch(self, n_obs: int, epoch: int) -> EpochPlan:
        """The plan of ``epoch`` over ``n_obs`` observations (every row exactly once unless
        ``drop_last``)."""
        return self.settings.plan(n_obs=n_obs, epoch=epoch, rank=0, world_size=1)

    def num_batches(self, n_obs: int) -> int:
        """Batches per epoch (the same for every epoch), without planning one."""
        return int(self.settings.batches_per_rank(n_obs=n_obs, world_size=1)[0])


class DistributedSampler:
    """Splits a ChunkSampler's epochs among ranks, with no communication per epoch.

    Rank and world size are resolved once, here (``dist_info``: "torch", "jax", "env" or a
    callable returning ``(rank, world_size)``). All ranks derive the same global chunk order
    from the shared seed. If the wrapped sampler drew its seed (``seed=None``), rank 0's seed
    is taken by every rank, through torch.distributed or jax.distributed; without either and
    with more than one rank that is impossible (ranks could not agree), so it is refused:
    pass an explicit seed.

    ``enforce_equal_batches`` (default) makes every rank yield the same number of full
    batches, so DDP's collectives never wait on a rank that has run out of data.

    Where the ranks are torch.distributed's own or JAX's processes (initialized, with this
    rank and world size), construction exchanges the settings once and refuses, on every
    rank, ranks that disagree (``seed=rank``, another batch size): they would not split one
    plan. ``exchange`` says over whose processes that ran ("torch", "jax"; None: not
    checked); a :class:`~dali_zarr.Loader` then checks its dataset and resumed position the
    same way. Every rank must construct it then.
    """

    __slots__ = (
        "_enforce",
        "_exchange",
        "_from_env",
        "_rank",
        "_sampler",
        "_seed",
        "_shard",
        "_world_size",
    )

    def __init__(
        self,
        sampler: ChunkSampler,
        *,
        dist_info: DistInfo = "torch",
        enforce_equal_batches: bool = True,
        shard: Shard = "chunks",
    ) -> None:
        refused: Exception | None = None
        try:  # a refusal on one rank must still reach the exchange (the others wait in it)
            if not isinstance(sampler, ChunkSampler):
                raise ConfigError(
                    f"DistributedSampler wraps a ChunkSampler, got {type(sampler).__name__}: "
                    "build ChunkSampler(chunk_size=..., preload_nchunks=..., batch_size=...) "
                    "first"
                )
            _check_shard(shard)
            validate_flag("enforce_equal_batches", enforce_equal_batches)
        except Exception as exc:
            refused = exc
        try:
            rank, world_size = resolve_rank_world(dist_info)
        except ConfigError as exc:  # the ranks that resolved theirs wait in the exchange
            if not callable(dist_info):  # a callable's ranks may be a group of the world's
                _refuse_on_every_rank(exc)
            raise
        over = exchange_over(rank, world_size, dist_info=dist_info)
        if over is not None:
            seed = _agreed_seed(
                sampler,
                over=over,
                enforce_equal_batches=enforce_equal_batches,
                shard=shard,
                refused=refused,
            )
        elif refused is not None:
            raise refused
        elif not sampler.seed_was_drawn or world_size == 1:
            seed = sampler.seed  # type: ignore[assignment]
        else:
            if not torch_dist_initialized():
                raise ConfigError(
                    f"seed=None with world_size={world_size}, and these ranks are not an "
                    "initialized torch.distributed's (or, with the rank checks on, JAX's): the "
                    "ranks would each draw a different seed and disagree on the chunk order; "
                    "pass an explicit seed to ChunkSampler (the same on every rank), or call "
                    "torch.distributed.init_process_group(...) (jax.distributed.initialize() "
                    "with dist_info='jax') first so that rank 0's seed is taken"
                )
            seed = broadcast_seed(sampler.seed)  # type: ignore[arg-type]
        object.__setattr__(self, "_sampler", sampler)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_world_size", world_size)
        object.__setattr__(self, "_seed", validate_seed(seed))
        object.__setattr__(self, "_enforce", enforce_equal_batches)
        object.__setattr__(self, "_shard", shard)
        object.__setattr__(self, "_exchange", over)
        object.__setattr__(self, "_from_env", isinstance(dist_info, str) and dist_info == "env")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"DistributedSampler is immutable; build a new one to change {name}")

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # pickling (e.g. to DALI worker processes) must not re-resolve the rank or re-draw
        # the seed: restore the resolved values as they are
        return (
            _restore_distributed,
            (
                self._sampler,
                self._rank,
                self._world_size,
                self._seed,
                self._enforce,
                self._shard,
                self._exchange,
                self._from_env,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"DistributedSampler({self._sampler!r}, rank={self._rank}, "
            f"world_size={self._world_size}, seed={self._seed}, "
            f"enforce_equal_batches={self._enforce}, shard={self._shard!r})"
        )

    sampler = property(lambda self: self._sampler, doc="The wrapped ChunkSampler.")
    rank = property(lambda self: self._rank, doc="This process's rank.")
    world_size = property(lambda self: self._world_size, doc="Number of ranks.")
    seed = property(lambda self: self._seed, doc="The seed all ranks share (resolved int).")
    enforce_equal_batches = property(lambda self: self._enforce, doc="Equal batches per rank.")
    shard = property(lambda self: self._shard, doc='"chunks" or "contiguous".')
    exchange = property(
        lambda self: self._exchange,
        doc='Whose processes the ranks\' settings were exchanged over ("torch", "jax"), and '
        "agreed; None where they were not checked.",
    )
    from_env = property(
        lambda self: self._from_env,
        doc='Rank and world size came from launcher variables (dist_info="env").',
    )
    ranks_checked = property(
        lambda self: self._exchange is not None, doc="The ranks' settings were exchanged and agree."
    )
    batch_size = property(lambda self: self._sampler.batch_size, doc="Rows per batch.")
    chunk_size = property(lambda self: self._sampler.chunk_size, doc="Rows per chunk.")
    preload_nchunks = property(lambda self: self._sampler.preload_nchunks, doc="Chunks/window.")
    shuffle = property(lambda self: self._sampler.shuffle, doc="Shuffle chunks and windows.")
    drop_last = property(lambda self: self._sampler.drop_last, doc="Drop a partial last batch.")
    window_rows = property(lambda self: self._sampler.window_rows, doc="Rows per window.")

    @property
    def settings(self) -> PlanSettings:
        return dataclasses.replace(
            self._sampler.settings,
            seed=self._seed,
            enforce_equal_batches=self._enforce,
            shard=self._shard,
        )

    def plan_epoch(self, n_obs: int, epoch: int) -> EpochPlan:
        """This rank's plan of ``epoch``; the same on every call, process and restart."""
        return self.settings.plan(
            n_obs=n_obs, epoch=epoch, rank=self._rank, world_size=self._world_size
        )

    def num_batches(self, n_obs: int) -> int:
        """This rank's batches per epoch (the same for every epoch), without planning one."""
        counts = self.settings.batches_per_rank(n_obs=n_obs, world_size=self._world_size)
        return int(counts[self._rank])


#: what to change where the ranks' seeds differ, before the alternative of a drawn seed
SAME_SEED_HINT = (
    "pass the same seed on every rank (not seed + rank; the ranks' shards come from one "
    "shared order)"
)
#: what to change where the ranks' sampler settings differ
SETTINGS_HINTS = {"seed": f"{SAME_SEED_HINT}, or seed=None on every rank to use rank 0's draw"}


def compared_settings(settings: PlanSettings) -> dict[str, object]:
    """What the ranks' plans depend on, to compare between ranks: every field, the seed
    only where it orders something (with ``shuffle=False`` any per-rank seed is harmless)."""
    compared: dict[str, object] = settings.as_dict()
    if not settings.shuffle:
        compared["seed"] = "unused (shuffle=False)"
    return compared


def _agreed_seed(
    sampler: ChunkSampler,
    *,
    over: Exchange,
    enforce_equal_batches: bool,
    shard: Shard,
    refused: Exception | None,
) -> int:
    """Exchange the ranks' settings (one collective) and refuse any that differ, or every
    rank where one was ``refused`` by its own checks; the seed all ranks use: rank 0's
    where the seeds were drawn (``seed=None``)."""
    mine: dict[str, object] = {}
    if refused is None:
        settings = compared_settings(
            dataclasses.replace(
                sampler.settings, enforce_equal_batches=enforce_equal_batches, shard=shard
            )
        )
        if sampler.shuffle and sampler.seed_was_drawn:  # differs by design; rank 0's is taken
            settings["seed"] = None
        mine = {**settings, "drawn seed": sampler.seed if sampler.seed_was_drawn else None}
    rows = agree_or_raise(
        mine,
        over=over,
        local_error=refused,
        what="DistributedSampler",
        hints=SETTINGS_HINTS,
        not_compared=("drawn seed",),
    )
    drawn = rows[0]["drawn seed"]  # None where rank 0 chose (possible with shuffle=False)
    return int(drawn if sampler.seed_was_drawn and drawn is not None else sampler.seed)


def _refuse_on_every_rank(refused: ConfigError) -> None:
    """A rank whose own rank or world size was refused (a stale launcher variable on its
    node) still takes part in the exchange of an initialized torch.distributed or
    jax.distributed of several, so that the ranks that resolved theirs raise too instead
    of waiting for it; the others' error names this rank."""
    over = exchange_of_initialized()
    if over is not None:
        agree_or_raise({}, over=over, local_error=refused, what="DistributedSampler")


def _restore_distributed(
    sampler: ChunkSampler,
    rank: int,
    world_size: int,
    seed: int,
    enforce: bool,
    shard: Shard,
    exchange: Exchange | bool | None = None,
    from_env: bool = False,
) -> DistributedSampler:
    if isinstance(exchange, bool):  # pickled before 2026-11-25 (d): a flag, torch's if set
        exchange = "torch" if exchange else None
    obj = object.__new__(DistributedSampler)
    for name, value in (
        ("_sampler", sampler),
        ("_rank", rank),
        ("_world_size", world_size),
        ("_seed", seed),
        ("_enforce", enforce),
        ("_shard", shard),
        ("_exchange", exchange),
        ("_from_env", from_env),
    ):
        object.__setattr__(obj, name, value)
    return obj
