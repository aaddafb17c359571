"""The synthetic stores' writers (dali_zarr/synthetic.py) on paths that already exist."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from dali_zarr import synthetic
from dali_zarr.errors import ConfigError


def test_make_dense_cube_replaces_a_store_but_never_empties_a_folder(tmp_path: Path) -> None:
    """make_dense_cube wrote with zarr's overwrite=True, which deleted every file in a
    folder given as its path (a user's notes.txt was gone); make_single_cell already
    refused such a folder. Now both replace only a Zarr store."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="not a Zarr store"):
        synthetic.make_dense_cube(folder, n_obs=10, shape=(2,))
    assert (folder / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]

    path = tmp_path / "cube.zarr"
    synthetic.make_single_cell(path, n_obs=30, n_features=20)  # another store: replaced
    for fmt, shards in ((3, None), (2, None), (3, 2)):
        synthetic.make_dense_cube(
            path, n_obs=12, shape=(3,), chunk_obs=4, zarr_format=fmt, shard_chunks=shards, seed=1
        )
        array = zarr.open_array(path, mode="r")
        assert array.metadata.zarr_format == fmt and array.shape == (12, 3)
        expected = np.random.default_rng(1).standard_normal((12, 3), dtype=np.float32)
        np.testing.assert_array_equal(array[...], expected)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
