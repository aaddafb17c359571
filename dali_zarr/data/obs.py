"""Observation annotations (AnnData ``obs``) held in memory as flat NumPy columns.

Labels are tiny next to ``X`` (one value per observation), so we load the requested columns
once at open and gather a batch's labels with one vectorized take; no per-row work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zarr

from dali_zarr.errors import DatasetError


@dataclass(frozen=True)
class ObsColumn:
    """One obs column: ``values`` has one entry per observation.

    Categorical columns carry int64 codes in ``values`` (-1 = missing) and the names in
    ``categories``; numeric columns keep their dtype and have ``categories=None``.
    """

    name: str
    values: np.ndarray
    categories: tuple[str, ...] | None = None

    @property
    def is_categorical(self) -> bool:
        return self.categories is not None


def _text(values: np.ndarray) -> tuple[str, ...]:
    return tuple(str(v) for v in np.asarray(values).tolist())


def _native(values: np.ndarray) -> np.ndarray:
    """``values`` in this machine's byte order: DALI and torch take the bytes as native, so a
    big-endian column (zarr v2 ``>f8``) would ride in batches as garbage."""
    return values.astype(values.dtype.newbyteorder("="), copy=False)


def read_obs_column(obs: zarr.Group, column: str, *, where: str) -> ObsColumn:
    """Read one column of an AnnData ``obs`` dataframe group (anndata >= 0.8 encodings);
    ``where`` names the group in messages (``cells.zarr/obs``)."""
    if column not in obs:
        available = ", ".join(sorted(k for k in obs if k != obs.attrs.get("_index")))
        raise DatasetError(
            f"{where}: no column {column!r}; available columns: {available or 'none'}."
        )
    where = f"{where}/{column}"
    node = obs[column]
    encoding = node.attrs.get("encoding-type", "array")
    if encoding == "categorical":
        codes = np.asarray(node["codes"][...]).astype(np.int64, copy=False)
        categories = _text(node["categories"][...])
        bad = np.flatnonzero((codes < -1) | (codes >= len(categories)))
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{where}/codes: {bad.size} codes outside [-1, {len(categories)}) (the first at "
                f"row {i}: {codes[i]}), for {len(categories)} categories; the column is "
                "corrupted: re-write it from the source data."
            )
        return ObsColumn(column, codes, categories)
    if encoding in ("nullable-integer", "nullable-boolean"):
        values = _native(np.asarray(node["values"][...]))
        mask = np.asarray(node["mask"][...]).astype(bool)
        if mask.any():
            raise DatasetError(
                f"{where}: {int(mask.sum())} missing values in a nullable column; batches cannot "
                "carry missing integers. Fill them (or make the column categorical) and re-write."
            )
        return ObsColumn(column, values)
    if isinstance(node, zarr.Array) and encoding == "array":
        values = np.asarray(node[...])
        if values.dtype.kind not in "biuf":
            raise DatasetError(
                f"{where}: dtype {values.dtype} cannot ride in a batch tensor; "
                "store it as a categorical column."
            )
        return ObsColumn(column, _native(values))
    raise DatasetError(
        f"{where}: encoding {encoding!r} cannot ride in a batch tensor "
        "(supported: categorical, numeric, nullable without missing values); "
        "convert it to a categorical column."
    )


def concat_obs_columns(parts: list[ObsColumn]) -> ObsColumn:
    """Join one column across the stores of a collection.

    Categories are merged in first-seen order and every part's codes are remapped onto
    the merged list, so a code means the same label in every batch.
    """
    name = parts[0].name
    if any(p.is_categorical != parts[0].is_categorical for p in parts):
        raise DatasetError(
            f"obs column {name!r} is categorical in some stores of the collection and numeric "
            "in others; make it the same type everywhere."
        )
    if not parts[0].is_categorical:
        return ObsColumn(name, np.concatenate([p.values for p in parts]))
    merged: dict[str, int] = {}
    remapped = []
    for part in parts:
        assert part.categories is not None
        lookup = np.array(
            [merged.setdefault(c, len(merged)) for c in part.categories] + [-1], dtype=np.int64
        )
        remapped.append(lookup[part.values])  # code -1 indexes the trailing -1: stays missing
    return ObsColumn(name, np.concatenate(remapped), tuple(merged))
