"""dali_zarr: chunked Zarr datasets → DALI → dense (or CSR) minibatches for PyTorch DDP.

Layers, each importable alone: ``planning`` (pure sampling plans), ``io`` (chunk reads and
decode), ``data`` (datasets: AnnData CSR/dense, N-D arrays, collections), ``graph`` (the DALI
callback and ops), and the framework adapter :class:`Loader`.
"""

from dali_zarr.data.dataset import Collection, CsrDataset, Dataset, DenseDataset, open_dataset
from dali_zarr.data.subset import Subset
from dali_zarr.errors import ChunkReadError, ConfigError, DaliZarrError, DatasetError
from dali_zarr.graph.pipeline import build_graph, build_pipeline
from dali_zarr.loader import Loader
from dali_zarr.planning import ChunkSampler, DistributedSampler, EpochPlan, WindowPlan

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
    "Loader",
    "Subset",
    "WindowPlan",
    "build_graph",
    "build_pipeline",
    "open_dataset",
]

__version__ = "0.1.0"
