"""Observation annotations (AnnData ``obs``) held in memory as flat NumPy columns.

Labels are tiny next to ``X`` (one value per observation), so we load the requested columns
once at open and gather a batch's labels with one vectorized take; no per-row work.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zarr

from dali_zarr.data.elements import as_text, member_names, stale_listing_hint, zarr_member
from dali_zarr.errors import DatasetError
from dali_zarr.io import read_whole, refuse_stale_metadata


@dataclass(frozen=True)
class ObsColumn:
    """One obs column: ``values`` has one entry per observation.

    Categorical columns carry int64 codes in ``values`` (-1 = missing) and the names in
    ``categories``; numeric columns keep their dtype and have ``categories=None``, except
    float16, widened to float32 when read (the loader's graph takes no float16 column; every
    float16 value is exact in float32).
    """

    name: str
    values: np.ndarray
    categories: tuple[str, ...] | None = None
    #: pandas' ``ordered``: the codes' order is the categories' (an ordinal label)
    ordered: bool = False

    @property
    def is_categorical(self) -> bool:
        return self.categories is not None


def batch_dtype(stored: np.dtype) -> np.dtype:
    """The dtype a numeric obs column or obsm entry stored as ``stored`` has in batches:
    native byte order (DALI and torch take the bytes as native, so a big-endian column,
    zarr v2 ``>f8``, would ride as garbage), float16 widened to float32 (see `ObsColumn`).
    Inspect and convert report it too: the stored ``float16`` or ``>f8`` is no tensor's."""
    dtype = np.dtype(stored).newbyteorder("=")
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _batched(values: np.ndarray) -> np.ndarray:
    """``values`` as :func:`batch_dtype` says (no copy where they already are)."""
    return values.astype(batch_dtype(values.dtype), copy=False)


def describe_beside_x(element: str, shape: Sequence[int], stored: np.dtype) -> str:
    """How inspect and convert list an obsm entry that rides beside X:
    ``"obsm/<key> <row shape> <batch dtype>"``."""
    return f"{element} {tuple(shape[1:])} {batch_dtype(stored)}"


def _member(node: zarr.Group | zarr.Array, key: str, *, where: str, encoding: str) -> np.ndarray:
    """Array ``key`` of a column group, read; a missing one named (not zarr's KeyError)."""
    array = zarr_member(node, key, where=where) if isinstance(node, zarr.Group) else None
    if not isinstance(array, zarr.Array):
        raise DatasetError(
            f"{where}: a {encoding} column needs an array {key!r}, which is missing; the "
            "column is incomplete: re-write it from the source data."
        )
    return _read_1d(array, where=f"{where}/{key}")


def _read_1d(array: zarr.Array, *, where: str) -> np.ndarray:
    """The array, read, refused unless 1-D: batches take one value per observation, and a
    2-D column would pass open and fail inside the DALI graph."""
    if array.ndim != 1:
        raise DatasetError(
            f"{where}: has shape {array.shape}, but obs columns are 1-D (one value per "
            "observation). Re-write it; store several values per observation in obsm "
            "(adata.obsm[key] = values) and load them beside X with obs=['obsm/<key>']."
        )
    refuse_stale_metadata(array, name=where)  # a column re-annotated after consolidation
    return read_whole(array, name=where)


# per-cell text (barcodes, ids) as categories would be one per row: the row ids serve better
_TEXT_HINT = (
    ", or, for text that differs per cell (barcodes, ids), pass return_index=True and look "
    "each row's value up by batch['index']."
)


