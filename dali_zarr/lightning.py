"""Lightning: a ``LightningDataModule`` whose train/validation/test splits are subsets of one
Zarr dataset, each served by a :class:`~dali_zarr.Loader`.

Splits come from a categorical obs column (``split_column="split"`` with values such as
"train"/"val"/"test") or from explicit boolean masks / row-id arrays. Each split is a
:class:`~dali_zarr.Subset`; batches report the store's own observation ids in
``batch["index"]`` (with ``return_index=True``).

- **train**: ``DistributedSampler(shuffle=True, enforce_equal_batches=True)`` over the train
  rows, so every rank runs the same number of complete batches (DDP never waits on a rank
  that ran out). The trainer's epoch reaches the loader: Lightning calls ``set_epoch`` on a
  dataloader's ``batch_sampler.sampler`` before each epoch, and the train loader carries one
  that forwards to :meth:`Loader.set_epoch`, so every epoch is reshuffled.
- **val / test**: unshuffled, ``drop_last=False``, ``enforce_equal_batches=False``: each rank
  reads its contiguous share of the split exactly once; nothing is padded or repeated, so
  metrics summed over ranks are exact. The ranks' shares differ by at most one row, so their
  batch counts by at most one; that is safe as long as the evaluation steps hold no
  collective. Accumulate sums and counts and reduce them once at the end of the epoch (e.g.
  ``self.trainer.strategy.reduce(t, reduce_op="sum")`` in ``on_validation_epoch_end``, or a
  torchmetrics ``Metric``); never ``self.log(..., on_step=True, sync_dist=True)`` in an
  evaluation step. (Lightning's epoch-level ``sync_dist=True`` averages the ranks' means,
  which is not exact when the ranks hold different counts.)
- **predict** (``trainer.predict``): served as val/test are. Its rows are a "predict" split
  where ``splits`` or ``split_labels`` give one (it may share rows with the others), else
  every row of the data, in order (so new data needs no split column);
  ``return_index=True`` maps each prediction to its row.
- An eval split needs at least one observation per rank (Lightning refuses a rank with an
  empty evaluation loader); a smaller one raises a ConfigError. An empty val split (none
  given in ``splits``, or no row with its label) gives no val loader: Lightning skips
  validation, with a warning; an empty test split raises.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn

from dali_zarr.data.dataset import Dataset, Source, open_dataset
from dali_zarr.data.subset import Subset, select_rows
from dali_zarr.distributed import DistInfo, resolve_rank_world, torch_dist_initialized
from dali_zarr.errors import ConfigError, DatasetError
from dali_zarr.graph.source import obs_list
from dali_zarr.inspection import suggested_settings
from dali_zarr.loader import Loader, check_device
from dali_zarr.planning import ChunkSampler, DistributedSampler, PlanSettings
from dali_zarr.planning.partition import Shard, validate_count, validate_sizes

__all__ = ["EvalLoader", "TrainLoader", "ZarrDataModule"]

SPLITS = ("train", "val", "test", "predict")
#: Loader arguments the module sets from its own (a copy in loader_kwargs was a TypeError)
_OWN_LOADER_ARGS = ("dataset", "sampler", "obs", "output", "return_index", "dtype", "device")
_DEFAULT_LABELS: dict[str, str | Sequence[str]] = {"train": "train", "val": "val", "test": "test"}


class _EpochForwarder:
    """What Lightning's ``_set_sampler_epoch`` looks for: ``dataloader.batch_sampler.sampler``
    with a ``set_epoch``. Forwards the trainer's epoch to the loader."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self.sampler = self

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class TrainLoader(Loader):
    """The train :class:`Loader` as Lightning expects a dataloader to look: build this one,
    with the Loader's arguments, for a Lightning train loader of your own (a plain Loader
    is never reshuffled by the trainer, and a resumed one ends its epoch early).

    - ``batch_sampler.sampler.set_epoch`` reaches :meth:`Loader.set_epoch`, so the trainer's
      epoch reshuffles every epoch.
    - ``len()`` is the whole epoch's batch count, also after ``load_state_dict``: Lightning
      saves and restores the loader's state with its checkpoints (the loader implements
      ``state_dict``/``load_state_dict``), restores its own batch counter too, and counts the
      batches still to come itself.
    """

    @property
    def batch_sampler(self) -> _EpochForwarder:
        return _EpochForwarder(self)

    def __len__(self) -> int:
        return self.sampler.num_batches(self.dataset.n_obs)  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """:meth:`Loader.load_state_dict`, refusing an epoch resumed on more ranks than
        Lightning lets finish: Lightning restores its batch counter (the steps the earlier
        runs took) and ends the epoch when it reaches ``len()``, fixed before the state is
        loaded; where a rank still owes more batches than that leaves, the rest of the
        epoch would never be delivered, without a word."""
        super().load_state_dict(state)
        assert self._pending is not None
        history = self._pending.history
        if not history:
            return
        done = sum(max(segment.consumed) for segment in history)
        epoch = self._pending.epoch
        owed = int(self._batch_counts(PlanSettings.of(self.sampler), epoch, history).max())
        whole, world = len(self), self.sampler.world_size  # type: ignore[attr-defined]
        # (a checkpoint of the epoch's last step owes nothing: Lightning ends that epoch
        # at once, whatever its count, and goes on with the next)
        if owed and done + owed > whole:
            raise ConfigError(
                f"cannot resume epoch {epoch} of this checkpoint on {world} ranks under "
                f"Lightning: its runs took {done} steps and each rank still owes up to {owed} "
                f"batches, but Lightning ends the epoch at step {whole} (the epoch's batch "
                f"count on {world} ranks), so the rest of the epoch would never be delivered. "
                "Resume on as many ranks as saved the checkpoint (or fewer), or from a "
                "checkpoint saved at the end of an epoch."
            )


