"""PyTorch adapter: a DALI pipeline per process, iterated as dicts of torch tensors.

The loader owns the moving parts (thread pools, the DALI pipeline, the epoch counter);
planning lives in :mod:`dali_zarr.planning`, reading in :mod:`dali_zarr.io` and
:mod:`dali_zarr.data`, the graph in :mod:`dali_zarr.graph`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from dali_zarr.data.dataset import Dataset
from dali_zarr.errors import ConfigError
from dali_zarr.graph.pipeline import Transform, build_pipeline
from dali_zarr.graph.source import BatchSource, Output, Planner

log = logging.getLogger(__name__)

Device = Literal["cpu", "gpu", "auto"]


class Loader:
    """Iterate one rank's minibatches of ``dataset`` as ``dict[str, torch.Tensor]``.

    ``batch["X"]`` is ``[B, *features]`` (``dtype``, float32 by default) or, with
    ``output="csr"``, a ``torch.sparse_csr_tensor``; every name in ``obs`` gives ``[B]``
    (categorical codes as int64, numeric columns in their dtype); ``return_index=True`` adds
    ``batch["index"]``, the global observation ids. Call :meth:`set_epoch` before each epoch
    to reshuffle, as with torch's ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Planner,
        *,
        device: Device = "cpu",
        output: Output = "dense",
        obs: Sequence[str] = (),
        return_index: bool = False,
        dtype: torch.dtype | np.dtype | str = "float32",
        num_threads: int = 2,
        prefetch_windows: int = 2,
        prefetch_queue_depth: int = 2,
        transform: Transform | None = None,
    ) -> None:
        if output not in ("dense", "csr"):
            raise ConfigError(f"output={output!r}: use 'dense' or 'csr'.")
        if output == "csr" and dataset.layout != "csr":
            raise ConfigError(
                f"output='csr' needs a sparse X, but {dataset.name} is dense; use output='dense'."
            )
        if device not in ("cpu", "gpu", "auto"):
            raise ConfigError(f"device={device!r}: use 'cpu', 'gpu' or 'auto'.")
        if device == "gpu":
            raise ConfigError(
                "device='gpu' is not available in this build yet; use device='cpu' "
                "(device='auto' falls back to it)."
            )
        if device == "auto":
            log.info("dali_zarr: device='auto' picked the CPU path")
        self.device = "cpu"
        self.dataset = dataset
        self.sampler = sampler
        self.output: Output = output
        self.obs = list(obs)
        self.return_index = return_index
        self.dtype = _numpy_dtype(dtype)
        self.num_threads = num_threads
        self.prefetch_queue_depth = prefetch_queue_depth
        self.transform = transform
        self.epoch = 0
        self._source = BatchSource(
            dataset,
            sampler,
            output=output,
            obs=self.obs,
            return_index=return_index,
            prefetch_windows=prefetch_windows,
            keep_alive=prefetch_queue_depth + 2,
        )
        self._iterator: DALIGenericIterator | None = None
        self._names: list[str] = []
        self._dali_epoch = -1  # DALI's epoch counter of the epoch now bound
        self._open_epoch = False  # an epoch was started and not run to its end
        self._consumed = 0  # batches handed out in the open epoch

    # -- public ---------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose plan the next iteration follows (reshuffles)."""
        if epoch < 0:
            raise ConfigError(f"set_epoch({epoch}): epochs are counted from 0.")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch."""
        return self._source.plan(self.epoch).n_batches

    def categories(self, column: str) -> tuple[str, ...] | None:
        """Label names of a categorical obs column: ``categories(c)[code]``."""
        return self.dataset.categories(column)

    def read_paths(self) -> dict[str, str]:
        """Which read path serves each array of the dataset."""
        return self.dataset.read_paths()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        iterator = self._start_epoch()
        while True:
            try:
                outputs = next(iterator)
            except StopIteration:
                self._open_epoch = False
                return
            except Exception as exc:
                raise self._original_error(exc) from exc
            self._consumed += 1
            yield self._to_batch(outputs[0])

    def close(self) -> None:
        self._source.close()

    # -- internals ------------------------------------------------------------------------------

    def _start_epoch(self) -> DALIGenericIterator:
        self._source.plan(self.epoch)  # validate settings before DALI starts calling back
        if self._iterator is None:
            self._dali_epoch = 0
            self._source.bind_epoch(0, self.epoch)
            pipe, self._names = build_pipeline(
                self._source,
                dtype=self.dtype,
                device_id=None,
                num_threads=self.num_threads,
                prefetch_queue_depth=self.prefetch_queue_depth,
                transform=self.transform,
            )
            self._iterator = self._make_iterator(pipe, self._names)
        else:
            if self._open_epoch:  # the last loop was left early: drain what DALI prefetched
                self._source.cut_epoch(self._dali_epoch, self._consumed)
                for _ in self._iterator:
                    pass
            self._dali_epoch += 1
            self._source.bind_epoch(self._dali_epoch, self.epoch)
            self._iterator.reset()
        self._open_epoch = True
        self._consumed = 0
        return self._iterator

    def _make_iterator(self, pipe, names: list[str]):
        """The framework's DALI iterator (an adapter for another framework overrides this)."""
        return DALIGenericIterator([pipe], names, auto_reset=False, prepare_first_batch=False)

    def _original_error(self, exc: Exception) -> BaseException:
        """DALI wraps callback errors in its own; surface ours (they name store and chunk)."""
        error, self._source.error = self._source.error, None
        return error if error is not None else exc

    def _to_batch(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One iterator output → the user's batch dict (adapters override this too)."""
        batch = {name: tensor[0] for name, tensor in outputs.items()}  # drop DALI's batch dim
        if "X_data" in batch:
            indptr = batch.pop("X_indptr")
            batch["X"] = torch.sparse_csr_tensor(
                indptr,
                batch.pop("X_indices"),
                batch.pop("X_data"),
                size=(len(indptr) - 1, *self.dataset.feature_shape),
                check_invariants=False,  # built by our gather op from validated column ids
            )
        return batch


def _numpy_dtype(dtype: torch.dtype | np.dtype | str) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        return torch.empty(0, dtype=dtype).numpy().dtype
    return np.dtype(dtype)
