"""PyTorch adapter: a DALI pipeline per process, iterated as dicts of torch tensors.

The loader owns the moving parts (thread pools, the DALI pipeline, the epoch counter);
planning lives in :mod:`dali_zarr.planning`, reading in :mod:`dali_zarr.io` and
:mod:`dali_zarr.data`, the graph in :mod:`dali_zarr.graph`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from dali_zarr.data.dataset import Dataset
from dali_zarr.distributed import (
    Exchange,
    agree_or_raise,
    collectives_may_hang,
    exchange_of_initialized,
    exchange_over,
    initialized_worlds,
    refuse_another_world,
    world_is,
)
from dali_zarr.errors import ConfigError
from dali_zarr.graph.iterator import DaliEpochIterator
from dali_zarr.graph.pipeline import Transform, build_pipeline, output_dtype_name
from dali_zarr.graph.source import BatchSource, Output, Planner, obs_list
from dali_zarr.planning import EpochPlan
from dali_zarr.planning.partition import validate_count, validate_flag, validate_int
from dali_zarr.planning.resume import (
    PlanSettings,
    ResumePoint,
    Segment,
    batch_counts,
    dataset_fingerprint,
    make_state,
    resume_point,
    steps_must_agree,
)
from dali_zarr.planning.samplers import SAME_SEED_HINT, DistributedSampler, compared_settings

log = logging.getLogger(__name__)

Device = Literal["cpu", "gpu", "auto"]

#: The most DALI worker threads a Loader asks for: far past what a node's cores use, and
#: refused by name here, where DALI would abort the whole process (100,000 did).
MAX_THREADS = 1024


def _warn_every_rank_reads_everything(dataset: object) -> None:
    """A plain ChunkSampler where torch.distributed or JAX runs several processes: every
    rank reads every row (right for an evaluation every rank runs whole, or one rank runs
    alone; for training each rank then sees the same epoch, unsaid)."""
    for who, _, world in initialized_worlds():
        if world > 1:
            warnings.warn(
                f"{getattr(dataset, 'name', dataset)}: the sampler is a ChunkSampler while "
                f"{who} runs {world} processes, so every rank reads every row. To give each "
                "rank its own share, wrap it: dz.DistributedSampler(sampler, "
                f"dist_info={who!r}); an evaluation every rank runs whole can ignore this.",
                stacklevel=3,
            )
            return


class Loader:
    """Iterate one rank's minibatches of ``dataset`` as ``dict[str, torch.Tensor]``.

    ``batch["X"]`` is ``[B, *features]`` (``dtype``, float32 by default) or, with
    ``output="csr"``, a ``torch.sparse_csr_tensor``; every name in ``obs`` gives ``[B]``
    (categorical codes as int64, -1 for a missing value; numeric columns in their dtype,
    float16 as float32), or ``[B, ...]`` for an ``obsm/<key>`` entry; ``return_index=True`` adds
    ``batch["index"]``, the global observation ids. Call :meth:`set_epoch` before each epoch
    to reshuffle, as with torch's ``DistributedSampler``.

    **Device.** ``device="cpu"`` runs a DALI CPU pipeline; ``"gpu"`` reads, decodes, shuffles
    and densifies on GPU ``device_id`` (default: the rank on its node, torchrun's
    ``LOCAL_RANK`` or srun's ``SLURM_LOCALID``, see ``gpu_pipeline.default_device_id``) and
    yields CUDA tensors there (see :mod:`dali_zarr.graph.gpu_pipeline`); ``"auto"`` takes the
    GPU when it is usable. :attr:`device` and :attr:`device_reason` say which path runs and why.
    ``gpu_backend=HostBackend()`` (:mod:`dali_zarr.graph.window_backends`) runs the GPU
    path's source and graph on the host (for debugging and CI; no GPU needed).
    ``dtype``: float32, float16, float64 or bfloat16.
    ``read_threads``: windows read at once (default 1 on the CPU path, whose reader is
    parallel inside a window already, and 4 on the GPU path, where one window's file reads
    overlap another's nvCOMP decode; the GPU path reads at least that many windows ahead).

    **Uneven batch counts.** Under an initialized ``torch.distributed`` or
    ``jax.distributed`` with several ranks, iterating an epoch in which the ranks would yield
    different numbers of batches (only possible with ``enforce_equal_batches=False``) raises
    a ConfigError on every rank at the start of the epoch, since DDP (or a JAX collective)
    would hang at the step one rank no longer takes. Pass ``allow_uneven_batches=True`` to
    take that on yourself (e.g. with ``torch.distributed.algorithms.Join``).

    **Ranks that disagree.** With a DistributedSampler whose ranks are torch.distributed's
    or JAX's processes (its ``exchange``), construction exchanges the dataset's size, row
    shape, dtype, layout and selection (``Dataset.selections``), and :meth:`load_state_dict`
    the resumed position, refusing on every rank alike ranks that differ (another store or
    split; states saved at other steps); every rank must then build the loader and load its
    state at the same point.

    **Resuming.** :meth:`state_dict` / :meth:`load_state_dict` save and restore the position
    in the epoch (see :mod:`dali_zarr.planning.resume`), on the same or on another number of
    ranks. Our state is the source of truth for *which rows* come in which batch: the DALI
    callback is a pure function of (epoch, iteration) and the plan, so a fresh pipeline
    started at the saved batch yields the identical stream. DALI's own checkpoint adds only
    the state of stateful DALI operators (random ops in ``transform``); with
    ``enable_checkpointing=True`` it is saved in the state too and restored when the same
    rank of the same world size loads it, so such ops continue their random streams exactly.
    """

    #: Lightning looks for ``batch_sampler`` on any loader that has a ``sampler``; we batch
    #: inside DALI, so there is none.
    batch_sampler = None

    def __init__(
        self,
        dataset: Dataset,
        sampler: Planner,
        *,
        device: Device = "cpu",
        device_id: int | None = None,
        output: Output = "dense",
        obs: Sequence[str] = (),
        return_index: bool = False,
        dtype: torch.dtype | np.dtype | str = "float32",
        num_threads: int = 2,
        prefetch_windows: int = 2,
        prefetch_queue_depth: int = 2,
        read_threads: int | None = None,
        transform: Transform | None = None,
        allow_uneven_batches: bool = False,
        enable_checkpointing: bool = False,
        gpu_backend: Any = None,
    ) -> None:
        if not callable(getattr(sampler, "plan_epoch", None)):  # None failed at len()/iter
            raise ConfigError(
                f"Loader takes a dz.ChunkSampler or dz.DistributedSampler (anything with "
                f"plan_epoch(n_obs, epoch)), got {type(sampler).__name__}; torch's "
                "DistributedSampler does not plan chunks: wrap a dz.ChunkSampler in "
                "dz.DistributedSampler instead."
            )
        self.dataset = dataset
        self.sampler = sampler
        if not isinstance(sampler, DistributedSampler):
            _warn_every_rank_reads_everything(dataset)
        # the sampler's exchange travels with it when pickled; it needs this process's world
        over: Exchange | None = getattr(sampler, "exchange", None)
        rank, world = getattr(sampler, "rank", 0), getattr(sampler, "world_size", 1)
        # a DistributedSampler built before init_process_group (dist_info="env" needs no
        # group) compared nothing: its ranks are compared here, or nothing ever was (a seed
        # per rank, another store: rows twice or never, and batch counts that hang DDP)
        unchecked = over is None and isinstance(sampler, DistributedSampler)
        if unchecked:
            over = exchange_over(rank, world)
        self._exchange = over if over is not None and world_is(over, rank, world) else None
        # launcher variables read before init_process_group that count another world than
        # the one now initialized, or give this process another rank in it (stale RANK=0
        # on every rank): rows twice, and the ranks whose numbers matched exchanged alone
        stale_env: ConfigError | None = None
        if unchecked and self._exchange is None and getattr(sampler, "from_env", False):
            try:
                refuse_another_world(rank, world)
            except ConfigError as exc:
                stale_env, self._exchange = exc, exchange_of_initialized()
        self.device_id: int | None = None
        self._source: BatchSource | None = None  # type: ignore[assignment]
        with self._checked_on_every_rank(
            f"Loader over {getattr(dataset, 'name', dataset)}",
            release=self._release_source,
            hints={
                # only a sampler built before init_process_group is compared here, and it
                # refuses seed=None: the drawn seed needs the group first
                "sampler seed": f"{SAME_SEED_HINT}, or build the DistributedSampler after "
                "torch.distributed.init_process_group(...) with seed=None on every rank to "
                "use rank 0's draw",
                "n_obs": "open the same store (or the same subset of it) on every rank; "
                "the sampler shards one dataset among the ranks, it does not join "
                "one store per rank",
                "selection": "select the same rows and features on every rank (a split drawn "
                "on each rank, e.g. with an unseeded RNG, gives each rank other rows), open "
                "the same element= with the same mask_and_scale=, and join the same stores "
                "in the same order (sort a glob's paths)",
                "stores' sampled rows": "join the same stores in the same order on every "
                "rank (sort a glob's paths: equal-size stores in another order number other "
                "rows alike), and give every node the same copy of each store (the digests "
                "are of each store's first, middle and last rows)",
            },
        ) as mine:
            if stale_env is not None:
                raise stale_env
            if not isinstance(dataset, Dataset):  # a path failed later: 'str' has no 'name'
                raise ConfigError(
                    f"Loader takes a dataset, got {type(dataset).__name__} {dataset!r}: open "
                    "the store first, dz.Loader(dz.open_dataset(path), sampler, ...)."
                )
            self.dtype = _check_arguments(dataset, output, dtype)
            for flag, value in (("return_index", return_index),
                                ("allow_uneven_batches", allow_uneven_batches),
                                ("enable_checkpointing", enable_checkpointing)):  # fmt: skip
                validate_flag(flag, value, numpy=True)  # "no" was taken as True
            if transform is not None and not callable(transform):  # else a TypeError at the
                raise ConfigError(  # first batch, from inside the graph's declaration
                    f"transform={transform!r} is not callable: pass a function that takes the "
                    "dict of output DataNodes and returns the dict to emit (or None)."
                )
            prefetch_queue_depth = validate_count("prefetch_queue_depth", prefetch_queue_depth)
            num_threads = validate_int(  # a NumPy integer: DALI and deque(maxlen=) want int
                "num_threads", num_threads, low=1, high=MAX_THREADS + 1,
                what=f"a whole number from 1 to {MAX_THREADS} (DALI aborts the process where "
                "it cannot start that many threads)",
            )  # fmt: skip
            obs = obs_list(obs)
            _check_batch_fits(dataset, sampler, output)
            self._check_outputs(dataset, output=output, obs=obs, return_index=return_index)
            self.device, self.device_reason = _choose_device(device, gpu_backend)
            if self.device == "gpu":  # a rank past its node's GPUs is refused on every rank
                from dali_zarr.graph.gpu_pipeline import default_device_id

                # int() gave a bare ValueError for "cuda:1" and took 1.7 and True as GPU 1
                self.device_id = default_device_id() if device_id is None else validate_int(
                    "device_id", device_id, low=0, what="a GPU index, a whole number from 0",
                    hint=" (for 'cuda:1' pass device_id=1)",
                )  # fmt: skip
            # the ranks' datasets must have the same size and rows; the paths may differ
            # (a copy on each node's local disk)
            mine.update(dataset_fingerprint(dataset))
            del mine["name"]
            mine["selection"] = dataset.selections()
            stores = dataset.stores() if self._exchange is not None else None
            if stores:  # read only where the ranks compare them
                mine["stores' sampled rows"] = [s.sampled_rows_digest() for s in stores]
            if unchecked:
                settings = compared_settings(sampler.settings)  # type: ignore[union-attr]
                mine.update({f"sampler {k}": v for k, v in settings.items()})
            # built before the exchange: its own checks (obs columns, read_threads, ...)
            # refusing on one rank after it let the other ranks go on to train alone
            self._source = self._new_source(
                gpu_backend,
                output=output,
                obs=obs,
                return_index=return_index,
                prefetch_windows=prefetch_windows,
                prefetch_queue_depth=prefetch_queue_depth,
                **({} if read_threads is None else {"read_threads": read_threads}),
            )
        self._panel_reorders = output == "csr" and panel_reorders(dataset)
        self.output: Output = output
        self.obs = list(obs)
        self.return_index = return_index
        float64_dense = self.dtype == "float64" and output == "dense"
        if float64_dense and dataset.cf_decoding() is not None:
            warnings.warn(  # xarray decodes a packed int32/int64 in float64
                f"{dataset.name}: mask_and_scale=True decodes in float32 (* scale_factor + "
                "add_offset) and X is cast to float64 last, so the decoded values arrive "
                "with float32's precision (xarray's float64 decoding differs from about the "
                "7th digit). For float64 decoding, open it with mask_and_scale=False and "
                "decode the batches in torch (x * scale_factor + add_offset, fills to NaN).",
                stacklevel=2,
            )
        elif float64_dense and not _exact_in_float32(dataset.dtype):
            warnings.warn(
                f"{dataset.name}: dense X is built in float32 (where `transform` runs) and "
                f"cast to float64 last, so its stored {np.dtype(dataset.dtype)} values arrive "
                "rounded to float32. output='csr' casts the stored values once (exact).",
                stacklevel=2,
            )
        self.num_threads = num_threads
        self.prefetch_queue_depth = prefetch_queue_depth
        self.transform = transform
        self.allow_uneven_batches = bool(allow_uneven_batches)
        self.enable_checkpointing = bool(enable_checkpointing)
        self.epoch = 0
        self._epoch_set = False  # set_epoch called since the last epoch started
        log.info("%s; read paths: %s", self.device_reason, self.read_paths())
        self._closed = False
        self._iterator: Any = None  # DaliEpochIterator or a framework's DALI iterator
        self._pipe = None
        #: every DALI pipeline built, while alive: close() frees what they read once none is
        self._pipes_built: weakref.WeakSet[Any] = weakref.WeakSet()
        self._names: list[str] = []
        self._dali_epoch = -1  # DALI's epoch counter of the epoch now bound
        self._open_epoch = False  # an epoch was started and not run to its end
        self._consumed = 0  # batches handed out in the DALI epoch now bound
        self._passes = 0  # loops started over this loader; only the latest may draw batches
        # held while a loop starts and while it draws a batch: loops in two threads at once
        # ran DALI from both and took each other's batches (one loop lost rows, no error).
        # Reentrant: a signal handler (a preemption checkpoint) may call state_dict() in the
        # middle of a batch, on the thread that holds it
        self._loop_lock = threading.RLock()
        self._looping = 0  # the pass of the loop now running (0: none)
        self._iter0 = 0  # DALI iteration of its first batch (>0 after a DALI restore)
        # a batch failed in this DALI epoch: DALI's iterator had already counted it, so its
        # checkpoint is one batch past what the user got and is not saved (see _dali_checkpoint)
        self._dali_ahead = False
        # DALI's iterator is inside a draw (or an epoch's start) on the thread holding the
        # loop lock: a state saved now (a signal handler's) would take a checkpoint that
        # already counts the batch being drawn, one past `consumed` (see _dali_checkpoint)
        self._in_dali = False
        # (epoch, history, start) of the epoch now or last iterated: plan batch of the
        # k-th batch handed out is start + k
        self._run: tuple[int, tuple[Segment, ...], int] | None = None
        self._pending: ResumePoint | None = None  # from load_state_dict, not yet started
        self._restore: dict[str, Any] | None = None  # DALI checkpoint to build the pipeline from

    def _check_outputs(
        self, dataset: Dataset, *, output: str, obs: Sequence[str], return_index: bool
    ) -> None:
        """An adapter's own refusal of what it would hand out (JaxLoader: values JAX's
        32-bit mode would wrap). Runs among the ranks' checks, so a rank refused here alone
        does not leave the others waiting for it."""

    def _new_source(self, gpu_backend: Any, **source_args: Any) -> BatchSource:
        """The DALI callback's source on this loader's device (its reader threads start
        with the first window)."""
        if self.device == "gpu":
            from dali_zarr.graph.gpu_pipeline import GpuBatchSource

            return GpuBatchSource(
                self.dataset,
                self.sampler,
                **source_args,
                backend=gpu_backend,
                device_id=self.device_id,
            )
        return BatchSource(self.dataset, self.sampler, **source_args)

    # -- public ---------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose plan the next iteration follows (reshuffles)."""
        # a whole number (NumPy's too): int(1.5) would run epoch 1 unsaid, and "1" failed
        # with a TypeError from the comparison
        self.epoch = validate_int(
            f"set_epoch({epoch!r}): the epoch", epoch, low=0, what="a whole number from 0"
        )
        self._epoch_set = True

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (after :meth:`load_state_dict`:
        the batches still to come in the resumed epoch). Inside a loop: the batches that
        loop yields, also when it continues a resumed epoch (the resume point is used up
        when the loop starts, and the count of the whole normal epoch was reported)."""
        if self._looping and self._run is not None:
            epoch, history, start = self._run
            return self._source.plan(epoch, history).n_batches - start
        history, start = self._resume_for(self.epoch)
        return self._source.plan(self.epoch, history).n_batches - start

    def plan(self) -> EpochPlan:
        """The plan the next loop over the current epoch follows on this rank (inside a
        loop: that loop's); after :meth:`load_state_dict` on another world size, the
        remainder plan of the resumed epoch (``rows_done``, ``rows_skipped`` account for the
        whole epoch). It agrees with ``len()``."""
        history = self._resume_for(self.epoch)[0]
        if self._looping and self._run is not None and self._run[0] == self.epoch:
            history = self._run[1]
        return self._source.plan(self.epoch, history)

    def categories(self, column: str) -> tuple[str, ...] | None:
        """Label names of a categorical obs column: ``categories(c)[code]``, as text (integer
        or bool categories too, ``"1"``: a collection merges its stores' categories by name)."""
        return self.dataset.categories(column)

    def read_paths(self) -> dict[str, str]:
        """Which read path serves each array of the dataset (on the GPU path: how each
        array's windows reach the device: GDS or compat reads, nvCOMP or host decode)."""
        return self._source.read_paths()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        with self._loop_lock:
            self._in_dali = True
            try:
                with self._pipeline_interruptible():
                    iterator = self._start_epoch()
            finally:
                self._in_dali = False
            self._passes += 1
            this_pass = self._looping = self._passes
        try:
            while True:
                batch = None
                try:
                    with self._loop_lock:  # the check and the draw as one: no loop starts
                        batch = self._next_batch(iterator, this_pass)  # between
                except BaseException:
                    # a Ctrl-C (or a signal handler's SystemExit) that CPython delivered as
                    # the lock was released: the batch was counted and never handed out, and
                    # a state saved then resumed past its rows
                    if batch is not None:
                        self._consumed -= 1
                        self._dali_ahead = self.enable_checkpointing  # DALI's checkpoint has it
                    raise
                if batch is None:
                    return
                yield batch
        finally:  # run out, left (break closes the generator) or failed
            if self._looping == this_pass:
                self._looping = 0

    def _next_batch(self, iterator: Any, this_pass: int) -> dict[str, Any] | None:
        """The next batch of DALI's iterator for loop ``this_pass``, or None where its epoch
        ended; a loop replaced by a newer one is refused (call with the loop lock)."""
        self._refuse_if_closed()  # a generator still held after close()
        if self._passes != this_pass:  # it would take the newer loop's batches
            raise ConfigError(
                f"{self.dataset.name}: a newer loop over this loader has started "
                "since this one; the DALI pipeline serves one loop at a time, so a "
                "loop left early cannot go on once another has begun. Iterate one "
                "loop at a time."
            )
        self._in_dali = True
        try:
            try:
                with self._pipeline_interruptible():
                    outputs = next(iterator)
            except StopIteration:
                self._open_epoch = False
                return None
            except Exception as exc:
                self._dali_ahead = self.enable_checkpointing
                error = self._original_error(exc)
                if self._closed:  # by another thread mid-batch: its readers' own errors told
                    # "cannot schedule new futures after shutdown" or RingClosed
                    raise ConfigError(
                        f"this Loader of {self.dataset.name} was closed while it drew a batch "
                        f"({type(error).__name__}: {error}); create a new one to iterate"
                    ) from error
                raise error from exc
            # counted once it is the caller's, before the flag drops (no state counts it
            # twice): a Ctrl-C while it was converted left it counted and never handed out,
            # and a state saved on that Ctrl-C resumed past its rows
            try:
                batch = self._to_batch(outputs[0])
            except BaseException:
                self._dali_ahead = self.enable_checkpointing  # DALI's checkpoint counts it
                raise
            self._consumed += 1
        finally:
            self._in_dali = False
        return batch

    @contextlib.contextmanager
    def _pipeline_interruptible(self) -> Iterator[None]:
        """Drop the DALI pipeline where a KeyboardInterrupt (Ctrl-C) or another exception
        that is not an ``Exception`` (a signal handler's ``SystemExit``) ends a call into it.

        It may have landed while DALI fed one batch's outputs to its external sources, some
        fed and some not: every later batch of that pipeline joined one batch's ``pos`` with
        another's rows (X of other rows than ``index`` says, rows twice and never, or a
        crash in the densify op), in later epochs too. The next loop builds a new pipeline,
        as at the first loop; the position handed out so far is kept for state_dict()."""
        try:
            yield
        except Exception:
            raise
        except BaseException:
            self._iterator = self._pipe = None
            self._open_epoch = False
            self._source.restart()
            raise

    def close(self) -> None:
        """Stop the reader threads and let the DALI pipeline and its buffers go (on the GPU
        path: device memory, kvikio files, nvCOMP codecs). Iterating afterwards raises
        ConfigError. A ``with dz.Loader(...) as loader:`` block calls it on exit."""
        self._closed = True
        self._iterator = self._pipe = None  # freed unless a generator of __iter__ holds them
        # a pipeline freed has joined its threads: the batches it was handed can go once
        # every pipeline built is (one a Ctrl-C dropped may live on in its traceback)
        self._source.close(pipeline_gone=not self._pipes_built)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: a small dict of plain values (plus DALI's checkpoint bytes
        with ``enable_checkpointing=True``), to save with the model on every rank.

        ``consumed`` counts the batches handed out to the caller in the current epoch, not
        what DALI has prefetched: call this after the step on the last batch is done (or
        after the loop), and the resumed run continues with the next batch.
        """
        with self._loop_lock:  # not while a loop in another thread draws a batch
            return self._state()

    def _state(self) -> dict[str, Any]:
        settings = PlanSettings.of(self.sampler)
        dali: dict[str, Any] | None = None
        if self._pending is not None and self._pending.epoch == self.epoch:
            epoch, history, consumed = self.epoch, self._pending.history, self._pending.start
            dali = self._restore
        elif self._run is not None and (self._run[0] == self.epoch or self._looping):
            # (a loop still running reports its own epoch, even after a set_epoch for the
            # next: the rest of its epoch is still to come, and a state of the next one at
            # batch 0 would never deliver it)
            epoch, history, start = self._run
            consumed = start + self._consumed
            dali = self._dali_checkpoint(bound=True)
        else:
            epoch, history, consumed = self.epoch, (), 0
            drained = True
            if (
                self.enable_checkpointing
                and self._open_epoch
                and self._iterator is not None
                and not self._in_dali  # a signal handler's, inside that drain or a draw
            ):
                # a loop was left early: the next loop first drains what DALI prefetched,
                # drawing the transform's random ops for it; a checkpoint taken before that
                # resumed the ops short of those draws (other values than the run's)
                try:
                    with self._pipeline_interruptible():
                        self._end_left_loop()
                except Exception as exc:
                    log.warning(
                        "dali_zarr: the batches DALI had prefetched past the loop left early "
                        "failed (%s); the state is saved without DALI's checkpoint (the data "
                        "position is exact; DALI operators restart from their initial state "
                        "on resume)",
                        exc,
                    )
                    drained = False
            dali = self._dali_checkpoint(bound=False) if drained else None
            if dali is None and self._restore is not None:
                dali = {**self._restore, "bound": False}
        return make_state(
            settings=settings,
            dataset=dataset_fingerprint(self.dataset),
            epoch=epoch,
            consumed=consumed,
            n_batches=self._source.plan(epoch, history).n_batches,
            rank=self.sampler.rank,  # type: ignore[attr-defined]
            world_size=self.sampler.world_size,  # type: ignore[attr-defined]
            history=history,
            dali=dali,
        )

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue where the run that saved ``state`` stopped; call on a fresh Loader.

        ``state``: this rank's saved state, any old rank's, or the list of all old ranks'
        states. With the same world size this rank continues its epoch at the next batch
        (the stream is identical to the uninterrupted one). With another world size the
        rest of that epoch is split among the new ranks, every row not yet delivered exactly
        once (see :mod:`dali_zarr.planning.resume`); later epochs follow the normal plan.
        Sets :attr:`epoch` to the saved epoch; iterate it (``set_epoch`` to the same epoch
        is fine) to continue it. A state of another dataset or other sampler settings is
        refused with a ConfigError that says what differs.
        """
        same_step = "load states saved at the same step on every rank (the same checkpoint)"
        # every rank must resume the same epoch after the same history, and (with equal
        # batches) have as many batches left: ranks that loaded states of other steps do not
        with self._checked_on_every_rank(
            f"Loader.load_state_dict over {self.dataset.name}",
            hints={"batches left": same_step, "epoch": same_step},
        ) as position:
            if self._iterator is not None:  # in the block: the other ranks wait for this one
                raise ConfigError(
                    "load_state_dict must be called on a fresh Loader, before it is iterated: "
                    "build a new Loader and load the state into it"
                )
            settings = PlanSettings.of(self.sampler)
            point = resume_point(
                state,
                settings=settings,
                dataset=dataset_fingerprint(self.dataset),
                rank=self.sampler.rank,  # type: ignore[attr-defined]
                world_size=self.sampler.world_size,  # type: ignore[attr-defined]
            )
            plan = self._source.plan(point.epoch, point.history)  # fail here, not in DALI
            position["epoch"] = point.epoch
            position["history"] = [s.as_dict() for s in point.history]
            if self._steps_must_agree(settings, point):
                position["batches left"] = plan.n_batches - point.start
        self._pending = point
        self._restore = None
        self.epoch = point.epoch
        dali = point.own_state.get("dali") if point.own_state is not None else None
        saved_pipeline = dali.get("pipeline") if isinstance(dali, Mapping) else None
        if (
            dali
            and self.enable_checkpointing
            and isinstance(saved_pipeline, Mapping)
            and saved_pipeline.get("transform") is None
            and self.transform is None
        ):
            # our own operators keep no state (the rows come from the plan): a checkpoint
            # of a pipeline without a transform has nothing to continue, and restoring it
            # into one built with other obs, dtype, output or device fails in DALI
            log.info(
                "dali_zarr: the state's DALI checkpoint holds no operator state (no "
                "transform); not restored"
            )
        elif dali and self.enable_checkpointing:
            self._restore = dict(dali)
        elif dali and self.transform is not None and isinstance(saved_pipeline, Mapping):
            if saved_pipeline.get("transform") is not None:  # its random ops would restart
                log.warning(
                    "dali_zarr: the state has a DALI checkpoint of the transform's operators, "
                    "not restored: this loader was built with enable_checkpointing=False, so "
                    "their random ops restart from their initial state (the rows are exact); "
                    "build it with enable_checkpointing=True to continue them"
                )
        elif dali:
            log.info(
                "dali_zarr: the state has a DALI checkpoint; ignored (enable_checkpointing=False)"
            )

    @contextlib.contextmanager
    def _checked_on_every_rank(
        self, what: str, *, hints: Mapping[str, str], release: Callable[[], None] = lambda: None
    ) -> Iterator[dict[str, object]]:
        """The block runs this rank's own checks and fills the yielded dict with what the
        ranks must agree on. Where the ranks exchange (:attr:`_exchange`), a refusal of the
        block (any error, not only a ConfigError) waits for the exchange, so no rank is left
        waiting for one that stopped: this rank raises its own error, the others one that
        names it, and all raise the same error where the dicts differ. Without an exchange
        the block's errors pass through. ``release`` frees what the block built where
        another rank refused."""
        mine: dict[str, object] = {}
        refused: Exception | None = None
        try:
            yield mine
        except Exception as exc:  # any error: a TypeError on one rank (obs=5) skipped the
            if self._exchange is None:  # exchange, and the other ranks waited for it
                raise
            refused = exc
        if self._exchange is not None:
            try:
                agree_or_raise(
                    mine, over=self._exchange, local_error=refused, what=what, hints=hints
                )
            except BaseException:
                release()
                raise

    def _release_source(self) -> None:
        """Close the source a refused construction built (its reader, on the GPU path its
        device and files)."""
        if self._source is not None:
            self._source.close()

    def _steps_must_agree(self, settings: PlanSettings, point: ResumePoint) -> bool:
        """:func:`~dali_zarr.planning.resume.steps_must_agree` for the resumed epoch of this
        world (``_check_even`` lets an epoch of equal counts run under DDP)."""
        counts = self._batch_counts(settings, point.epoch, point.history)
        return steps_must_agree(settings, counts)

    def _batch_counts(
        self, settings: PlanSettings, epoch: int, history: tuple[Segment, ...]
    ) -> np.ndarray:
        """Batches each rank of this world yields in ``epoch`` after ``history`` (from the
        plans alone: every rank computes every rank's count, without communicating)."""
        return batch_counts(
            settings,
            n_obs=self.dataset.n_obs,
            epoch=epoch,
            world_size=getattr(self.sampler, "world_size", 1),
            history=history,
        )

    def _resume_for(self, epoch: int) -> tuple[tuple[Segment, ...], int]:
        """(history, first plan batch) the next iteration of ``epoch`` starts from."""
        if self._pending is not None and self._pending.epoch == epoch:
            return self._pending.history, self._pending.start
        return (), 0

    def _dali_checkpoint(self, *, bound: bool) -> dict[str, Any] | None:
        """DALI's checkpoint at the last batch handed out (it counts consumed iterations)."""
        closed = self.enable_checkpointing and self._closed and self._dali_epoch >= 0
        if closed and self.transform is not None:
            # close() let the pipeline go, and its operators' state with it: a state saved
            # after a `with` block had no DALI checkpoint, without a word (without a
            # transform no operator keeps a state to lose: nothing to say)
            log.warning(
                "dali_zarr: this Loader of %s was closed, so its state is saved without "
                "DALI's checkpoint (the data position is exact; the transform's random ops "
                "restart from their initial state on resume); call state_dict() before "
                "close() or the end of the `with` block to keep it",
                self.dataset.name,
            )
            return None
        if not self.enable_checkpointing or self._iterator is None:
            return None
        if self._in_dali:  # a signal handler's state_dict() in the middle of a draw
            log.warning(
                "dali_zarr: the state of %s is saved in the middle of a batch being drawn "
                "(a signal handler's state_dict()), where DALI's checkpoint already counts "
                "that batch; it is saved without it (the data position is exact; DALI "
                "operators restart from their initial state on resume)",
                self.dataset.name,
            )
            return None
        if self._dali_ahead:  # resumed from it, the failed batch would never be delivered
            log.warning(
                "dali_zarr: a batch failed in this epoch, so DALI's checkpoint counts one "
                "batch the loop never got; the state is saved without it (the data position "
                "is exact; DALI operators restart from their initial state on resume)"
            )
            return None
        checkpoints = getattr(self._iterator, "checkpoints", None)
        blob = checkpoints()[0] if checkpoints is not None else self._pipe.checkpoint()
        return {
            "checkpoint": blob,
            "epoch_idx": self._dali_epoch,
            "iteration": self._iter0 + self._consumed,
            "bound": bound,
            "pipeline": self._pipeline_arguments(),
        }

    def _pipeline_arguments(self) -> dict[str, Any]:
        """The arguments that decide which DALI operators the pipeline has, as plain values:
        a DALI checkpoint fits only a pipeline of the same operators, and a refused one is
        explained by naming the arguments that differ."""
        t = self.transform
        name = (
            None if t is None
            else f"{getattr(t, '__module__', None) or ''}."
            f"{getattr(t, '__qualname__', type(t).__qualname__)}"
        )  # fmt: skip
        return {
            "device": self.device,
            "output": self.output,
            "dtype": str(self.dtype),
            "obs": list(self.obs),
            "return_index": bool(self.return_index),
            "transform": name,
        }

    def _check_even(self, history: tuple[Segment, ...]) -> None:
        """Refuse, on every rank alike, an epoch whose ranks would run different step counts
        under torch.distributed or jax.distributed (DDP, or a JAX collective, would wait
        forever on the rank that ran out)."""
        world = getattr(self.sampler, "world_size", 1)
        if self.allow_uneven_batches or world <= 1 or not collectives_may_hang():
            return
        try:
            settings = PlanSettings.of(self.sampler)
        except ConfigError:
            return  # a custom planner: we cannot compute the other ranks' counts
        if settings.enforce_equal_batches:
            return  # equal by construction, in resumed epochs too
        counts = self._batch_counts(settings, self.epoch, history)
        if (counts != counts[0]).any():
            raise ConfigError(
                f"epoch {self.epoch}: with enforce_equal_batches=False the {world} ranks yield "
                f"different numbers of batches {counts.tolist()}; under torch.distributed "
                "(DDP) or jax.distributed the ranks with more batches would wait forever in a "
                "collective on the ranks that ran out. Use enforce_equal_batches=True (the "
                "default: equal counts, fewer than world_size x batch_size rows left out per "
                "epoch), or pass Loader(..., allow_uneven_batches=True) and handle the uneven "
                "ends yourself (with DDP, e.g. by wrapping the loop in "
                "torch.distributed.algorithms.Join([model]))"
            )

    # -- internals ------------------------------------------------------------------------------

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise ConfigError(
                f"this Loader of {self.dataset.name} was closed; create a new one to iterate"
            )

    def _start_epoch(self) -> Any:
        self._refuse_if_closed()
        self.dataset.check_unchanged()  # a store rewritten meanwhile would read as garbage
        pending = self._pending
        history, start = self._resume_for(self.epoch)
        # validate settings (and the ranks' batch counts) before DALI starts calling back
        self._source.plan(self.epoch, history)
        self._check_even(history)
        if (
            pending is not None
            and pending.epoch != self.epoch
            and pending.start < self._source.plan(pending.epoch, pending.history).n_batches
        ):
            log.warning(
                "dali_zarr: the loaded state resumes epoch %d but epoch %d was started; the "
                "rest of epoch %d is not delivered",
                pending.epoch,
                self.epoch,
                pending.epoch,
            )
        last = self._run
        if (
            self._open_epoch  # the last loop was left early
            and pending is None
            and last is not None
            and last[0] == self.epoch
            and (last[1] or last[2])  # ... and it went on from a loaded state
        ):
            # a peek (next(iter(loader))) after load_state_dict is such a loop: the epoch
            # then ran afresh, repeating the rows the saved run had delivered, unsaid
            log.warning(
                "dali_zarr: the loop that went on with epoch %d from a loaded state was left "
                "after %d batch(es); this loop starts epoch %d afresh, so rows delivered "
                "before that state come again. To go on from where it stopped instead, load "
                "loader.state_dict(), taken before this loop, into a new Loader",
                self.epoch,
                self._consumed,
                self.epoch,
            )
        # the resume point is used up, and this epoch becomes the run, once it has started:
        # a state saved meanwhile (a signal handler's, while the last loop's prefetched
        # batches drain) still has nothing of it handed out, not the last loop's count
        run = (self.epoch, history, start)
        # the epoch the next iteration will likely follow: the one after this if the caller
        # steps epochs with set_epoch, else this one again; its first windows are read while
        # this epoch ends (a wrong guess costs those reads, never the batches)
        next_epoch = self.epoch + 1 if self._epoch_set else self.epoch
        self._epoch_set = False
        if self._iterator is None:
            restore, self._restore = self._restore, None
            pipe, self._names = self._build_pipeline(restore["checkpoint"] if restore else None)
            self._pipe = pipe
            self._pipes_built.add(pipe)
            if restore is None:
                self._dali_epoch = 0
                self._source.bind_epoch(
                    0, self.epoch, history=history, start=start, next_epoch=next_epoch
                )
                self._iterator = self._make_iterator(pipe, self._names)
                self._open_epoch, self._consumed, self._iter0 = True, 0, 0
                self._dali_ahead = False
                return self._started(run)
            # DALI resumes its epoch `epoch_idx` at `iteration`, its operators restored
            self._dali_epoch, self._iter0 = int(restore["epoch_idx"]), int(restore["iteration"])
            if restore.get("bound") and pending is not None and pending.epoch == self.epoch:
                # ... and that position is the saved batch `start` of this epoch: go on
                self._source.bind_epoch(
                    self._dali_epoch,
                    self.epoch,
                    history=history,
                    start=start - self._iter0,
                    next_epoch=next_epoch,
                )
                self._iterator = self._restored_iterator(pipe, restore, pending)
                self._open_epoch, self._consumed = True, 0
                return self._started(run)
            # ... at another epoch's position: end that DALI epoch (unbound: it stops at
            # once) and begin ours as the next, so DALI's operator state still carries over
            self._iterator = self._restored_iterator(pipe, restore, pending)
            self._open_epoch, self._consumed = True, 0
        if self._open_epoch:  # the last loop was left early: drain what DALI prefetched
            self._end_left_loop()
        self._dali_epoch += 1
        self._source.bind_epoch(
            self._dali_epoch, self.epoch, history=history, start=start, next_epoch=next_epoch
        )
        self._iterator.reset()
        self._open_epoch = True
        self._consumed = 0
        self._iter0 = 0
        self._dali_ahead = False
        return self._started(run)

    def _started(self, run: tuple[int, tuple[Segment, ...], int]) -> Any:
        """Mark epoch ``run`` (epoch, history, start) as the one now iterated; its iterator."""
        self._pending, self._run = None, run
        return self._iterator

    def _end_left_loop(self) -> None:
        """End the DALI epoch of a loop left early: drain the batches DALI had prefetched past
        the last one handed out (their rows are not delivered; the transform's random ops
        have run on them)."""
        self._source.cut_epoch(self._dali_epoch, self._iter0 + self._consumed)
        # next(), not `for`: iter() on a DALI iterator resets it when its pipeline has
        # already reached the end (the loop stopped at exactly len(self) batches, as
        # Lightning does), which would skip the next epoch
        while True:
            try:
                next(self._iterator)
            except StopIteration:
                break
        self._open_epoch = False

    def _restored_iterator(
        self, pipe: Any, restore: dict[str, Any], pending: ResumePoint | None
    ) -> Any:
        """DALI's iterator over ``pipe``, which restores the state's DALI checkpoint.

        DALI refuses a checkpoint of another pipeline (a state saved with another
        ``transform``) with a bare RuntimeError ("There's no checkpoint for operator ...") at
        the first batch; that is a ConfigError saying what to change. The loaded position is
        kept, so iterating again raises again instead of restarting the epoch at batch 0."""
        try:
            return self._make_iterator(pipe, self._names)
        except RuntimeError as exc:
            self._pending, self._restore, self._pipe = pending, restore, None
            if self._source.error is not None:  # our callback failed (a bad chunk), not DALI
                raise self._original_error(exc) from exc
            saved, now = restore.get("pipeline"), self._pipeline_arguments()
            diffs = [
                f"{key}: saved {saved.get(key)!r}, now {value!r}"
                for key, value in now.items()
                if isinstance(saved, Mapping) and saved.get(key) != value
            ]
            # name what changed where the state says ("another transform" misled where none
            # did); a state of an older dali_zarr records no arguments
            other = (
                "another transform" if not diffs or saved.get("transform") != now["transform"]
                else "other arguments"
            )  # fmt: skip
            raise ConfigError(
                f"{self.dataset.name}: the loaded state's DALI checkpoint (state['dali']) "
                "does not fit this Loader's DALI pipeline: it was saved by a Loader with "
                f"{other} (other DALI operators){': ' if diffs else ''}{'; '.join(diffs)}. "
                "Build the Loader with the arguments that saved the state, or with "
                "enable_checkpointing=False to resume the same rows without DALI's operator "
                f"state (random ops in the transform then restart from their seeds). DALI "
                f"said: {exc}"
            ) from exc

    def _build_pipeline(self, checkpoint: bytes | str | None):
        """This loader's DALI pipeline on its device, and the pipeline's output names."""
        kwargs = {
            "dtype": self.dtype,
            "num_threads": self.num_threads,
            "prefetch_queue_depth": self.prefetch_queue_depth,
            "transform": self.transform,
            "enable_checkpointing": self.enable_checkpointing,
            "checkpoint": checkpoint,
        }
        if self.device == "gpu":
            from dali_zarr.graph.gpu_pipeline import build_gpu_pipeline

            return build_gpu_pipeline(self._source, device_id=self.device_id, **kwargs)
        return build_pipeline(self._source, device_id=None, **kwargs)

    def _make_iterator(self, pipe, names: list[str]):
        """The framework's DALI iterator (an adapter for another framework overrides this).

        Batches leave DALI without a copy (:class:`DaliEpochIterator`), except with
        ``enable_checkpointing``: DALI's own iterator then tracks the checkpoint of the batch
        the user consumed while the pipeline runs ahead, at the price of one copy per batch.
        """
        if self.enable_checkpointing:
            _teach_dali_unsigned_types()
            return DALIGenericIterator([pipe], names, auto_reset=False, prepare_first_batch=False)
        return DaliEpochIterator(pipe, names)

    def _original_error(self, exc: Exception) -> BaseException:
        """DALI wraps callback errors in its own; surface ours (they name store and chunk)."""
        error, self._source.error = self._source.error, None
        return error if error is not None else exc

    def _to_batch(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One iterator output → the user's batch dict (adapters override this too)."""
        batch = {name: _as_torch(value) for name, value in outputs.items()}
        x = batch.get("X")
        if self.dtype == "float32" and x is not None and x.dtype != torch.float32:
            batch["X"] = x.float()  # a transform made X another dtype: dtype= holds
        if self.dtype == "bfloat16":  # DALI hands out bfloat16's uint16 bits
            for name in ("X", "X_data"):
                if name in batch:
                    batch[name] = batch[name].view(torch.bfloat16)
        if "X_data" in batch:
            batch["X"] = canonical_csr(
                batch.pop("X_indptr"),
                batch.pop("X_indices"),
                batch.pop("X_data"),
                n_features=self.dataset.n_features,
                sort_rows=self._panel_reorders,
                repeats_or=np.dtype(self.dataset.dtype) == np.bool_,
            )
        return batch


def _teach_dali_unsigned_types() -> None:
    """DALI's PyTorch iterator allocates each output as ``to_torch_type[dtype]``, a table
    without uint16/32/64, so it failed with a KeyError on bfloat16 (which leaves DALI as
    uint16 bits), on uint16/uint32 column ids and on unsigned obs columns. torch has those
    types (as storage; we view or convert them): add them where DALI has none."""
    from nvidia.dali import types as dali_types
    from nvidia.dali.plugin.pytorch import torch_utils

    for name in ("UINT16", "UINT32", "UINT64"):
        ours = getattr(torch, name.lower(), None)
        if ours is not None:
            torch_utils.to_torch_type.setdefault(getattr(dali_types.DALIDataType, name), ours)


def panel_reorders(dataset: Dataset) -> bool:
    """Whether a feature selection numbers some store's kept columns out of their stored
    order, which leaves each CSR row's column ids unsorted."""
    pairs = dataset.store_columns() or []
    return any(c is not None and bool(np.any(np.diff(c[c >= 0]) < 0)) for _, c in pairs)


def _rows_not_increasing(crow: torch.Tensor, col: torch.Tensor) -> bool:
    """Whether some row's column ids do not strictly increase (an id at or below its left
    neighbour that does not start a row: unsorted, or stored twice): one pass, in NumPy on
    the host (torch's elementwise ops took ~15x as long on a 1M-id batch), in torch on the
    device."""
    nnz = col.numel()
    if col.device.type == "cpu":
        down = np.diff(col.numpy()) <= 0
        starts = crow.numpy()[1:-1]
        down[starts[(starts > 0) & (starts < nnz)] - 1] = False
        return bool(down.any())
    # one sync (the answer): row starts marked without a boolean mask, whose indexing
    # would sync too (crow's values lie in [0, nnz], an empty last row's start at nnz)
    starts = torch.zeros(nnz + 1, dtype=torch.bool, device=col.device)
    starts[crow[:-1].to(torch.int64)] = True
    return bool(((col[1:] <= col[:-1]) & ~starts[1:nnz]).any())


def canonical_csr(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    *,
    n_features: int,
    sort_rows: bool,
    repeats_or: bool = False,
) -> torch.Tensor:
    """A batch CSR as torch's sparse ops expect it: row pointers and column ids of one
    integer type (int32 where they fit; stores may hold uint8/uint16/uint32 ids) and each
    row's ids strictly increasing. Rows are sorted with ``sort_rows`` (a reordered panel),
    or where the batch finds some stored unsorted (anndata writes ids as scipy holds them:
    unsorted after ``adata[:, genes]`` in another order); an id a row stores twice (scipy
    allows it, and sums them) is summed into one entry, as the dense output sums it (with
    ``repeats_or``, a bool store's, True twice is 1, as scipy and the dense output have it). An
    unsorted CSR, or one with repeats, is right for ``to_dense()`` and ``@`` but wrong for
    sparse-sparse ops (a repeated id was multiplied as 1*1 + 2*2, not 3*3)."""
    nnz = col.numel()
    wide = nnz >= 2**31 or col.dtype in (torch.int64, torch.uint32, torch.uint64)
    index_type = torch.int64 if wide else torch.int32
    crow, col = crow.to(index_type), col.to(index_type)
    n_rows = crow.numel() - 1
    if nnz > 1 and (sort_rows or _rows_not_increasing(crow, col)):
        rows = torch.repeat_interleave(
            torch.arange(n_rows, device=col.device), crow.diff(), output_size=nnz
        )
        # stable: a repeated id's entries keep their stored order, on either device (the
        # CPU's unstable sort reorders ties, the GPU's may not)
        keys = rows * n_features + col.to(torch.int64)
        order = torch.argsort(keys, stable=True)
        keys, col, values = keys[order], col[order], values[order]
        if bool((keys[1:] == keys[:-1]).any()):  # one sync, only where rows were unsorted
            crow, col, values = _summed_repeats(keys, values, n_rows, n_features, index_type)
            if repeats_or:
                values = values.clamp(max=1)
    return torch.sparse_csr_tensor(
        crow,
        col,
        values,
        size=(n_rows, n_features),
        check_invariants=False,  # built by our gather op from validated column ids
    )


def _summed_repeats(
    keys: torch.Tensor, values: torch.Tensor, n_rows: int, n_features: int, index_type: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(crow, col, values)`` of sorted ``keys`` (row * n_features + id) with each repeated
    key's values summed (in float32, float64 for float64 values, as the densify sums)."""
    unique, inverse = torch.unique_consecutive(keys, return_inverse=True)
    wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    summed = torch.zeros(unique.numel(), dtype=wide, device=values.device)
    summed.index_add_(0, inverse, values.to(wide))
    counts = torch.bincount(unique // n_features, minlength=n_rows)
    crow = torch.zeros(n_rows + 1, dtype=index_type, device=keys.device)
    crow[1:] = torch.cumsum(counts, 0)
    return crow, (unique % n_features).to(index_type), summed.to(values.dtype)


def _check_arguments(dataset: Dataset, output: str, dtype: Any) -> str:
    """The output dtype's name, after refusing arguments the dataset cannot take (checked
    before the ranks exchange, which then reports a refusal on every rank)."""
    if output not in ("dense", "csr"):
        raise ConfigError(f"output={output!r}: use 'dense' or 'csr'.")
    if output == "csr" and dataset.layout != "csr":
        raise ConfigError(
            f"output='csr' needs a sparse X, but {dataset.name} is dense; use output='dense'."
        )
    if dataset.n_obs < 1:
        raise ConfigError(
            f"{dataset.name} has no observations: there is nothing to load. Check the "
            "store (or the ids of a subset, e.g. an empty split)."
        )
    try:
        return output_dtype_name(dtype)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def _check_batch_fits(dataset: Dataset, sampler: Planner, output: str) -> None:
    """Refuse, up front and by name, a dense batch (or a dense store's window) larger than
    this machine's memory: a store whose width is wrong (a sparse matrix's ``shape``
    attribute off by orders of magnitude) otherwise fails deep in DALI with bad_alloc."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    width = int(np.prod(dataset.feature_shape))
    # no window or batch holds more rows than the dataset (chunk_size may exceed n_obs)
    if dataset.layout == "dense":  # the window, as stored
        rows = min(
            getattr(sampler, "window_rows", getattr(sampler, "batch_size", 0)), dataset.n_obs
        )
        what, itemsize = f"a window of {rows} rows", np.dtype(dataset.dtype).itemsize
    elif output == "dense":  # the batch, in the float32 the graph densifies into
        rows = min(getattr(sampler, "batch_size", 0), dataset.n_obs)
        what, itemsize = f"a dense batch of {rows} rows", 4
    else:
        return
    need = rows * width * itemsize
    if need > memory:
        raise ConfigError(
            f"{dataset.name}: {what} x {width:,} features is {need / 2**30:,.0f} GiB, more "
            f"than this machine's {memory / 2**30:,.0f} GiB. Check the store's width (for a "
            "sparse matrix, its 'shape' attribute), or load fewer features (features=), "
            "output='csr', or a smaller batch_size / preload_nchunks."
        )


def _exact_in_float32(dtype: np.dtype) -> bool:
    """Whether every value of ``dtype`` survives the float32 the dense graph computes in."""
    dtype = np.dtype(dtype)
    return dtype.kind == "b" or (dtype.kind in "iuf" and dtype.itemsize <= 2) or dtype == np.float32


def _as_torch(value: Any) -> torch.Tensor:
    """A DALI sample, shared through DLPack, or a DALI iterator's ``[1, ...]`` copy."""
    return value[0] if isinstance(value, torch.Tensor) else torch.from_dlpack(value)


def check_device(device: object) -> None:
    """``device`` must be one of the Loader's: "cpu", "gpu" or "auto"."""
    if device not in ("cpu", "gpu", "auto"):
        raise ConfigError(f"device={device!r}: use 'cpu', 'gpu' or 'auto'.")


def _choose_device(device: str, gpu_backend: Any) -> tuple[str, str]:
    """("cpu" | "gpu", a sentence saying why) for ``Loader(device=...)``."""
    check_device(device)
    if gpu_backend is not None:
        from dali_zarr.graph.window_backends import CudaBackend, HostBackend

        if not isinstance(gpu_backend, CudaBackend | HostBackend):
            raise ConfigError(
                f"gpu_backend={gpu_backend!r} is not a window backend: leave it None (the "
                "GPU path picks CUDA), or pass dali_zarr.graph.window_backends.HostBackend() "
                "to run the GPU path's graph on the host."
            )
        if device == "cpu":  # it was ignored: the run was not the one asked for
            raise ConfigError(
                "gpu_backend= drives the GPU path, and device='cpu' takes the CPU path: "
                "pass device='gpu' with it, or drop gpu_backend=."
            )
    if device == "cpu":
        return "cpu", "dali_zarr: CPU path (device='cpu')"
    if gpu_backend is not None:
        name = getattr(gpu_backend, "name", type(gpu_backend).__name__)
        return "gpu", f"dali_zarr: GPU path on the {name} backend (gpu_backend given)"
    from dali_zarr.graph.gpu_pipeline import gpu_status

    usable, found = gpu_status()
    if device == "gpu" and not usable:
        raise ConfigError(
            f"device='gpu' but the GPU path is not usable here: {found}. Use device='auto' "
            "(falls back to the CPU path) or device='cpu'."
        )
    if device == "auto":
        (log.info if usable else log.warning)("%s for device='auto'", found)
    return ("gpu" if usable else "cpu"), found