class EvalLoader(Loader):
    """The val/test :class:`Loader` of a :class:`ZarrDataModule`: unshuffled, so it takes
    no epoch."""


class ZarrDataModule(LightningDataModule):
    """Train/val/test loaders over subsets of one Zarr dataset (see the module docstring).

    ``data``: a store path, a Zarr node, a list of them (a collection) or a
    :class:`~dali_zarr.Dataset`; paths are opened in :meth:`setup`, on every rank.

    Splits: ``split_column`` names a categorical (or numeric) obs column and
    ``split_labels`` maps each split to the value(s) that select it (default
    ``{"train": "train", "val": "val", "test": "test"}``); or ``splits`` maps split names
    ("train", "val", "test") to boolean masks or arrays of row ids. Without ``splits`` the
    column defaults to ``"split"``. A label selects a category by its text (``0`` the
    category ``0`` of an integer categorical). Splits may not overlap, from either source.

    Sampling: ``chunk_size``, ``preload_nchunks`` (unset: what ``dali-zarr inspect``
    suggests for the split's rows, from the store's chunking), ``batch_size``
    (``eval_batch_size`` for val/test, default ``batch_size``), ``seed`` (the same on every
    rank; ``None`` draws one on rank 0 and broadcasts it, once per module; Lightning's
    checkpoints keep it, so ``fit(ckpt_path=...)`` resumes with it), ``shard``. Loading: ``obs``
    columns, ``output``, ``return_index``, ``dtype``, ``device`` (``"auto"`` follows the
    trainer: the GPU path on its CUDA device when usable, the CPU path for a CPU trainer),
    and ``loader_kwargs`` for the other :class:`Loader` arguments (``num_threads``,
    ``prefetch_windows``, ``transform``, ...); ``open_kwargs`` go to
    :func:`~dali_zarr.open_dataset` (refused beside a ``data=`` already opened).

    Ranks come from ``dist_info`` (default: ``"torch"`` once torch.distributed is
    initialized, as under ``strategy="ddp"``, otherwise the trainer's ``global_rank`` and
    ``world_size``, otherwise a single process).
    """

    def __init__(
        self,
        *,
        data: Source | Sequence[Source] | Dataset,
        split_column: str | None = None,
        split_labels: Mapping[str, str | int | Sequence[str | int]] | None = None,
        splits: Mapping[str, np.ndarray | Sequence[int] | Sequence[bool]] | None = None,
        chunk_size: int | None = None,
        preload_nchunks: int | None = None,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        seed: int | None = 0,
        shard: Shard = "chunks",
        obs: Sequence[str] = (),
        output: str = "dense",
        return_index: bool = False,
        dtype: Any = "float32",
        device: str = "cpu",
        dist_info: DistInfo | None = None,
        loader_kwargs: Mapping[str, Any] | None = None,
        open_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if splits is not None and split_column is not None:
            raise ConfigError(
                "pass either split_column (splits from an obs column) or splits (masks or "
                "row ids per split), not both."
            )
        if splits is not None and split_labels is not None:  # the labels were ignored
            raise ConfigError(
                "split_labels select rows of split_column; with splits (masks or row ids per "
                "split) they select nothing: pass one or the other."
            )
        if splits is not None:
            unknown = sorted(set(splits) - set(SPLITS))
            if unknown:
                raise ConfigError(f"splits: unknown split name(s) {unknown}; use {SPLITS}.")
        mappings = {"split_labels": split_labels, "splits": splits,
                    "loader_kwargs": loader_kwargs, "open_kwargs": open_kwargs}  # fmt: skip
        for what, value in mappings.items():
            if value is not None and not isinstance(value, Mapping):  # dict() raised bare
                raise ConfigError(f"{what} must be a dict (a mapping by name), got {value!r}.")
        labels = dict(_DEFAULT_LABELS if split_labels is None else split_labels)
        unknown = sorted(set(labels) - set(SPLITS))
        if unknown:
            raise ConfigError(f"split_labels: unknown split name(s) {unknown}; use {SPLITS}.")
        self.data = data
        self.split_column = "split" if splits is None and split_column is None else split_column
        self.split_labels = labels
        self.splits = None if splits is None else dict(splits)
        self.chunk_size = chunk_size
        self.preload_nchunks = preload_nchunks
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.seed = seed
        self.shard = shard
        self.obs = obs_list(obs)
        self.output = output
        self.return_index = return_index
        self.dtype = dtype
        check_device(device)
        self.device = device
        self.dist_info = dist_info
        self.loader_kwargs = dict(loader_kwargs or {})
        taken = [k for k in _OWN_LOADER_ARGS if k in self.loader_kwargs]
        if taken:  # else "got multiple values for keyword argument" when a loader is built
            raise ConfigError(
                f"loader_kwargs: {', '.join(taken)} set by ZarrDataModule itself; pass "
                f"ZarrDataModule({taken[0]}=...) instead (dataset and sampler: data= and the "
                "sampling arguments)."
            )
        self.open_kwargs = dict(open_kwargs or {})
        if isinstance(data, Dataset) and self.open_kwargs:  # setup() opens nothing then:
            # element= or features= were dropped, and the module served all of ds's X
            names = ", ".join(repr(k) for k in self.open_kwargs)
            raise ConfigError(
                f"open_kwargs {names} go to open_dataset, but data= is a Dataset already "
                f"opened ({data.name}), so they would select nothing: pass them when opening "
                "it (dz.open_dataset(path, element=..., features=...)), or pass its path as "
                "data=."
            )
        self.dataset: Dataset | None = data if isinstance(data, Dataset) else None
        self.split_rows: dict[str, np.ndarray] = {}
        # why split_column gave no rows, raised for the splits that need it (predict does not)
        self._split_error: DatasetError | None = None
        self._loaders: dict[tuple[str, int, int], Loader] = {}
        # seed=None: the train seed drawn once (rank 0's), kept in Lightning's checkpoints by
        # state_dict, so that a resumed fit plans the same epochs as the run that saved it
        self._drawn_seed: int | None = None
        # the sampler settings checked now, not at the first batch
        for name, value in (("chunk_size", chunk_size), ("preload_nchunks", preload_nchunks)):
            if value is not None:
                validate_count(name, value)
        validate_count("batch_size", batch_size)
        validate_count("eval_batch_size", self.eval_batch_size)
        # only the train window must hold a batch as given: the val/test loaders raise
        # preload_nchunks to a batch's worth of chunks themselves (see _loader)
        if chunk_size is not None and preload_nchunks is not None:
            validate_sizes(
                chunk_size=chunk_size, preload_nchunks=preload_nchunks, batch_size=batch_size
            )

    # -- Lightning hooks ------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Open the dataset (on every rank) and find the rows of each split."""
        if self.dataset is None:
            self.dataset = open_dataset(self.data, **self.open_kwargs)  # type: ignore[arg-type]
        if not self.split_rows:
            self.split_rows = self._find_split_rows(self.dataset)

    def train_dataloader(self) -> Loader:
        return self._loader("train")

    def val_dataloader(self) -> Loader | list[Loader]:
        """The val loader; none (``[]``: Lightning then skips validation, with a warning) where
        the val split is empty: ``splits`` without "val", or no row with its label (a model's
        ``validation_step`` must not make a datamodule without val rows unusable for fit)."""
        if not self._split_size("val"):
            rank_zero_warn(f"ZarrDataModule: {self._empty_reason('val')}; validation is skipped.")
            return []
        return self._loader("val")

    def test_dataloader(self) -> Loader:
        return self._loader("test")

    def predict_dataloader(self) -> Loader:
        """The predict split's loader (unshuffled, every row once): a "predict" split where
        ``splits``/``split_labels`` give one, else every row of the data."""
        return self._loader("predict")

    def teardown(self, stage: str | None = None) -> None:
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its loaders (DALI pipelines, reader threads: not picklable), as
        Lightning's ``strategy="ddp_spawn"`` sends the module to each rank: a module whose
        loaders were built (``len(dm.train_dataloader())`` before fit) failed with "cannot
        pickle '_queue.SimpleQueue' object". Each process builds its own."""
        state = self.__dict__.copy()
        state["_loaders"] = {}
        return state

    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves of the module in a checkpoint: with ``seed=None``, the seed
        the train loader drew (its position is in the loader's own state, which refuses a
        resume under another seed)."""
        return {} if self._drawn_seed is None else {"seed": self._drawn_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored by Lightning before it asks for the train loader (``fit(ckpt_path=...)``):
        with ``seed=None`` the saved seed is taken instead of drawing a new one. A train
        loader built before (``len(dm.train_dataloader())`` ahead of fit) drew its own seed,
        and the loader's state then refused the resume: it is closed, to be built anew."""
        if self.seed is None and state_dict.get("seed") is not None:
            seed = int(state_dict["seed"])
            if seed != self._drawn_seed:
                for key in [key for key in self._loaders if key[0] == "train"]:
                    self._loaders.pop(key).close()
            self._drawn_seed = seed

    def on_exception(self, exception: BaseException) -> None:
        """A failed fit skips ``teardown``: close the loaders here (their pipelines and read
        threads), so a retry in the same process builds fresh ones instead of leaking them."""
        self.teardown()

    # -- public helpers -------------------------------------------------------------------------

    def subset(self, split: str) -> Subset:
        """The :class:`~dali_zarr.Subset` of one split ("train", "val", "test" or
        "predict")."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; use one of {SPLITS}.")
        self.setup()
        if not self._split_size(split):
            raise ConfigError(f"{self._empty_reason(split)}.")
        assert self.dataset is not None
        return Subset(self.dataset, self.split_rows[split])

    # -- internals ------------------------------------------------------------------------------

    def _split_size(self, split: str) -> int:
        self.setup()
        if self._split_error is not None and split not in self.split_rows:
            raise self._split_error
        return len(self.split_rows.get(split, ()))

    def _empty_reason(self, split: str) -> str:
        if self.splits is not None:
            how = "no rows were given for it in splits"
        elif split not in self.split_labels:
            how = f"split_labels give it no value of {self.split_column!r}"
        else:
            how = (
                f"no observation has {self.split_column}={self.split_labels[split]!r}"
                f"{self._held_values()}"
            )
        return f"split {split!r} is empty: {how}"

    def _held_values(self) -> str:
        """What ``split_column`` holds, for a label that selects no row (a typo,
        "validation" where the column says "val")."""
        if self.dataset is None or self.split_column is None:
            return ""
        column = self.dataset.obs_column(self.split_column)
        held = column.categories
        if held is None:  # numeric: its distinct values, NaN (a row of no split) aside
            held = tuple(v for v in np.unique(column.values).tolist() if v == v)
        shown = ", ".join(repr(v) for v in held[:10]) + (", ..." if len(held) > 10 else "")
        return f" (its values: {shown})"

    def _find_split_rows(self, dataset: Dataset) -> dict[str, np.ndarray]:
        """Each split's rows, from ``splits`` or from ``split_column``'s labels; splits that
        share rows are refused (a row in train and val would leak)."""
        if self.splits is not None:
            # the data's own row ids: a Subset's parent_rows are its stored rows where the
            # data is a subset itself (a QC filter), which subset() then took as the data's
            # rows, so each split delivered other rows than asked (or was refused as out
            # of range)
            rows = {
                name: select_rows(value, dataset.n_obs, f"splits[{name!r}] of {dataset.name}")
                for name, value in self.splits.items()
            }
            what = "splits"
        else:
            what = f"split_labels of {self.split_column!r}"
            try:
                rows = self._rows_by_label(dataset)
            except DatasetError as exc:
                if "predict" in self.split_labels:
                    raise
                # new, unlabeled data has no split column (none at all: a plain array) and
                # predict needs none: it serves every row; the other splits raise this
                self._split_error, rows = exc, {}
        if "predict" not in rows:  # none given: predict on every row, in order
            rows["predict"] = np.arange(dataset.n_obs)
        # predicting on rows of another split (the test rows, or all) is what predict is for
        names = [name for name in rows if name != "predict"]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                shared = np.intersect1d(rows[a], rows[b], assume_unique=True)
                if len(shared):
                    raise ConfigError(
                        f"{what}: {a!r} and {b!r} share {len(shared)} observations (e.g. row "
                        f"{int(shared[0])}); splits must be disjoint."
                    )
        return rows

    def _rows_by_label(self, dataset: Dataset) -> dict[str, np.ndarray]:
        """Rows whose ``split_column`` holds one of each split's labels. Categories are
        text (``ObsColumn.categories``), so a label matches a category by its text: the
        label 0 selects the category 0 of an integer categorical."""
        assert self.split_column is not None
        try:
            column = dataset.obs_column(self.split_column)
        except DatasetError as exc:  # its advice is the Loader's (obs=), not the module's
            default = " (the default without splits=)" if self.split_column == "split" else ""
            raise DatasetError(
                f"ZarrDataModule: the splits come from obs column split_column="
                f"{self.split_column!r}{default}, which the data cannot give ({exc}); pass "
                "split_column= naming a column the data holds, or splits={'train': rows, "
                "'val': rows, ...} (boolean masks or row ids) for data without one."
            ) from exc
        if column.values.ndim != 1:  # an obsm entry: several values per row, no label
            raise DatasetError(
                f"ZarrDataModule: split_column={self.split_column!r} holds "
                f"{column.values.shape[1:]} values per observation, not one label; name an "
                "obs column (or pass splits={'train': rows, ...})."
            )
        rows = {}
        for name, wanted in self.split_labels.items():
            values = [wanted] if np.ndim(wanted) == 0 else list(wanted)  # np.int64(0) too
            if column.categories is not None:
                texts = {str(v) for v in values} | {str(float(v)) for v in values if _real(v)}
                codes = [i for i, c in enumerate(column.categories) if c in texts]
                rows[name] = np.flatnonzero(np.isin(column.values, codes))
            else:
                rows[name] = np.flatnonzero(np.isin(column.values, values))
        return rows

    def _rank_world(self) -> tuple[DistInfo, int, int]:
        dist_info = self.dist_info
        if dist_info is None:
            trainer = self.trainer
            if torch_dist_initialized():
                dist_info = "torch"
            elif trainer is not None:
                rank, world = int(trainer.global_rank), int(trainer.world_size)
                dist_info = lambda: (rank, world)  # noqa: E731
            else:
                dist_info = lambda: (0, 1)  # noqa: E731
        rank, world = resolve_rank_world(dist_info)
        return dist_info, rank, world

    def _device(self) -> dict[str, Any]:
        """The Loader's ``device`` (and ``device_id``): with "auto", the trainer's device."""
        if self.device != "auto":
            return {"device": self.device}
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        root = getattr(strategy, "root_device", None)
        if root is None:
            return {"device": "auto"}
        if root.type != "cuda":
            return {"device": "cpu"}  # a CPU model must not get CUDA batches
        return {"device": "auto", "device_id": root.index}

    def _loader(self, split: str) -> Loader:
        dist_info, rank, world = self._rank_world()
        key = (split, rank, world)
        if key in self._loaders:
            return self._loaders[key]
        subset = self.subset(split)
        train = split == "train"
        batch_size = self.batch_size if train else self.eval_batch_size
        # unset: the suggestion for this split's rows (dali_zarr.inspection), the same on
        # every rank
        chunk_size, preload_nchunks = suggested_settings(
            subset,
            batch_size=batch_size,
            chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks,
            world_size=world,
        )
        if not train:
            if subset.n_obs < world:
                raise ConfigError(
                    f"split {split!r} has {subset.n_obs} observations for {world} ranks: every "
                    "rank needs at least one (Lightning refuses an empty evaluation loader on "
                    "a rank); use fewer devices or a larger split."
                )
            # every rank needs a chunk of its own: the suggestion leaves one, a chunk_size
            # given for training may not; the split is read once, so smaller chunks only
            # cost reads of the same bytes
            chunk_size = min(chunk_size, max(1, subset.n_obs // world))
            # and a window still holds a batch (the planner refuses one that does not)
            preload_nchunks = max(preload_nchunks, math.ceil(batch_size / chunk_size))
        sampler = DistributedSampler(
            ChunkSampler(
                chunk_size=chunk_size,
                preload_nchunks=preload_nchunks,
                batch_size=batch_size,
                shuffle=train,
                drop_last=False,
                seed=(self._drawn_seed if self.seed is None else self.seed) if train else 0,
            ),  # unshuffled (val/test): the seed is unused
            dist_info=dist_info,
            enforce_equal_batches=train,
            shard=self.shard if train else "chunks",
        )
        if train and self.seed is None:
            self._drawn_seed = int(sampler.seed)
        most = PlanSettings.of(sampler).max_world(n_obs=subset.n_obs)
        if train and world > most:  # refused here, with what this module lets you change
            each = max(1, subset.n_obs // world)
            raise ConfigError(
                f"split 'train' has {subset.n_obs} observations for {world} ranks: with "
                f"chunk_size={chunk_size} and batch_size={batch_size} at most {most} ranks get "
                "a chunk and a full batch each (the train loader keeps batch counts equal, as "
                f"DDP steps must match). Pass batch_size and chunk_size of at most {each}, use "
                f"at most {most} devices, or give the train split more rows."
            )
        # a device_id given in loader_kwargs wins over the trainer's device
        kwargs: dict[str, Any] = {**self._device(), **self.loader_kwargs}
        if not train:  # val/test: ranks may differ by a batch; safe because evaluation steps
            # hold no collective (the Loader refuses uneven counts under torch.distributed)
            kwargs["allow_uneven_batches"] = True
        loader = (TrainLoader if train else EvalLoader)(
            subset,
            sampler,
            obs=self.obs,
            output=self.output,  # type: ignore[arg-type]
            return_index=self.return_index,
            dtype=self.dtype,
            **kwargs,
        )
        self._loaders[key] = loader
        return loader

    def __repr__(self) -> str:
        sizes = {name: len(rows) for name, rows in self.split_rows.items()}
        return f"{type(self).__name__}(data={self.data!r}, splits={sizes or 'not set up'})"

    # Lightning's own str() of a datamodule builds every loader and draws a batch from each
    # (a Loader is no torch DataLoader): it cost a batch of the train epoch and, inside a
    # fit, stopped the fit's loop
    __str__ = __repr__


def _real(value: object) -> bool:
    """A number a float category could hold (its text is ``1.0`` for the label 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
