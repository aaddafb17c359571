"""Pure planning layer: which rows each rank reads, in which windows and batches, per epoch.

No I/O and no communication happen here (except rank discovery and seed agreement at
DistributedSampler construction, delegated to :mod:`dali_zarr.distributed`): a plan is a
pure function of (seed, epoch, n_obs, rank, world_size, settings).
"""

from dali_zarr.planning.partition import ranges_to_rows, rows_delivered, window_rows_of
from dali_zarr.planning.plan import EpochPlan, WindowPlan, iter_batches
from dali_zarr.planning.resume import (
    ResumePoint,
    Segment,
    batch_counts,
    plan_remainder,
    plan_resumed_epoch,
)
from dali_zarr.planning.samplers import ChunkSampler, DistributedSampler, PlanSettings, plan_epoch

__all__ = [
    "ChunkSampler",
    "DistributedSampler",
    "EpochPlan",
    "PlanSettings",
    "ResumePoint",
    "Segment",
    "WindowPlan",
    "batch_counts",
    "iter_batches",
    "plan_epoch",
    "plan_remainder",
    "plan_resumed_epoch",
    "ranges_to_rows",
    "rows_delivered",
    "window_rows_of",
]
