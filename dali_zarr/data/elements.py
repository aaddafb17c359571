"""Which AnnData element to load: ``X``, ``raw/X``, a layer, an ``obsm`` or ``obsp`` entry.

Models are often trained on something other than ``X``: raw counts in ``layers["counts"]``
while ``X`` holds normalised values, an embedding in ``obsm["X_pca"]``, or ``raw/X``. Every
one of these has observations on axis 0, so the loader reads it exactly like ``X``; only
finding it and checking it belongs to the store's observations differ. ``varm``/``varp``
(features on axis 0) and ``obs``/``var`` themselves are refused.

Works on zarr groups and on h5py files alike (``convert`` reads ``.h5ad``): only ``in``,
``[]``, ``keys()``, ``attrs`` and ``shape`` are used.
"""

from __future__ import annotations

from typing import Any

from dali_zarr.errors import DatasetError

#: Where elements whose rows are observations live, and the form each name takes.
ELEMENT_FORMS = "X, raw/X, layers/<name>, obsm/<name> or obsp/<name>"
_KEYED_GROUPS = ("layers", "obsm", "obsp")


def attribute(node: Any, key: str) -> Any:
    """An attribute as text where h5py hands back bytes."""
    value = node.attrs.get(key)
    return value.decode() if isinstance(value, bytes) else value


def is_array(node: Any) -> bool:
    """A zarr array or an h5py dataset (both have shape and dtype; groups have neither)."""
    return hasattr(node, "shape") and hasattr(node, "dtype")


def _is_matrix(node: Any) -> bool:
    encoding = attribute(node, "encoding-type") or attribute(node, "h5sparse_format")
    return is_array(node) or encoding in ("csr_matrix", "csc_matrix", "csr", "csc")


def available_elements(root: Any) -> list[str]:
    """The loadable elements of an AnnData store, in the form ``element=`` takes."""
    found = [key for key in ("X",) if key in root and _is_matrix(root[key])]
    if "raw" in root and not is_array(root["raw"]) and "X" in root["raw"]:
        found.append("raw/X")
    for group in _KEYED_GROUPS:
        if group in root and not is_array(root[group]):
            members = root[group]
            found += [f"{group}/{k}" for k in sorted(members.keys()) if _is_matrix(members[k])]
    return found


def _rows(node: Any) -> int | None:
    if is_array(node):
        return int(node.shape[0]) if len(node.shape) else None
    shape = node.attrs.get("shape")
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def store_n_obs(root: Any) -> int | None:
    """Number of observations by the store's ``obs`` index (None where it has no obs index)."""
    if "obs" not in root or is_array(root["obs"]):
        return None
    index = attribute(root["obs"], "_index")
    if index is None or index not in root["obs"]:
        return None
    return _rows(root["obs"][index])


def anndata_element(root: Any, element: str, *, store: str) -> Any:
    """The node of ``element`` in the AnnData store ``root`` (named ``store`` in errors).

    Raises DatasetError when the name is not one whose rows are observations, when the store
    lacks it (listing what it has), when it is a dataframe, or when its row count differs
    from the store's obs.
    """
    name = element.strip("/")
    parts = name.split("/")
    well_formed = name in ("X", "raw/X") or (
        len(parts) == 2 and parts[0] in _KEYED_GROUPS and parts[1] != ""
    )
    if not well_formed:
        raise DatasetError(
            f"{store}: element={element!r} is not an element whose rows are observations; "
            f"use {ELEMENT_FORMS} (this store has: {_listing(root)})."
        )
    if name not in root:
        what = "has no 'X'; nothing to load" if name == "X" else f"has no {name!r}"
        raise DatasetError(
            f"{store}: AnnData store {what}. Pass element= one of: {_listing(root)}."
        )
    node = root[name]
    if not is_array(node) and attribute(node, "encoding-type") == "dataframe":
        raise DatasetError(
            f"{store}/{name}: is a dataframe, not a matrix; store the columns to train on as "
            "one numeric array (e.g. adata.obsm[key] = df.to_numpy()) and re-write."
        )
    n_obs, rows = store_n_obs(root), _rows(node)
    if n_obs is not None and rows is not None and rows != n_obs:
        raise DatasetError(
            f"{store}/{name}: has {rows} rows but the store's obs has {n_obs} observations; "
            "the store is inconsistent: re-write it."
        )
    return node


def var_key(element: str) -> str | None:
    """Where the features of ``element`` are named: ``raw/X`` has its own ``raw/var``; ``X``
    and layers share ``var``; ``obsm``/``obsp`` columns have no names."""
    element = element.strip("/")
    if element == "raw/X":
        return "raw/var"
    return "var" if element == "X" or element.startswith("layers/") else None


def _listing(root: Any) -> str:
    return ", ".join(available_elements(root)) or "no loadable element"