def read_obs_column(obs: zarr.Group, column: str, *, where: str) -> ObsColumn:
    """Read one column of an AnnData ``obs`` dataframe group (anndata >= 0.8 encodings);
    ``where`` names the group in messages (``cells.zarr/obs``)."""
    node = zarr_member(obs, column, where=where)
    if node is None:
        available = ", ".join(sorted(k for k in obs if k != obs.attrs.get("_index")))
        raise DatasetError(
            f"{where}: no column {column!r}; available columns: {available or 'none'}."
            + stale_listing_hint(obs, column)
        )
    where = f"{where}/{column}"
    if column == obs.attrs.get("_index"):  # the row names, not a column of obs
        raise DatasetError(
            f"{where}: is the obs index (obs_names), text, which cannot ride in a batch "
            "tensor; pass return_index=True and look each row's name up by batch['index'] "
            "(anndata.read_zarr(path).obs_names[batch['index']])."
        )
    encoding = node.attrs.get("encoding-type", "array")
    if encoding == "categorical":
        codes = _member(node, "codes", where=where, encoding=encoding)
        if codes.dtype.kind not in "iu":
            raise DatasetError(
                f"{where}/codes: dtype {codes.dtype} is not an integer dtype; category codes "
                "must be integers (anndata refuses others too, and casting would truncate "
                "them). Re-write the column."
            )
        codes = codes.astype(np.int64, copy=False)
        categories = as_text(_member(node, "categories", where=where, encoding=encoding))
        bad = np.flatnonzero((codes < -1) | (codes >= len(categories)))
        if bad.size:
            i = int(bad[0])
            raise DatasetError(
                f"{where}/codes: {bad.size} codes outside [-1, {len(categories)}) (the first at "
                f"row {i}: {codes[i]}), for {len(categories)} categories; the column is "
                "corrupted: re-write it from the source data."
            )
        return ObsColumn(column, codes, categories, ordered=bool(node.attrs.get("ordered")))
    if encoding in ("nullable-integer", "nullable-boolean"):
        values = _batched(_member(node, "values", where=where, encoding=encoding))
        mask = _member(node, "mask", where=where, encoding=encoding).astype(bool)
        if mask.any():
            kind = "booleans" if encoding == "nullable-boolean" else "integers"
            raise DatasetError(
                f"{where}: {int(mask.sum())} missing values in a nullable column (the first "
                f"at row {int(np.argmax(mask))}); batches cannot carry missing {kind}. Fill "
                "them (or make the column categorical) and re-write."
            )
        return ObsColumn(column, values)
    if isinstance(node, zarr.Array) and encoding == "array":
        values = _read_1d(node, where=where)
        if values.dtype.kind not in "biuf":
            raise DatasetError(
                f"{where}: dtype {values.dtype} cannot ride in a batch tensor; "
                f"store it as a categorical column{_TEXT_HINT}"
            )
        return ObsColumn(column, _batched(values))
    raise DatasetError(
        f"{where}: encoding {encoding!r} cannot ride in a batch tensor "
        "(supported: categorical, numeric, nullable without missing values); "
        f"convert it to a categorical column{_TEXT_HINT}"
    )


#: obs "columns" named so are read from the AnnData store's obsm, not obs
OBSM_PREFIX = "obsm/"
#: an obsm entry held in memory beyond this many bytes is warned of (it is held whole)
OBSM_WARN_BYTES = 2**30


def is_obsm(column: str) -> bool:
    """Whether ``column`` names an ``obsm`` entry (``"obsm/spatial"``) rather than an obs
    column: several values per observation, which ride beside ``X`` as one array each."""
    return column.startswith(OBSM_PREFIX)


def read_obsm_entry(obs: zarr.Group, column: str, *, where: str) -> ObsColumn:
    """An AnnData ``obsm`` entry (``column`` = ``"obsm/<key>"``; ``obs`` is the store's
    obs group, beside obsm), read whole as a column of rows: spatial coordinates, a
    protein panel, an embedding, to ride in batches beside ``X`` (``where``: the store).

    Held whole in memory like obs columns, since it is read by the same row take; that
    suits the narrow entries it is for (coordinates: 16 bytes a cell); a wide one (an
    embedding of hundreds of columns on 10^8 cells) is warned of. Dense arrays only: a
    sparse entry or a dataframe is refused, naming how to load it instead."""
    root_path = obs.path.rpartition("/")[0]
    root = zarr.open_group(store=obs.store, path=root_path, mode="r")
    key = column[len(OBSM_PREFIX) :]
    node = zarr_member(root, column, where=where)
    name = f"{where}/{column}"
    if node is None:
        obsm = zarr_member(root, "obsm", where=where)
        # listed as inspect lists it: zarr parses every member, and one it cannot parse
        # raised a bare JSONDecodeError for a mistyped key
        held = member_names(obsm) if isinstance(obsm, zarr.Group) else []
        raise DatasetError(
            f"{name}: not in the store; its obsm entries: {', '.join(held) or 'none'}."
            + stale_listing_hint(root, column)  # added after zarr.consolidate_metadata
        )
    if not isinstance(node, zarr.Array):
        encoding = node.attrs.get("encoding-type", "a group")
        raise DatasetError(
            f"{name}: is {encoding}, not a dense array, so it cannot ride beside X (its rows "
            "are not one array a batch can take). Load it as the dataset itself, "
            f"open_dataset(..., element={column!r}), or store it dense "
            f"(adata.obsm[{key!r}] = adata.obsm[{key!r}].toarray() for a sparse one)."
        )
    if node.ndim < 2:
        raise DatasetError(f"{name}: has shape {node.shape}; an obsm entry is at least 2-D.")
    if node.dtype.kind not in "biuf":  # refused before it is read
        raise DatasetError(
            f"{name}: dtype {node.dtype} cannot ride in a batch tensor; store it as numbers."
        )
    refuse_stale_metadata(node, name=name)
    values = _batched(read_whole(node, name=name))
    if values.nbytes > OBSM_WARN_BYTES:
        warnings.warn(
            f"{name}: is held whole in memory on every rank ({values.nbytes / 2**30:,.1f} "
            "GiB); for an entry this wide, load it as its own dataset "
            f"(open_dataset(..., element={column!r})), read by chunks.",
            stacklevel=4,
        )
    return ObsColumn(column, values)


