"""JAX adapter: the same DALI pipeline and epochs as :class:`~dali_zarr.Loader`, yielding
``dict[str, jax.Array]``.

Only the two adapter hooks differ from the PyTorch loader: batches come out of DALI's JAX
plugin iterator (``nvidia.dali.plugin.jax.DALIGenericIterator``), which runs with our CPU
pipeline and hands DALI's outputs to JAX through DLPack, on JAX's CPU device (no GPU
needed); planning, ``set_epoch``, ``len`` and leaving a loop early are inherited.

Under several JAX processes (``jax.distributed.initialize``) pass
``DistributedSampler(..., dist_info="jax")``: the rank and world size then come from
``jax.process_index()`` / ``jax.process_count()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import jax
    from jax.experimental import sparse as jsparse
    from nvidia.dali.plugin.jax import DALIGenericIterator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dali_zarr.jax_loader needs jax and DALI's JAX plugin ({exc}); install jax "
        '(pip install "dali-zarr[test]" or pip install jax).'
    ) from exc

from dali_zarr.errors import ConfigError
from dali_zarr.loader import Loader

__all__ = ["JaxLoader"]

_INT32_MAX = np.iinfo(np.int32).max


class _JaxIterator(DALIGenericIterator):
    """DALI's JAX iterator returns one dict; :class:`Loader` expects a list (one per pipe)."""

    def __next__(self) -> list[dict[str, jax.Array]]:
        return [super().__next__()]


class JaxLoader(Loader):
    """Iterate one rank's minibatches of ``dataset`` as ``dict[str, jax.Array]``.

    Takes the arguments of :class:`~dali_zarr.Loader` and yields the same batches (same
    rows, order and epochs for the same sampler and seed): ``batch["X"]`` is
    ``[B, *features]`` or, with ``output="csr"``, a ``jax.experimental.sparse.BCSR`` of
    shape ``[B, n_features]``; obs columns are ``[B]``; ``return_index=True`` adds
    ``batch["index"]``, the global observation ids.

    A BCSR batch's ``nnz`` differs from batch to batch, so a jitted function taking it
    compiles once per distinct shape; for ``jax.jit`` prefer ``output="dense"``.

    Integer widths follow JAX: with its default 32-bit mode (``jax_enable_x64`` off) int64
    outputs (category codes, ``index``, 64-bit obs columns) arrive as int32 and float64 as
    float32. JAX would wrap integers beyond int32 silently, so this loader refuses at
    construction a dataset whose ids or 64-bit integer obs values do not fit in int32 unless
    ``jax.config.update("jax_enable_x64", True)`` was set.
    """

    # -- adapter hooks --------------------------------------------------------------------------

    def _make_iterator(self, pipe, names: list[str]) -> _JaxIterator:
        return _JaxIterator(pipe, names, auto_reset=False, prepare_first_batch=False)

    def _to_batch(self, outputs: dict[str, jax.Array]) -> dict[str, Any]:  # type: ignore[override]
        batch: dict[str, Any] = {name: array[0] for name, array in outputs.items()}  # batch dim
        x = batch.get("X")
        if self.dtype == "float32" and x is not None and x.dtype != jax.numpy.float32:
            batch["X"] = x.astype(jax.numpy.float32)  # a transform made X another dtype
        if self.dtype == "bfloat16":  # DALI hands out bfloat16's uint16 bits
            for name in ("X", "X_data"):
                if name in batch:
                    batch[name] = jax.lax.bitcast_convert_type(batch[name], jax.numpy.bfloat16)
        if "X_data" in batch:
            indptr = batch.pop("X_indptr")
            batch["X"] = jsparse.BCSR(
                (batch.pop("X_data"), batch.pop("X_indices"), indptr),
                shape=(int(indptr.shape[0]) - 1, *self.dataset.feature_shape),
            )
        return batch

    # -- internals ------------------------------------------------------------------------------

    def _check_outputs(
        self, dataset: Any, *, output: str, obs: Sequence[str], return_index: bool
    ) -> None:
        """JAX's 32-bit mode would wrap ids, column ids or obs values beyond int32: refused
        among the ranks' checks (a rank refused after them left the others waiting), unless
        ``jax_enable_x64`` is set."""
        if not jax.config.read("jax_enable_x64"):
            _check_int32_fits(dataset, output=output, obs=obs, return_index=return_index)


def _check_int32_fits(dataset: Any, *, output: str, obs: Sequence[str], return_index: bool) -> None:
    """ConfigError where an output JAX's 32-bit mode would hand out exceeds int32."""
    hint = (
        'call jax.config.update("jax_enable_x64", True) (or set JAX_ENABLE_X64=1) before '
        "creating the loader, so that JAX keeps 64-bit integers."
    )
    n = dataset.n_obs
    if return_index and n:
        last = int(np.max(dataset.global_ids(np.array([0, n - 1], dtype=np.int64))))
        if last > _INT32_MAX:
            raise ConfigError(
                f"{dataset.name}: observation ids reach {last}, beyond int32, and JAX "
                f"runs in 32-bit mode, which would wrap batch['index']; {hint}"
            )
    if output == "csr" and dataset.n_features - 1 > _INT32_MAX:
        raise ConfigError(
            f"{dataset.name}: {dataset.n_features} features, so column ids reach "
            f"{dataset.n_features - 1}, beyond int32, and JAX runs in 32-bit mode, "
            f"which would wrap the BCSR's indices; {hint}"
        )
    for name in obs:
        values = dataset.obs_column(name).values
        if values.dtype.kind in "iu" and values.dtype.itemsize == 8 and len(values):
            low, high = int(values.min()), int(values.max())
            if low < -_INT32_MAX - 1 or high > _INT32_MAX:
                raise ConfigError(
                    f"{dataset.name}: obs column {name!r} holds values in "
                    f"[{low}, {high}], beyond int32, and JAX runs in 32-bit mode, which "
                    f"would wrap them; {hint}"
                )
