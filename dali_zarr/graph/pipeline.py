"""The DALI graph: external_source → shuffle-gather / densify → named outputs.

:func:`build_pipeline` is public so users can put their own DALI ops after ours (pass
``transform``: it receives the named outputs as DALI ``DataNode``s and returns the dict to
emit); ``pipelines/`` has an example.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath
from nvidia.dali.pipeline import Pipeline

from dali_zarr.data.elements import CfDecoding, GatherReading, cf_gather_reading
from dali_zarr.errors import ConfigError
from dali_zarr.graph import kernels
from dali_zarr.graph.source import BatchSource, obs_source_name, window_dtype

Transform = Callable[[dict], dict]

#: dtypes ``X`` can leave the pipeline in. Numba cannot write float16 and DALI has no
#: bfloat16, so both halves are our ops writing uint16 bits: float16's are reinterpreted
#: in the graph, bfloat16's viewed by the framework adapter (see :func:`convert_x`).
OUTPUT_DTYPES = ("float32", "float16", "float64", "bfloat16")


def output_dtype_name(dtype: Any) -> str:
    """``dtype`` (NumPy, torch or a name) as one of :data:`OUTPUT_DTYPES`; TypeError if none."""
    if dtype is None:  # np.dtype(None) is float64
        raise TypeError(f"dtype=None is not offered; use one of {', '.join(OUTPUT_DTYPES)}.")
    name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    if name != "bfloat16":
        with contextlib.suppress(TypeError):  # "f4", np.float32 → "float32"
            name = str(np.dtype(name))
    if name not in OUTPUT_DTYPES:
        raise TypeError(f"dtype={dtype} is not offered; use one of {', '.join(OUTPUT_DTYPES)}.")
    return name


def _transformed(transform: Callable, outputs: dict) -> dict:
    """The user's ``transform`` of our output nodes: the dict of nodes to emit (it may add,
    drop or rename them), but a batch CSR's three parts go together: a lone part failed
    later with a KeyError from deep inside, and returning nothing with a TypeError."""
    result = transform(dict(outputs))
    if not isinstance(result, Mapping):
        raise ConfigError(
            f"transform returned {type(result).__name__}, not the dict of output nodes to "
            "emit: change the nodes in the dict it was given and return it "
            "(e.g. o['X'] = ...; return o)."
        )
    csr = ("X_data", "X_indices", "X_indptr")
    kept = [name for name in csr if name in result]
    if kept and len(kept) < len(csr):
        raise ConfigError(
            f"transform returned {', '.join(kept)} without "
            f"{', '.join(n for n in csr if n not in result)}: the batch CSR is built from all "
            "three; return all of them, or none (e.g. a dense 'X' of your own)."
        )
    return dict(result)


def convert_x(
    x, dtype: str, feature_shape: tuple[int, ...], ops: GraphOps, *, transformed: bool = False
):
    """float32 ``X`` node → ``dtype`` (a name from :data:`OUTPUT_DTYPES`); the halves by
    ``ops``' ops on X's device, which take 2-D batches: N-D rows are flattened around them.
    ``transformed``: a user ``transform`` ran, so X's dtype and shape are whatever it made
    them: for the halves X is made float32 first (float16 is rounded from float32, not from
    a float64 the transform may have made) and takes back its own run-time shape. float32
    is left to the framework adapters, which convert only an X the transform made another
    dtype (a DALI cast would copy every batch, float32 or not)."""
    if dtype == "float32":
        return x
    if dtype == "float64":
        return fn.cast(x, dtype=types.FLOAT64)
    if transformed:
        x = fn.cast(x, dtype=types.FLOAT)
        out = ops.float32_to_half(fn.reshape(x, shape=[-1, 1]), dtype)
        return fn.reshape(out, shape=x.shape())
    return through_rows(lambda rows: ops.float32_to_half(rows, dtype), x, feature_shape)


def cf_decoded(x: Any, decoding: CfDecoding) -> Any:
    """float32 ``X`` node decoded as ``open_dataset(..., mask_and_scale=True)`` promises,
    in DALI arithmetic: up to five elementwise ops, a pass over the batch each (cheap on
    the GPU; on the CPU, :meth:`GraphOps.cf_decoded` takes one pass instead). ``_Unsigned``
    words were read as the other signedness by the gather (:func:`cf_gather_reading`),
    before they became float32, where a uint32 word's low bits are lost."""
    assert not decoding.wrap, "cf_gather_reading leaves no wrap to the float32 values"
    missing_to_nan = None
    if decoding.fills:
        keep = None
        for fill in decoding.fills:
            with np.errstate(over="ignore"):  # a float64 fill past float32 is inf, as X is
                kept = x != float(np.float32(fill))  # compared as the float32 values X holds
            keep = kept if keep is None else keep & kept
        missing_to_nan = nan_where_not(keep)
    if decoding.scale != 1.0:
        x = x * float(np.float32(decoding.scale))
    if decoding.offset != 0.0:
        x = x + float(np.float32(decoding.offset))
    return x if missing_to_nan is None else x + missing_to_nan