def changed_by_join(parts: Sequence[np.ndarray], joined: np.ndarray) -> list[int]:
    """Which of ``parts`` their concatenation ``joined`` (in NumPy's or pandas' common
    dtype) no longer holds exactly: int64 beside uint64 or a float becomes float64, which
    rounds integers past 2**53 (ids, hashes) without a word."""
    changed, start = [], 0
    with np.errstate(invalid="ignore", over="ignore"):  # a changed value is the finding
        for i, part in enumerate(parts):
            back = joined[start : start + len(part)].astype(part.dtype)
            if not np.array_equal(back, part, equal_nan=part.dtype.kind == "f"):
                changed.append(i)
            start += len(part)
    return changed


def concat_obs_columns(parts: list[ObsColumn], stores: list[str]) -> ObsColumn:
    """Join one column across the stores of a collection (``stores``: their names).

    Categories are merged in first-seen order and every part's codes are remapped onto
    the merged list, so a code means the same label in every batch. Numeric parts take
    NumPy's common dtype, where every value must survive: int64 beside uint64 or a float
    becomes float64, which rounds integers past 2**53, so such a mix is refused.
    """
    name = parts[0].name
    kinds = ["categorical" if p.is_categorical else "numeric" for p in parts]
    if len(set(kinds)) > 1:
        held = ", ".join(f"{s} ({k})" for s, k in zip(stores, kinds, strict=True))
        raise DatasetError(
            f"obs column {name!r} is categorical in some stores of the collection and numeric "
            f"in others: {held}; make it the same type everywhere."
        )
    if not parts[0].is_categorical:
        shapes = [p.values.shape[1:] for p in parts]
        if len(set(shapes)) > 1:  # obsm entries: np.concatenate's own error names no store
            held = ", ".join(f"{s} {(None, *t)}" for s, t in zip(stores, shapes, strict=True))
            raise DatasetError(
                f"{name!r}: its rows have other shapes in the stores of the collection: "
                f"{held}; store it with one shape per row in every store."
            )
        values = np.concatenate([p.values for p in parts])
        changed = [stores[i] for i in changed_by_join([p.values for p in parts], values)]
        if changed:
            dtypes = ", ".join(
                f"{s} ({p.values.dtype})" for s, p in zip(stores, parts, strict=True)
            )
            raise DatasetError(
                f"obs column {name!r}: joining its dtypes ({dtypes}) gives {values.dtype}, "
                f"which changes values of {', '.join(changed)}; store the column with one "
                "dtype in every store of the collection (or as a categorical)."
            )
        return ObsColumn(name, values)
    merged: dict[str, int] = {}
    remapped = []
    for part in parts:
        assert part.categories is not None
        lookup = np.array(
            [merged.setdefault(c, len(merged)) for c in part.categories] + [-1], dtype=np.int64
        )
        remapped.append(lookup[part.values])  # code -1 indexes the trailing -1: stays missing
    ordered = [p.ordered for p in parts]
    if any(ordered):
        _refuse_other_orders(name, parts, stores, tuple(merged))
    return ObsColumn(name, np.concatenate(remapped), tuple(merged), ordered=all(ordered))


def _refuse_other_orders(
    name: str, parts: list[ObsColumn], stores: list[str], merged: tuple[str, ...]
) -> None:
    """Refuse an ordered categorical (an ordinal label: a model may read its codes as ranks)
    whose stores rank its categories otherwise, or that is ordered in one store and not in
    another: the merged codes would follow the first store's ranking, silently contradicting
    the others'. Stores that add categories in between (``low, high`` and ``low, mid,
    high``) fail too: merged first-seen, ``mid`` would rank above ``high``."""
    rank = {c: i for i, c in enumerate(merged)}
    every_part_ordered = all(p.ordered for p in parts)
    for store, part in zip(stores, parts, strict=True):
        ranks = [rank[c] for c in part.categories or ()]
        if every_part_ordered and ranks == sorted(ranks):
            continue
        held = "; ".join(
            f"{s}: {'ordered' if p.ordered else 'unordered'} {list(p.categories or ())}"
            for s, p in zip(stores, parts, strict=True)
        )
        raise DatasetError(
            f"obs column {name!r}: an ordered categorical must rank its categories the same "
            f"way in every store of the collection, and {store} does not ({held}); the "
            "joined codes would follow the first store's ranking. Re-write the column with "
            "one ordered list of categories in every store (pandas: "
            "s.cat.set_categories([...], ordered=True)), or unordered everywhere."
        )
