"""Shared fixtures: real stores on disk, written by our synthetic writer, by zarr and by anndata."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from dali_zarr import synthetic

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*zarr v3 autosharding.*")
warnings.filterwarnings("ignore", message=".*Writing zarr v2 data.*")
warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")


@pytest.fixture(scope="session")
def sc_store(tmp_path_factory) -> Path:
    """A small synthetic single-cell store (v3, zstd, sharded)."""
    path = tmp_path_factory.mktemp("stores") / "sc.zarr"
    synthetic.make_single_cell(path, n_obs=3_001, n_features=300, chunk_elements=2_048)
    return path


@pytest.fixture(scope="session")
def odd_csr_store(tmp_path_factory) -> Path:
    """A single-cell store of odd sizes (701 cells x 97 genes), inner chunks of 512 values
    in shards of 4: windows and batches cut chunks at uneven places."""
    path = tmp_path_factory.mktemp("stores") / "odd.zarr"
    synthetic.make_single_cell(path, n_obs=701, n_features=97, chunk_elements=512, shard_chunks=4)
    return path
