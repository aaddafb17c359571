"""The DALI graph: external_source → shuffle-gather / densify → named outputs.

:func:`build_pipeline` is public so users can put their own DALI ops after ours (pass
``transform``: it receives the named outputs as DALI ``DataNode``s and returns the dict to
emit); ``pipelines/`` has an example.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.pipeline import Pipeline

from dali_zarr.graph import kernels
from dali_zarr.graph.source import BatchSource, window_dtype

Transform = Callable[[dict], dict]

#: dtypes ``X`` can leave the pipeline in. Numba cannot write float16, so half outputs are a
#: cast after our ops; DALI has no bfloat16, so "bfloat16" leaves as its uint16 bits, which
#: the framework adapter views as bfloat16 (see :func:`convert_x`).
OUTPUT_DTYPES = ("float32", "float16", "float64", "bfloat16")
_CASTS = {"float16": types.FLOAT16, "float64": types.FLOAT64}


def output_dtype_name(dtype: Any) -> str:
    """``dtype`` (NumPy, torch or a name) as one of :data:`OUTPUT_DTYPES`; TypeError if none."""
    name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    if name != "bfloat16":
        with contextlib.suppress(TypeError):  # "f4", np.float32 → "float32"
            name = str(np.dtype(name))
    if name not in OUTPUT_DTYPES:
        raise TypeError(f"dtype={dtype} is not offered; use one of {', '.join(OUTPUT_DTYPES)}.")
    return name


def convert_x(x, dtype: str, feature_shape: tuple[int, ...], to_bfloat16_bits: Callable):
    """float32 ``X`` node → ``dtype`` (a name from :data:`OUTPUT_DTYPES`).

    ``to_bfloat16_bits`` is the device's op from 2-D uint32 bits to uint16 bfloat16 bits
    (:func:`kernels.to_bfloat16_bits` on the CPU, its CUDA twin on the GPU).
    """
    if dtype == "float32":
        return x
    if dtype in _CASTS:
        return fn.cast(x, dtype=_CASTS[dtype])
    bits = fn.reinterpret(x, dtype=types.UINT32)
    if len(feature_shape) != 1:
        bits = fn.reshape(bits, shape=[-1, int(np.prod(feature_shape))])
    out = to_bfloat16_bits(bits)
    if len(feature_shape) != 1:
        out = fn.reshape(out, shape=[-1, *feature_shape])
    return out


def dense_to_float32(x, stored: np.dtype):
    """Gathered dense rows (in :func:`window_dtype` of ``stored``) → float32."""
    stored = np.dtype(stored)
    if stored == np.float16:  # the gather moved float16 bits as uint16
        return fn.cast(fn.reinterpret(x, dtype=types.FLOAT16), dtype=types.FLOAT)
    return x if stored == np.float32 else fn.cast(x, dtype=types.FLOAT)


def source_nodes(source: BatchSource, callback: Callable, names: Sequence[str], device="cpu"):
    """``fn.external_source`` for the callback outputs ``names``, as ``{name: node}``.

    The CPU source and the GPU source's two halves name their outputs alike, so one table
    gives every output's (dtype, ndim). ``no_copy``: windows are ours and stay intact while
    DALI may read them (the CPU source keeps them alive, the GPU ring retires slots late).
    """
    ds = source.dataset
    fixed = {
        "pos": (np.dtype(np.int64), 1),
        "data": (window_dtype("csr", ds.dtype), 1),
        "indices": (np.dtype(ds.index_dtype), 1),
        "indptr": (np.dtype(np.int64), 1),
        "nnz_hint": (np.dtype(np.uint8), 2),
        "batch_indptr": (np.dtype(np.int64), 1),
        "values": (window_dtype("dense", ds.dtype), 2),
        "index": (np.dtype(np.int64), 1),
    }
    layout = [fixed.get(n) or (source.obs[n].dtype.newbyteorder("="), 1) for n in names]
    nodes = fn.external_source(
        source=callback,
        device=device,
        batch=True,
        batch_info=True,
        num_outputs=len(names),
        dtype=[kernels.dali_type(d) for d, _ in layout],
        ndim=[n for _, n in layout],
        no_copy=True,
    )
    return dict(zip(names, nodes, strict=True))


def build_graph(source: BatchSource) -> dict:
    """Declare the graph inside an active pipeline; returns the named output nodes.

    ``X`` is float32 here (sparse output: the batch CSR in the stored dtypes).
    """
    ds = source.dataset
    data_dtype = window_dtype(ds.layout, ds.dtype)
    node = source_nodes(source, source, source.names)
    out: dict = {}
    if ds.layout == "csr" and source.output == "csr":
        out["X_data"], out["X_indices"], out["X_indptr"] = kernels.gather_csr(
            node["nnz_hint"],
            node["pos"],
            node["data"],
            node["indices"],
            node["indptr"],
            data_dtype=data_dtype,
            index_dtype=ds.index_dtype,
        )
    elif ds.layout == "csr":
        out["X"] = kernels.densify_csr(
            node["pos"],
            node["data"],
            node["indices"],
            node["indptr"],
            n_features=ds.n_features,
            data_dtype=data_dtype,
            index_dtype=ds.index_dtype,
        )
    else:
        x = kernels.gather_dense(
            node["pos"], node["values"], n_features=ds.n_features, dtype=data_dtype
        )
        x = dense_to_float32(x, ds.dtype)  # user ops then see float32 X
        if len(ds.feature_shape) != 1:
            x = fn.reshape(x, shape=[-1, *ds.feature_shape])
        out["X"] = x
    for name in source.obs:
        out[name] = node[name]
    if source.return_index:
        out["index"] = node["index"]
    return out


def build_pipeline(
    source: BatchSource,
    *,
    dtype: Any = "float32",
    device_id: int | None = None,
    num_threads: int = 2,
    prefetch_queue_depth: int = 2,
    transform: Transform | None = None,
    enable_checkpointing: bool = False,
    checkpoint: bytes | str | None = None,
) -> tuple[Pipeline, list[str]]:
    """A DALI pipeline yielding one minibatch per iteration, and its output names.

    ``dtype`` of ``X``: float32, float16, float64 or bfloat16 (which leaves DALI as uint16
    bits; view them, e.g. ``torch_tensor.view(torch.bfloat16)``).

    ``device_id=None`` builds a CPU-only pipeline (no CUDA needed). ``enable_checkpointing``
    and ``checkpoint`` are DALI's own (``pipe.checkpoint()`` saves, ``checkpoint=`` restores
    operator state such as the RNG of random ops in ``transform``).
    """
    return assemble_pipeline(
        lambda: build_graph(source),
        dataset=source.dataset,
        to_bfloat16_bits=kernels.to_bfloat16_bits,
        dtype=dtype,
        device_id=device_id,
        num_threads=num_threads,
        prefetch_queue_depth=prefetch_queue_depth,
        transform=transform,
        enable_checkpointing=enable_checkpointing,
        checkpoint=checkpoint,
    )


def assemble_pipeline(
    declare_graph: Callable[[], dict],
    *,
    dataset: Any,
    to_bfloat16_bits: Callable,
    dtype: Any,
    device_id: int | None,
    num_threads: int,
    prefetch_queue_depth: int,
    transform: Transform | None,
    enable_checkpointing: bool,
    checkpoint: bytes | str | None,
) -> tuple[Pipeline, list[str]]:
    """The pipeline around a graph (CPU or GPU): our ops, then ``transform``, then ``X``'s
    dtype conversion last, so user ops compute in float32; returns (pipe, output names)."""
    want = output_dtype_name(dtype)
    pipe = Pipeline(
        batch_size=1,  # one DALI sample is one whole minibatch
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch_queue_depth,
        exec_dynamic=True,
        enable_checkpointing=enable_checkpointing,
        checkpoint=checkpoint,
    )
    with pipe:
        outputs = declare_graph()
        if transform is not None:
            outputs = transform(dict(outputs))
        if "X" in outputs:
            outputs["X"] = convert_x(outputs["X"], want, dataset.feature_shape, to_bfloat16_bits)
        names = list(outputs)
        pipe.set_outputs(*outputs.values())
    return pipe, names
