"""The ``fn.external_source`` callback: one rank's batches as a pure function of (epoch, iteration).

DALI calls the callback ahead of consumption and past the end of an epoch, and its
checkpointing replays it, so the callback never keeps a cursor: iteration ``i`` of epoch
``e`` always maps to the same window and the same positions through the epoch plan. Reading
is cached and run ahead on a thread pool (windows ``w+1..w+prefetch`` are read while
window ``w`` is consumed, and near the end of an epoch the first windows of the epoch the
loader expects next), which is an optimisation the output never depends on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from dali_zarr.data.dataset import CsrRows, Dataset, DenseRows, sub_indptr
from dali_zarr.errors import ConfigError
from dali_zarr.io.buffers import BufferPool
from dali_zarr.planning import EpochPlan, WindowPlan
from dali_zarr.planning.partition import validate_count, validate_int
from dali_zarr.planning.resume import Segment, plan_resumed_epoch
from dali_zarr.planning.samplers import PlanSettings

Output = Literal["dense", "csr"]
# Which plan a DALI epoch follows: (user epoch, history of interrupted runs of that epoch);
# history () is the normal plan, anything else the remainder of a resumed epoch.
PlanKey = tuple[int, tuple[Segment, ...]]
# A window in the read cache: (DALI epoch, the plan it follows, window index). DALI's epoch is
# part of it so that an epoch repeating the previous epoch's plan reads its windows afresh: a
# served window's buffers may already hold another window (the GPU path's ring).
WindowKey = tuple[int, PlanKey, int]


class Planner(Protocol):
    """What the source needs from a sampler: the plan of one epoch for this rank."""

    def plan_epoch(self, n_obs: int, epoch: int) -> EpochPlan: ...


@dataclass(frozen=True)
class Window:
    """One window read and ready: its rows as arrays the DALI graph consumes directly."""

    plan: WindowPlan
    arrays: tuple[np.ndarray, ...]  # CSR: (data, indices, indptr); dense: (values_2d,)


def validate_prefetch_windows(value: object) -> int:
    """``prefetch_windows`` as an int >= 0 (the GPU source raises it to its read threads
    before this source sees it, so both ask here)."""
    return validate_int("prefetch_windows", value, low=0, what="a non-negative integer")


def obs_list(obs: object) -> list[str]:
    """``obs`` as a list of column names; a bare string is refused (``list("ct")`` would ask
    for the columns 'c' and 't')."""
    if isinstance(obs, str):
        raise ConfigError(f"obs={obs!r}: pass a list of column names, e.g. obs=[{obs!r}].")
    try:
        names = list(obs)  # type: ignore[call-overload]
    except TypeError:  # obs=5: a bare "'int' object is not iterable"
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"obs={obs!r}: pass a list of obs column names (strings).")
    return names


def window_dtype(layout: str, stored: np.dtype) -> np.dtype:
    """The dtype a window's values cross into DALI with.

    DALI's numba plugin takes no float16. Dense float16 windows go as their uint16 bits (the
    row gather only copies them; the graph reinterprets the gathered bits as float16 and
    casts to float32 after it). CSR float16 data is widened to float32 when the window is
    read, since densify adds values.
    """
    stored = np.dtype(stored).newbyteorder("=")
    if stored == np.float16:
        return np.dtype(np.uint16) if layout == "dense" else np.dtype(np.float32)
    return stored


def as_window_array(values: np.ndarray, layout: str, stored: np.dtype) -> np.ndarray:
    """``values`` (a window's data or values) as :func:`window_dtype` of ``stored``."""
    stored = np.dtype(stored).newbyteorder("=")
    wire = window_dtype(layout, stored)
    native = np.ascontiguousarray(values, dtype=stored)
    if wire.itemsize == stored.itemsize and wire.kind != stored.kind:
        return native.view(wire)  # float16 as its bits: no copy
    return native.astype(wire, copy=False)


def window_arrays(dataset: Dataset, rows: CsrRows | DenseRows) -> tuple[np.ndarray, ...]:
    """Rows read by ``dataset.read_rows`` as the window arrays DALI gets (contiguous, native
    byte order, :func:`window_dtype`): CSR (data, indices, indptr) or dense (values_2d,)."""
    if isinstance(rows, CsrRows):
        return (
            as_window_array(rows.data, "csr", dataset.dtype),
            np.ascontiguousarray(rows.indices, dtype=dataset.index_dtype),
            np.ascontiguousarray(rows.indptr, dtype=np.int64),
        )
    assert isinstance(rows, DenseRows)
    values = rows.values.reshape(rows.n_rows, dataset.n_features)
    return (as_window_array(values, "dense", dataset.dtype),)


#: the names a batch gives ``X`` (dense output, or the CSR output's three arrays)
X_NAMES = ("X", "X_data", "X_indices", "X_indptr")


def obs_source_name(column: str) -> str:
    """The callback output that carries obs ``column``: namespaced, so that a column called
    ``pos`` or ``data`` cannot take the place of a window array in the graph."""
    return f"obs:{column}"


def check_obs_names(obs: list[str], *, return_index: bool, where: str) -> None:
    """Refuse obs columns that would collide in the batch dict: asked for twice, or named
    like ``X`` or (with ``return_index``) ``index``."""
    taken = [*X_NAMES, *(["index"] if return_index else [])]
    for i, name in enumerate(obs):
        if name in obs[:i]:
            raise ConfigError(f"{where}: obs column {name!r} is asked for twice; name it once.")
        if name in taken:
            raise ConfigError(
                f"{where}: obs column {name!r} would replace the batch's own {name!r} "
                f"(a batch holds {', '.join(taken)} besides the obs columns); rename the "
                "column in the store's obs"
                + (", or pass return_index=False." if name == "index" else ".")
            )


def source_names(layout: str, output: Output, obs: list[str], return_index: bool) -> list[str]:
    """Names of the callback's outputs, in order (the DALI graph unpacks them by name)."""
    if layout == "csr":
        names = ["pos", "data", "indices", "indptr"]
        names += ["nnz_hint", "batch_indptr"] if output == "csr" else []
    else:
        names = ["pos", "values"]
    return names + [obs_source_name(c) for c in obs] + (["index"] if return_index else [])


class BatchSource:
    """Callback for ``fn.external_source(batch=True, batch_info=True)``.

    Returns, per iteration, one DALI sample per output (a whole minibatch). Maps DALI's
    epoch counter to the user's epoch through :meth:`bind_epoch`, set by the loader before
    DALI starts an epoch, so ``set_epoch`` order never races DALI's look-ahead. A resumed
    epoch is bound with a ``start`` offset (DALI iteration ``i`` is plan batch
    ``i + start``) and, after a restart on another number of ranks, the ``history`` that
    selects the remainder plan; windows before the resume point are never read.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Planner,
        *,
        output: Output,
        obs: list[str],
        return_index: bool,
        prefetch_windows: int = 2,
        prefetch_queue_depth: int = 2,
        read_threads: int = 1,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.output = output
        obs = obs_list(obs)
        check_obs_names(obs, return_index=return_index, where=dataset.name)
        self.obs = {name: dataset.obs_column(name).values for name in obs}
        self.return_index = return_index
        self.names = source_names(dataset.layout, output, list(obs), return_index)
        self.prefetch_windows = validate_prefetch_windows(prefetch_windows)
        prefetch_queue_depth = validate_count("prefetch_queue_depth", prefetch_queue_depth)
        # windows read at once (up to prefetch_windows + 1 are wanted at a time)
        self._pool = ThreadPoolExecutor(
            max_workers=validate_count("read_threads", read_threads),
            thread_name_prefix="dali_zarr-window",
        )
        # reentrant: a signal handler that saves the loader's state (Lightning's SLURM
        # requeue on SIGUSR1) runs on the thread inside this callback and plans under this
        # lock; a plain lock deadlocked it there, and the job hung without its checkpoint
        self._lock = threading.RLock()
        self._epochs: dict[int, tuple[PlanKey, int]] = {}  # DALI epoch_idx -> (plan, start)
        self._stop_at: dict[int, int] = {}  # DALI epoch_idx -> iteration where it was cut short
        self._expected: dict[int, PlanKey] = {}  # DALI epoch_idx -> plan it will likely follow
        self._plans: OrderedDict[PlanKey, EpochPlan] = OrderedDict()
        self._windows: OrderedDict[WindowKey, Future[Window]] = OrderedDict()
        # no_copy=True hands our buffers to DALI: keep the last few batches referenced until
        # DALI's prefetch queue has certainly consumed them (DALI runs at most
        # prefetch_queue_depth iterations ahead; +1 being built, +1 being consumed).
        self._alive: deque[list[np.ndarray]] = deque(maxlen=prefetch_queue_depth + 2)
        # the memory of windows read: reused once no array over it is left (see
        # dali_zarr.io.buffers), so also never while a batch in _alive holds it
        self._buffers = BufferPool()
        self.error: BaseException | None = None

    # -- epoch bookkeeping (called by the loader) ---------------------------------------------

    def bind_epoch(
        self,
        dali_epoch: int,
        epoch: int,
        *,
        history: tuple[Segment, ...] = (),
        start: int = 0,
        next_epoch: int | None = None,
    ) -> None:
        """DALI epoch ``dali_epoch`` yields the plan of (``epoch``, ``history``), its iteration
        ``i`` being plan batch ``i + start``.

        ``next_epoch``: the user epoch the loader expects DALI epoch ``dali_epoch + 1`` to
        follow (from its start). Near the end of this epoch its first windows are read, so
        the next epoch does not begin with a read; a wrong guess costs those reads only.
        """
        key = (int(epoch), tuple(history))
        with self._lock:
            self._epochs[dali_epoch] = (key, int(start))
            self._stop_at.pop(dali_epoch, None)
            self._expected.pop(dali_epoch, None)
            if next_epoch is not None:
                self._expected[dali_epoch + 1] = (int(next_epoch), ())
            self._drop_stale((dali_epoch, key, 0))  # e.g. read ahead for a plan not taken

    def cut_epoch(self, dali_epoch: int, iteration: int) -> None:
        """End DALI epoch ``dali_epoch`` at ``iteration`` (the user left the loop early)."""
        with self._lock:
            self._stop_at[dali_epoch] = iteration

    def plan(self, epoch: int, history: tuple[Segment, ...] = ()) -> EpochPlan:
        key = (int(epoch), tuple(history))
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                try:
                    if history:
                        plan = plan_resumed_epoch(
                            PlanSettings.of(self.sampler),
                            n_obs=self.dataset.n_obs,
                            epoch=epoch,
                            history=history,
                            rank=self.sampler.rank,  # type: ignore[attr-defined]
                            world_size=self.sampler.world_size,  # type: ignore[attr-defined]
                        )
                    else:
                        plan = self.sampler.plan_epoch(self.dataset.n_obs, epoch)
                except ConfigError as exc:  # the planner knows n_obs, not which dataset
                    raise ConfigError(f"{self.dataset.name}: {exc}") from exc
                self._plans[key] = plan
                while len(self._plans) > 3:  # this epoch's, the next one's, a resumed one
                    self._plans.popitem(last=False)
            return plan

    # -- the callback ---------------------------------------------------------------------------

    def __call__(self, info) -> list[list[np.ndarray]]:
        try:
            return self._batch(info.epoch_idx, info.iteration)
        except StopIteration:
            raise
        except BaseException as exc:  # DALI re-wraps callback errors; keep the original
            self.error = exc
            raise

    def _batch(self, dali_epoch: int, iteration: int) -> list[list[np.ndarray]]:
        with self._lock:
            bound = self._epochs.get(dali_epoch)
            stop_at = self._stop_at.get(dali_epoch)
        if bound is None or (stop_at is not None and iteration >= stop_at):
            raise StopIteration
        key, start = bound
        plan = self.plan(*key)
        if iteration + start >= plan.n_batches:
            raise StopIteration
        w, j = plan.window_of_batch(iteration + start)
        window = self.window((dali_epoch, key, w))
        for ahead in self._read_ahead(plan, (dali_epoch, key, w)):
            self._schedule(ahead)
        outputs = self.batch_outputs(window, j)
        self._alive.append(outputs)
        return [[a] for a in outputs]

    def batch_outputs(self, window: Window, j: int) -> list[np.ndarray]:
        """Arrays for batch ``j`` of ``window``, in :attr:`names` order."""
        pos = np.ascontiguousarray(window.plan.batch_positions(j), dtype=np.int64)
        outputs = [pos, *window.arrays]
        if self.dataset.layout == "csr" and self.output == "csr":
            batch_indptr = sub_indptr(window.arrays[2], pos)
            # the hint's shape carries the batch's nnz to the op's setup, no bytes
            outputs += [np.empty((int(batch_indptr[-1]), 0), dtype=np.uint8), batch_indptr]
        return outputs + self.row_outputs(window, j)

    def row_outputs(self, window: Window, j: int) -> list[np.ndarray]:
        """The obs columns and (``return_index``) global ids of batch ``j``'s rows."""
        if not self.obs and not self.return_index:
            return []  # the window's global row map is not even built
        rows = window.plan.batch_global_rows(j)
        outputs = [np.ascontiguousarray(values[rows]) for values in self.obs.values()]
        if self.return_index:
            outputs.append(np.ascontiguousarray(self.dataset.global_ids(rows), dtype=np.int64))
        return outputs

    def read_paths(self) -> dict[str, str]:
        """Which read path serves each array."""
        return self.dataset.read_paths()

    # -- windows --------------------------------------------------------------------------------

    def window(self, wkey: WindowKey) -> Window:
        """The window ``wkey`` (DALI asks for it now), read if it was not read ahead.

        DALI asks in order, so the windows before the previous one will not be asked for
        again; they are dropped, as are windows read ahead for an epoch that did not follow.
        """
        future = self._schedule(wkey)
        with self._lock:
            self._drop_stale(wkey)
        return future.result()

    def _drop_stale(self, wkey: WindowKey) -> None:
        """Cancel and forget every cached window DALI will not ask for once it asks for
        ``wkey``: all but ``wkey``'s predecessor and successors in its epoch, and the windows
        read ahead for the plan expected next. Call with the lock held."""
        dali_epoch, key, w = wkey
        expected = self._expected.get(dali_epoch + 1)
        for k in list(self._windows):
            current = k[0] == dali_epoch and k[1] == key and k[2] >= w - 1
            if not current and not (k[0] == dali_epoch + 1 and k[1] == expected):
                self._windows.pop(k).cancel()

    def _read_ahead(self, plan: EpochPlan, wkey: WindowKey) -> list[WindowKey]:
        """Windows to read while ``wkey`` (of ``plan``) is consumed: the next
        ``prefetch_windows`` of its epoch, and past the epoch's end the first windows of the
        epoch expected next."""
        dali_epoch, key, w = wkey
        last = w + self.prefetch_windows
        ahead = [(dali_epoch, key, a) for a in range(w + 1, min(last + 1, plan.n_windows))]
        spill = last + 1 - plan.n_windows
        with self._lock:
            expected = self._expected.get(dali_epoch + 1)
        if spill > 0 and expected is not None:
            try:
                n_next = self.plan(*expected).n_windows
            except Exception:  # a guess must not fail this epoch (the expected epoch
                return ahead  # raises the same error itself if it is ever run)
            ahead += [(dali_epoch + 1, expected, a) for a in range(min(spill, n_next))]
        return ahead

    def _schedule(self, wkey: WindowKey) -> Future[Window]:
        with self._lock:
            future = self._windows.get(wkey)
            if future is None:
                future = self._pool.submit(self.read_window, wkey)
                self._windows[wkey] = future
            return future

    def read_window(self, wkey: WindowKey) -> Window:
        """Read and decode window ``wkey`` (runs on the prefetch thread)."""
        _, key, w = wkey
        window_plan = self.plan(*key).window(w)
        # each array's reader checks its metadata file around the read (a store rewritten
        # in the middle of an epoch is refused, never served as rows of neither store)
        with self._buffers.active():
            rows = self.dataset.read_rows(window_plan.row_ranges)
        return Window(window_plan, window_arrays(self.dataset, rows))

    def restart(self) -> None:
        """Forget the DALI pipeline fed so far (the loader dropped it): a new one counts its
        epochs from 0 again, which must not find the old one's epochs bound, cut short or
        read ahead (on the GPU path a cached window's ring slot may have been recycled),
        nor the old one's callback error (a Ctrl-C caught in the callback was raised later
        in place of an unrelated error)."""
        with self._lock:
            self.error = None
            self._epochs.clear()
            self._stop_at.clear()
            self._expected.clear()
            for future in self._windows.values():
                future.cancel()
            self._windows.clear()

    def close(self, *, pipeline_gone: bool = False) -> None:
        """Stop the readers and let the windows go: the read-ahead cache held whole windows
        for as long as a closed loader stayed referenced (Lightning keeps its dataloaders).
        The last batches handed to DALI (``no_copy``: it reads our memory) are let go only
        where ``pipeline_gone`` says no DALI pipeline can read them any more."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.restart()  # the windows read ahead (and the GPU path's twin halves) go
        with self._lock:
            self._plans.clear()
            if pipeline_gone:
                self._alive.clear()
        self._buffers.close()