def nan_where_not(keep: Any) -> Any:
    """A float32 node to add to values shaped like boolean ``keep``: -0 where kept (x + -0
    is x, -0 too), NaN where not: 1 / False is inf and -0 * inf is NaN (IEEE, on both
    devices). DALI has no elementwise select."""
    return -0.0 * (1.0 / keep)


def masked_words(words: Any, reading: GatherReading) -> Any:
    """Gathered ``words`` (of ``reading.dtype``) as float32, NaN where a word lies in one of
    ``reading.word_fills``: compared as same-width signed integers (DALI's constants are
    int64 or float32, so a float64 fill is compared by its bits), before float32 merges a
    fill with its neighbours."""
    width = reading.dtype.itemsize
    signed = kernels.dali_type(np.dtype(f"i{width}"))
    bits = words if reading.dtype == np.dtype(f"i{width}") else fn.reinterpret(words, dtype=signed)
    keep = None
    for low, high in reading.word_fills:
        if low == high:
            kept = bits != types.Constant(low, dtype=signed)
        else:
            below = bits < types.Constant(low, dtype=signed)
            kept = below | (bits > types.Constant(high, dtype=signed))
        keep = kept if keep is None else keep & kept
    return dense_to_float32(words, reading.dtype) + nan_where_not(keep)


def through_rows(op: Callable[[Any], Any], x: Any, feature_shape: tuple[int, ...]) -> Any:
    """``op`` (one of our ops, which take 2-D batches) applied to ``x``, rows of
    ``feature_shape``: N-D rows are flattened around it."""
    if len(feature_shape) == 1:
        return op(x)
    rows = rows_shaped(x, (int(np.prod(feature_shape)),))
    return rows_shaped(op(rows), feature_shape)


def rows_shaped(x: Any, feature_shape: tuple[int, ...]) -> Any:
    """``x`` (rows first) reshaped to ``(rows, *feature_shape)``. DALI infers a ``-1``
    extent from the volume, which a zero-size row (an array shaped ``(n, 3, 0)``) leaves
    undetermined, so there the row count is taken from ``x``'s own shape."""
    if int(np.prod(feature_shape)) != 0:
        return fn.reshape(x, shape=[-1, *feature_shape])
    rows = fn.cast(x.shape()[0:1], dtype=types.INT32)
    return fn.reshape(
        x, shape=fn.cat(rows, fn.constant(idata=list(feature_shape), dtype=types.INT32))
    )


def convert_csr_values(
    data, stored: np.dtype, dtype: str, ops: GraphOps, *, transformed: bool = False
):
    """A batch CSR's values (``X_data``, in :func:`window_dtype` of ``stored``) → ``dtype``,
    so that ``dtype=`` means for ``output="csr"`` what it means for dense ``X``; one
    rounding from the stored values (float64 stays exact), bfloat16 through float32.
    ``transformed``: a ``transform`` ran, so the values' dtype is unknown; float16 is then
    rounded from their float64 (exact for every float32 and every integer up to 2**53)."""
    wire = None if transformed else window_dtype("csr", stored)
    if dtype in ("float32", "float64"):
        if wire is not None and wire == np.dtype(dtype):  # None == dtype("float64") holds
            return data
        return fn.cast(data, dtype=types.FLOAT if dtype == "float32" else types.FLOAT64)
    column = fn.reshape(data, shape=[-1, 1])  # the half ops take 2-D batches
    if dtype == "float16" and wire != np.float32:
        if wire is None:
            column, wire = fn.cast(column, dtype=types.FLOAT64), np.dtype(np.float64)
        return fn.reshape(ops.to_float16(column, dtype=wire), shape=[-1])
    if wire != np.float32:
        column = fn.cast(column, dtype=types.FLOAT)
    return fn.reshape(ops.float32_to_half(column, dtype), shape=[-1])


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
    fixed.update(
        (obs_source_name(c), (v.dtype.newbyteorder("="), v.ndim)) for c, v in source.obs.items()
    )
    layout = [fixed[n] for n in names]
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


