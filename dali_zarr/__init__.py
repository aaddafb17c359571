"""dali_zarr: chunked Zarr datasets → DALI → dense (or CSR) minibatches for PyTorch DDP.

Layers, each importable alone: ``planning`` (pure sampling plans), ``io`` (chunk reads and
decode), ``data`` (datasets: AnnData CSR/dense, N-D arrays, collections), ``graph`` (the DALI
callback and ops), and the framework adapter :class:`Loader`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dali_zarr.data.dataset import Collection, CsrDataset, Dataset, DenseDataset, open_dataset
from dali_zarr.data.features import FeatureSubset
from dali_zarr.data.subset import Subset
from dali_zarr.errors import (
    ChunkReadError,
    ConfigError,
    DaliZarrError,
    DatasetError,
    ObservationAxisWarning,
    PackedValuesWarning,
)
from dali_zarr.planning import ChunkSampler, DistributedSampler, EpochPlan, WindowPlan

if TYPE_CHECKING:
    from dali_zarr.graph.pipeline import build_graph, build_pipeline
    from dali_zarr.loader import Loader

# Imported on first use: they pull in torch and DALI (~2 s), which `dali-zarr inspect` and
# `convert` never need.
_LAZY = {
    "Loader": "dali_zarr.loader",
    "build_graph": "dali_zarr.graph.pipeline",
    "build_pipeline": "dali_zarr.graph.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dali_zarr' has no attribute {name!r}")


__all__ = [
    "ChunkReadError",
    "ChunkSampler",
    "Collection",
    "ConfigError",
    "CsrDataset",
    "DaliZarrError",
    "Dataset",
    "DatasetError",
    "DenseDataset",
    "DistributedSampler",
    "EpochPlan",
    "FeatureSubset",
    "Loader",
    "ObservationAxisWarning",
    "PackedValuesWarning",
    "Subset",
    "WindowPlan",
    "build_graph",
    "build_pipeline",
    "open_dataset",
]

__version__ = "0.1.0"
