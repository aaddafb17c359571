"""The DALI graph: external_source → shuffle-gather / densify → named outputs.

:func:`build_pipeline` is public so users can put their own DALI ops after ours (pass
``transform``: it receives the named outputs as DALI ``DataNode``s and returns the dict to
emit); ``pipelines/`` has an example.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.pipeline import Pipeline

from dali_zarr.graph import kernels
from dali_zarr.graph.source import BatchSource

Transform = Callable[[dict], dict]

# DALI ops can cast to these; numba cannot write float16, so half outputs are a cast.
_OUTPUT_DTYPES = {
    np.dtype(np.float32): types.FLOAT,
    np.dtype(np.float16): types.FLOAT16,
    np.dtype(np.float64): types.FLOAT64,
}


def _source_layout(source: BatchSource) -> list[tuple[np.dtype, int]]:
    """(dtype, ndim) of every callback output, in ``source.names`` order."""
    ds = source.dataset
    fixed = {
        "pos": (np.dtype(np.int64), 1),
        "data": (ds.dtype.newbyteorder("="), 1),
        "indices": (np.dtype(ds.index_dtype), 1),
        "indptr": (np.dtype(np.int64), 1),
        "nnz_hint": (np.dtype(np.uint8), 2),
        "values": (ds.dtype.newbyteorder("="), 2),
        "index": (np.dtype(np.int64), 1),
    }
    return [fixed.get(n) or (source.obs[n].dtype.newbyteorder("="), 1) for n in source.names]


def build_graph(source: BatchSource) -> dict:
    """Declare the graph inside an active pipeline; returns the named output nodes.

    ``X`` is float32 here (sparse output: the batch CSR in the stored dtypes).
    """
    ds = source.dataset
    layout = _source_layout(source)
    nodes = fn.external_source(
        source=source,
        batch=True,
        batch_info=True,
        num_outputs=len(source.names),
        dtype=[kernels.dali_type(d) for d, _ in layout],
        ndim=[n for _, n in layout],
        no_copy=True,  # windows are ours and immutable; `source` keeps them alive
    )
    node = dict(zip(source.names, nodes, strict=True))
    out: dict = {}
    if ds.layout == "csr" and source.output == "csr":
        out["X_data"], out["X_indices"], out["X_indptr"] = kernels.gather_csr(
            node["nnz_hint"],
            node["pos"],
            node["data"],
            node["indices"],
            node["indptr"],
            data_dtype=ds.dtype,
            index_dtype=ds.index_dtype,
        )
    elif ds.layout == "csr":
        out["X"] = kernels.densify_csr(
            node["pos"],
            node["data"],
            node["indices"],
            node["indptr"],
            n_features=ds.n_features,
            data_dtype=ds.dtype,
            index_dtype=ds.index_dtype,
        )
    else:
        x = kernels.gather_dense(
            node["pos"], node["values"], n_features=ds.n_features, dtype=ds.dtype
        )
        if len(ds.feature_shape) != 1:
            x = fn.reshape(x, shape=[-1, *ds.feature_shape])
        out["X"] = x
    if "X" in out and ds.layout == "dense" and ds.dtype != np.float32:
        out["X"] = fn.cast(out["X"], dtype=types.FLOAT)  # user ops then see float32 X
    for name in source.obs:
        out[name] = node[name]
    if source.return_index:
        out["index"] = node["index"]
    return out


def build_pipeline(
    source: BatchSource,
    *,
    dtype: np.dtype | str = "float32",
    device_id: int | None = None,
    num_threads: int = 2,
    prefetch_queue_depth: int = 2,
    transform: Transform | None = None,
    enable_checkpointing: bool = False,
    checkpoint: bytes | str | None = None,
) -> tuple[Pipeline, list[str]]:
    """A DALI pipeline yielding one minibatch per iteration, and its output names.

    ``device_id=None`` builds a CPU-only pipeline (no CUDA needed). ``enable_checkpointing``
    and ``checkpoint`` are DALI's own (``pipe.checkpoint()`` saves, ``checkpoint=`` restores
    operator state such as the RNG of random ops in ``transform``).
    """
    pipe = Pipeline(
        batch_size=1,  # one DALI sample is one whole minibatch
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch_queue_depth,
        exec_dynamic=True,
        enable_checkpointing=enable_checkpointing,
        checkpoint=checkpoint,
    )
    want = np.dtype(dtype)
    if want not in _OUTPUT_DTYPES:
        raise TypeError(f"dtype={want} is not offered; use float32, float16 or float64.")
    with pipe:
        outputs = build_graph(source)
        if transform is not None:
            outputs = transform(dict(outputs))
        if "X" in outputs and want != np.float32:  # last, so user ops compute in float32
            outputs["X"] = fn.cast(outputs["X"], dtype=_OUTPUT_DTYPES[want])
        names = list(outputs)
        pipe.set_outputs(*outputs.values())
    return pipe, names