@dataclass(frozen=True)
class GraphOps:
    """Our ops on one DALI backend: the CPU kernels, or (``on_gpu``) their numba.cuda twins,
    one launch of ``blocks`` x ``threads`` per minibatch each, with the small host inputs
    moved over by ``.gpu()``. The GPU path's host backend runs its graph with the CPU ops:
    that is how CI runs that graph under a real DALI pipeline without a GPU."""

    on_gpu: bool = False
    blocks: int | None = None  # None: cuda_kernels' defaults
    threads: int | None = None

    @property
    def device(self) -> str:
        return "gpu" if self.on_gpu else "cpu"

    def to_device(self, node):
        return node.gpu() if self.on_gpu else node

    def _cuda(self) -> tuple[Any, dict]:
        from dali_zarr.graph import cuda_kernels  # numba.cuda: only when the graph needs it

        blocks = cuda_kernels.DEFAULT_BLOCKS if self.blocks is None else self.blocks
        threads = cuda_kernels.DEFAULT_THREADS if self.threads is None else self.threads
        return cuda_kernels, {"blocks": blocks, "threads": threads}

    def densify_csr(self, pos, data, indices, indptr, **kw):
        if self.on_gpu:
            K, launch = self._cuda()
            return K.densify_csr_gpu(pos, data, indices, indptr, **kw, **launch)
        return kernels.densify_csr(pos, data, indices, indptr, **kw)

    def gather_csr(self, nnz_hint, batch_indptr, pos, data, indices, indptr, **kw):
        if self.on_gpu:
            K, launch = self._cuda()
            return K.gather_csr_gpu(
                nnz_hint, batch_indptr, pos, data, indices, indptr, **kw, **launch
            )
        return kernels.gather_csr(nnz_hint, batch_indptr, pos, data, indices, indptr, **kw)

    def gather_dense(self, pos, values, *, n_features: int, stored: np.dtype):
        """Rows ``pos`` as stored (in :func:`window_dtype` of ``stored``)."""
        wire = window_dtype("dense", stored)
        if not self.on_gpu:
            return kernels.gather_dense(pos, values, n_features=n_features, dtype=wire)
        K, launch = self._cuda()
        return K.gather_dense_gpu(
            pos, values, n_features=n_features, dtype=wire, out_dtype=wire, **launch
        )

    def gather_dense_float32(self, pos, values, *, n_features: int, stored: np.dtype):
        """Rows ``pos`` as float32 (the CUDA kernel casts as it copies, except float16,
        whose bits it copies for DALI to reinterpret and cast)."""
        wire = window_dtype("dense", stored)
        if not self.on_gpu or wire != np.dtype(stored).newbyteorder("="):
            x = self.gather_dense(pos, values, n_features=n_features, stored=stored)
            return dense_to_float32(x, stored)
        K, launch = self._cuda()
        return K.gather_dense_gpu(
            pos, values, n_features=n_features, dtype=wire, out_dtype=np.float32, **launch
        )

    def float32_to_half(self, x, dtype: str):
        """2-D float32 ``x`` as ``dtype`` ("float16", or "bfloat16" as its uint16 bits for the
        framework to view), rounded to nearest even: our ops take the float32 bits."""
        bits = fn.reinterpret(x, dtype=types.UINT32)
        if dtype == "bfloat16":
            return self.to_bfloat16_bits(bits)
        if self.on_gpu:
            K, launch = self._cuda()
            out = K.float32_bits_to_float16_bits_gpu(bits, **launch)
        else:
            out = kernels.float32_bits_to_float16_bits(bits)
        return fn.reinterpret(out, dtype=types.FLOAT16)

    def to_float16(self, x, *, dtype: np.dtype):
        """2-D ``x`` of ``dtype`` as float16, rounded once to nearest even (our op; see
        kernels._to_float16_bits for why not ``fn.cast``)."""
        if self.on_gpu:
            K, launch = self._cuda()
            bits = K.to_float16_bits_gpu(x, dtype=dtype, **launch)
        else:
            bits = kernels.to_float16_bits(x, dtype=dtype)
        return fn.reinterpret(bits, dtype=types.FLOAT16)

    def cf_decoded(self, x, decoding: CfDecoding, feature_shape: tuple[int, ...]):
        """float32 ``X`` (rows of ``feature_shape``) decoded as :func:`cf_decoded` does:
        on the GPU by its DALI arithmetic, on the CPU by one kernel pass (same values)."""
        if self.on_gpu:
            return cf_decoded(x, decoding)
        assert not decoding.wrap, "cf_gather_reading leaves no wrap to the float32 values"
        params = fn.constant(
            fdata=[decoding.scale, decoding.offset, *map(float, decoding.fills)],
            dtype=types.FLOAT,  # (fn.constant takes no float64) as X compares and computes
        )
        return through_rows(lambda rows: kernels.cf_decode(rows, params), x, feature_shape)

    def to_bfloat16_bits(self, bits):
        """uint16 bfloat16 bits of 2-D float32 ``bits`` (as uint32), shaped like them."""
        if self.on_gpu:
            K, launch = self._cuda()
            return K.to_bfloat16_bits_gpu(bits, **launch)
        return kernels.to_bfloat16_bits(bits)


