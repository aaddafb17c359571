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