def declare_ops(source: BatchSource, node: dict, ops: GraphOps) -> dict:
    """Our ops on the source's nodes; returns the named outputs: ``X`` float32
    ``[B, *features]`` (sparse output: ``X_data``/``X_indices``/``X_indptr`` in the stored
    dtypes), obs columns, ``index``, all on ``ops``' device."""
    ds = source.dataset
    pos = ops.to_device(node["pos"])
    csr_types = {"data_dtype": window_dtype(ds.layout, ds.dtype), "index_dtype": ds.index_dtype}
    out: dict = {}
    if ds.layout == "csr" and source.output == "csr":
        out["X_data"], out["X_indices"], out["X_indptr"] = ops.gather_csr(
            ops.to_device(node["nnz_hint"]),
            ops.to_device(node["batch_indptr"]),
            pos,
            node["data"],
            node["indices"],
            node["indptr"],
            **csr_types,
        )
    elif ds.layout == "csr":
        out["X"] = ops.densify_csr(
            pos, node["data"], node["indices"], node["indptr"],
            n_features=ds.n_features, **csr_types,
        )  # fmt: skip
        if np.dtype(ds.dtype) == np.bool_:  # a column id stored twice is True, not 2 (scipy)
            out["X"] = dmath.min(out["X"], 1.0)
    else:
        # _Unsigned words are read as the other signedness before they become float32, and
        # fills float32 cannot tell from their neighbours are compared with the words
        reading = cf_gather_reading(ds.dtype, ds.cf_decoding())
        values = node["values"]
        if reading.dtype != np.dtype(ds.dtype).newbyteorder("="):
            values = fn.reinterpret(values, dtype=kernels.dali_type(reading.dtype))
        if reading.word_fills:
            words = ops.gather_dense(pos, values, n_features=ds.n_features, stored=reading.dtype)
            x = masked_words(words, reading)
        else:
            x = ops.gather_dense_float32(
                pos, values, n_features=ds.n_features, stored=reading.dtype
            )
        if len(ds.feature_shape) != 1:
            x = rows_shaped(x, ds.feature_shape)
        out["X"] = x  # user ops then see float32 X
    for name in source.obs:
        out[name] = ops.to_device(node[obs_source_name(name)])
    if source.return_index:
        out["index"] = ops.to_device(node["index"])
    return out


def build_graph(source: BatchSource) -> dict:
    """Declare the graph inside an active pipeline; returns the named output nodes.

    ``X`` is float32 here (sparse output: the batch CSR in the stored dtypes).
    """
    return declare_ops(source, source_nodes(source, source, source.names), GraphOps())


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

    DALI's epoch ``d`` yields what ``source.bind_epoch(d, epoch)`` bound to it (the Loader
    binds each); an epoch not bound yields no batch (its first run raises StopIteration).

    ``dtype`` of ``X``: float32, float16, float64 or bfloat16 (which leaves DALI as uint16
    bits; view them, e.g. ``torch_tensor.view(torch.bfloat16)``).

    ``device_id=None`` builds a CPU-only pipeline (no CUDA needed). ``enable_checkpointing``
    and ``checkpoint`` are DALI's own (``pipe.checkpoint()`` saves, ``checkpoint=`` restores
    operator state such as the RNG of random ops in ``transform``).
    """
    if not isinstance(source, BatchSource):  # a dataset failed as "has no attribute 'dataset'"
        raise ConfigError(
            f"build_pipeline takes a BatchSource, not {type(source).__name__}: build one "
            "first, BatchSource(dataset, sampler), or let dz.Loader(dataset, sampler) do both."
        )
    return assemble_pipeline(
        lambda: build_graph(source),
        dataset=source.dataset,
        ops=GraphOps(),
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
    ops: GraphOps,
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
        decoding = cf_gather_reading(dataset.dtype, dataset.cf_decoding()).rest  # the gather's done
        if decoding is not None and "X" in outputs:
            outputs["X"] = ops.cf_decoded(outputs["X"], decoding, dataset.feature_shape)
        if transform is not None:
            outputs = _transformed(transform, dict(outputs))
        if "X" in outputs:
            outputs["X"] = convert_x(
                outputs["X"], want, dataset.feature_shape, ops, transformed=transform is not None
            )
        elif "X_data" in outputs:
            outputs["X_data"] = convert_csr_values(
                outputs["X_data"], dataset.dtype, want, ops, transformed=transform is not None
            )
        names = list(outputs)
        pipe.set_outputs(*outputs.values())
    return pipe, names
