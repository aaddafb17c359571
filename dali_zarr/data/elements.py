"""Which matrix of a store to load: in an AnnData store ``X``, ``raw/X``, a layer, an
``obsm`` or ``obsp`` entry; in a plain Zarr group, one of its arrays.

Models are often trained on something other than ``X``: raw counts in ``layers["counts"]``
while ``X`` holds normalised values, an embedding in ``obsm["X_pca"]``, or ``raw/X``. Every
one of these has observations on axis 0, so the loader reads it exactly like ``X``; only
finding it and checking it belongs to the store's observations differ. ``varm``/``varp``
(features on axis 0) and ``obs``/``var`` themselves are refused.

Works on zarr groups and on h5py files alike (``convert`` reads ``.h5ad``): only ``in``,
``[]``, ``keys()``, ``attrs`` and ``shape`` are used. ``open_dataset`` and ``convert`` both
resolve their input here, so they accept and refuse the same stores with the same words.
"""

from __future__ import annotations

import base64
import contextlib
import os
from typing import Any, Literal, NamedTuple

import numpy as np

from dali_zarr.errors import ConfigError, DatasetError
from dali_zarr.io.layout import missing_codec_advice, unknown_codec_id

#: Where elements whose rows are observations live, and the form each name takes.
ELEMENT_FORMS = "X, raw/X, layers/<name>, obsm/<name> or obsp/<name>"
_KEYED_GROUPS = ("layers", "obsm", "obsp")
#: encoding-type of the sparse matrix groups anndata writes (and older names of them)
_SPARSE_ENCODINGS = ("csr_matrix", "csc_matrix", "csr", "csc")


def attribute(node: Any, key: str) -> Any:
    """An attribute as text where h5py hands back bytes."""
    value = node.attrs.get(key)
    return value.decode() if isinstance(value, bytes) else value


#: CF attributes whose values xarray (and netCDF readers) apply on read and we do not
_PACKING = ("scale_factor", "add_offset", "_Unsigned", "_FillValue", "missing_value")


def packing_attributes(node: Any) -> dict[str, Any]:
    """The CF packing attributes of array ``node`` (``scale_factor``, ``add_offset``,
    ``_Unsigned``, a non-NaN ``_FillValue`` or ``missing_value``), as xarray's ``to_zarr``
    writes them: empty where the stored values are what a reader means. For a v2 array xarray
    keeps ``_FillValue`` in the array's own fill value; it is named when the array is packed
    or written by xarray (``_ARRAY_DIMENSIONS``: a float's -9999 from netCDF is missing there
    as much as in the v3 copy's attribute), not for any other v2 array (zarr's default 0).
    A v3 array's fill value is not one: xarray keeps it in the attributes there, and every v3
    array has a fill value (zarr's default 0), which would name 0 as missing and refuse a
    collection of the v2 and v3 copies of one variable."""
    found = {}
    for key in _PACKING:
        value = _cf_number(node.attrs.get(key))
        if value is not None:
            found[key] = value
    packed = "scale_factor" in found or "add_offset" in found or "_ARRAY_DIMENSIONS" in node.attrs
    v2 = getattr(getattr(node, "metadata", None), "zarr_format", None) == 2
    fill = _cf_number(getattr(node, "fill_value", None)) if v2 else None
    if isinstance(fill, bool):  # zarr's default False of a bool array: no CF fill (xarray
        fill = None  # stores bools as int8 with a "dtype" attribute), nothing to decode
    if packed and "_FillValue" not in found and fill is not None:
        found["_FillValue"] = fill
    return found


def _cf_number(value: Any) -> Any:
    """``value`` as a plain number or text; None for none and NaN. xarray writes a v3 float
    ``_FillValue`` as the base64 of its float64 bytes (``'AAAAAAAA+H8='`` is NaN)."""
    if isinstance(value, str) and len(value) == 12 and value.endswith("="):
        with contextlib.suppress(ValueError):
            value = float(np.frombuffer(base64.b64decode(value, validate=True), "<f8")[0])
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    return value


class CfDecoding(NamedTuple):
    """What ``mask_and_scale=True`` does to a packed array's float32 values in the graph, in
    xarray's order: read signed as unsigned (or back), values equal to a fill become NaN,
    then ``value * scale + offset``.

    ``wrap``: the range of the stored words where ``_Unsigned`` reads them with the other
    signedness: positive for signed words read as unsigned (``"true"``: int8 -1 is 255),
    negative for unsigned words read as signed (``"false"``); 0 for neither. The gather
    does that reading (:func:`cf_gather_reading`), so the float32 ops see no wrap. ``fills``: the
    missing values, already so reinterpreted.
    """

    wrap: int
    fills: tuple[int | float, ...]  # an integer fill as an int: int64's are past float64
    scale: float
    offset: float


def cf_decoding(packing: dict[str, Any], stored: np.dtype, *, name: str) -> CfDecoding | None:
    """The decoding of an array stored as ``stored`` with CF attributes ``packing`` (from
    :func:`packing_attributes`), or None where it has nothing to decode. A value that is not
    a number (text, a list of several scale factors) is refused: decoding by a guess would
    train on wrong numbers without a word."""
    stored = np.dtype(stored)

    def numbers(key: str) -> list[int | float]:  # an int stays exact: an int64 fill
        value = packing.get(key)
        values = list(value) if isinstance(value, list | tuple) else [value]
        found = [v for v in values if v is not None]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in found):
            raise DatasetError(
                f"{name}: its attribute {key}={value!r} is not a number, so "
                "mask_and_scale=True cannot decode it. Fix the attribute, or open the array "
                "with mask_and_scale=False and decode it in a transform=."
            )
        return [v if isinstance(v, int) else float(v) for v in found if not np.isnan(v)]

    wrap = 0
    unsigned = str(packing.get("_Unsigned", "")).strip().lower()
    if stored.kind == "i" and unsigned == "true":
        wrap = 1 << (8 * stored.itemsize)
    elif stored.kind == "u" and unsigned == "false":
        wrap = -(1 << (8 * stored.itemsize))
    fills = []
    # a fill the stored bits can hold in either reading (int8: -128..255); one outside them
    # (a generic -9999) matches no value, and wrapped into the type it would mask a valid one
    held = (-(abs(wrap) // 2), abs(wrap) - 1)
    for fill in numbers("_FillValue") + numbers("missing_value"):
        if wrap and held[0] <= fill <= held[1] and fill == int(fill):  # in the stored type's
            # bits, as the values are: read the same way (int8 -1 is 255)
            bits = np.array(int(fill)).astype(stored)
            fill = int(bits.view(np.dtype(f"{'u' if wrap > 0 else 'i'}{stored.itemsize}")))
        fills.append(fill)
    scale, offset = numbers("scale_factor"), numbers("add_offset")
    for key, found in (("scale_factor", scale), ("add_offset", offset)):
        if len(found) > 1:
            raise DatasetError(
                f"{name}: its attribute {key}={packing[key]!r} holds several numbers; CF "
                "packing takes one. Fix the attribute, or open the array with "
                "mask_and_scale=False and decode it in a transform=."
            )
    decoding = CfDecoding(
        wrap=wrap,
        fills=tuple(dict.fromkeys(fills)),
        scale=float(scale[0]) if scale else 1.0,
        offset=float(offset[0]) if offset else 0.0,
    )
    return None if decoding == CfDecoding(0, (), 1.0, 0.0) else decoding


class GatherReading(NamedTuple):
    """How the row gather reads a dense array's stored words under ``mask_and_scale=True``,
    and what is left to do to the float32 values it makes of them.

    ``dtype``: the type the words are read as (the other signedness where ``_Unsigned``
    says so). ``word_fills``: the fills float32 cannot tell from their neighbours, as
    inclusive ``(low, high)`` ranges of the same-width signed integers that hold their
    bits (one word where low is high): compared with the gathered words before they become
    float32. ``rest``: the decoding left for the float32 values.
    """

    dtype: np.dtype
    word_fills: tuple[tuple[int, int], ...]
    rest: CfDecoding | None


#: integers of this magnitude and above share float32 values with their neighbours
_FLOAT32_EXACT_INTEGERS = 1 << 24
#: ... and float64 values, from this magnitude on
_FLOAT64_EXACT_INTEGERS = 1 << 53


def cf_gather_reading(stored: np.dtype, decoding: CfDecoding | None) -> GatherReading:
    """The :class:`GatherReading` of ``stored`` words decoded by ``decoding``.

    Where ``_Unsigned`` reinterprets integers (``wrap``), their bits are read as the other
    signedness (a view, no copy) and ``wrap`` drops out: made float32 first, a uint32 word
    4294967295 (-1 under ``_Unsigned="false"``) rounds to 2**32 and the wrap took it to 0.

    A fill is compared as xarray compares it: xarray makes 32/64-bit integers float64 and
    then compares. In float32 that is exact for bytes, shorts, halves and floats, and for
    32/64-bit integers below 2**24 in magnitude. The others (netCDF's int fill -2147483647,
    any float64 fill) are compared as words: in float32, -2147483600 is -2147483647 and a
    valid value became NaN. A 64-bit integer fill of 2**53 or more matches every word
    float64 rounds to it, as in xarray: its to_zarr stores netCDF's int64 fill
    -9223372036854775806 as the word -2**63 (the fill made float64, then int64), which it
    reads back as missing. An integer fill no word can match (2.5, or past the type's
    range) is dropped.
    """
    stored = np.dtype(stored).newbyteorder("=")  # as windows hold them: a v2 ">f8" too
    if decoding is None:
        return GatherReading(stored, (), None)
    dtype = stored
    if decoding.wrap:
        dtype = np.dtype(f"{'u' if decoding.wrap > 0 else 'i'}{stored.itemsize}")
    word_fills: list[tuple[int, int]] = []
    float32_fills: list[float] = []
    for fill in decoding.fills:
        if dtype.kind in "iu" and dtype.itemsize >= 4:
            if abs(fill) < _FLOAT32_EXACT_INTEGERS:
                float32_fills.append(fill)
            else:
                word_fills += _signed_ranges(_words_equal_in_float64(fill, dtype), dtype)
        elif dtype == np.float64:  # 0.0 equals -0.0, whose bits differ
            for same in (0.0, -0.0) if fill == 0 else (fill,):  # (a set holds one of them)
                bits = int(np.float64(same).view(np.int64))
                word_fills.append((bits, bits))
        else:
            float32_fills.append(fill)
    rest = decoding._replace(wrap=0, fills=tuple(float32_fills))
    return GatherReading(
        dtype, tuple(word_fills), None if rest == CfDecoding(0, (), 1.0, 0.0) else rest
    )


def _words_equal_in_float64(fill: float, dtype: np.dtype) -> tuple[int, int] | None:
    """The inclusive range of ``dtype`` integers ``w`` with ``float64(w) == float64(fill)``
    (xarray's comparison), or None where there is none (2.5; past the type's range)."""
    limits = np.iinfo(dtype)
    target = float(fill)
    if not target.is_integer():
        return None
    if abs(target) < _FLOAT64_EXACT_INTEGERS:  # one word, if the type holds it
        word = int(target)
        return (word, word) if limits.min <= word <= limits.max else None
    # the integers that round (to nearest, ties to even) to target lie between the midpoints
    # to its float64 neighbours; Python's int -> float rounds as NumPy's cast does
    below = int(np.nextafter(target, -np.inf))
    above = int(np.nextafter(target, np.inf))
    low, high = -(-(below + int(target)) // 2), (int(target) + above) // 2
    low, high = max(low, limits.min), min(high, limits.max)
    while low <= high and float(low) != target:
        low += 1
    while high >= low and float(high) != target:
        high -= 1
    return (low, high) if low <= high else None


def _signed_ranges(words: tuple[int, int] | None, dtype: np.dtype) -> list[tuple[int, int]]:
    """Inclusive ``dtype`` word range ``words`` as ranges of the same-width signed integers
    holding their bits (an unsigned range across 2**(bits-1) wraps: two ranges)."""
    if words is None:
        return []
    low, high = words
    if dtype.kind == "i":
        return [(low, high)]
    half = 1 << (8 * dtype.itemsize - 1)

    def signed(word: int) -> int:
        return word - 2 * half if word >= half else word

    if low < half <= high:
        return [(signed(low), half - 1), (signed(half), signed(high))]
    return [(signed(low), signed(high))]


def is_array(node: Any) -> bool:
    """A zarr array or an h5py dataset (both have shape and dtype; groups have neither)."""
    return hasattr(node, "shape") and hasattr(node, "dtype")


def _is_matrix(node: Any) -> bool:
    encoding = attribute(node, "encoding-type") or attribute(node, "h5sparse_format")
    return is_array(node) or encoding in _SPARSE_ENCODINGS


def available_elements(root: Any) -> list[str]:
    """The loadable elements of an AnnData store, in the form ``element=`` takes."""
    found = [key for key in ("X",) if key in root and _is_matrix(root[key])]
    if "raw" in root and not is_array(root["raw"]) and "X" in root["raw"]:
        found.append("raw/X")
    for group in _KEYED_GROUPS:
        if group in root and not is_array(root[group]):
            members = root[group]
            for key in member_names(members):
                try:
                    node = zarr_member(members, key, where=group)
                except DatasetError:  # metadata zarr cannot parse: not loadable
                    continue
                if node is not None and _is_matrix(node):
                    found.append(f"{group}/{key}")
    return found


def member_names(group: Any) -> list[str]:
    """``group.keys()``, sorted. zarr lists a group by parsing every member's metadata, so one
    member it cannot parse failed the listing (inspect, and the errors that list a store's
    elements, raised a bare JSONDecodeError): then a local store's folder is listed."""
    try:
        return sorted(group.keys())
    except (ValueError, TypeError, KeyError):
        from dali_zarr.io import local_directory

        directory, _ = local_directory(group)
        if directory is None:
            raise
        return sorted(e.name for e in os.scandir(directory) if e.is_dir())


def _valid_shape(shape: Any) -> tuple[int, int] | None:
    """``shape`` as two non-negative ints, or None where it is not that (a float would be
    truncated by ``int()``, text would fail deep in the loader)."""
    if not isinstance(shape, list | tuple | np.ndarray) or len(shape) != 2:
        return None
    if not all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in shape):
        return None
    rows, cols = (int(s) for s in shape)
    return (rows, cols) if rows >= 0 and cols >= 0 else None


def _shape_of(node: Any) -> Any:
    """A sparse matrix group's recorded shape: ``shape``, or ``h5sparse_shape`` (anndata
    before 0.7 wrote h5sparse groups, which :func:`matrix_layout` takes as CSR too)."""
    return node.attrs.get("shape", node.attrs.get("h5sparse_shape"))


def shape_attribute(node: Any, *, where: str) -> tuple[int, int]:
    """The ``shape`` attribute of a sparse matrix group (its only record of the width)."""
    shape = _valid_shape(_shape_of(node))
    if shape is None:
        raise DatasetError(
            f"{where}: 'shape' attribute is {_shape_of(node)!r}; a csr_matrix group "
            "needs two non-negative integers [n_obs, n_features]. Set it to the matrix's "
            "real shape, or re-write the matrix."
        )
    return shape


def zarr_member(group: Any, key: str, *, where: str) -> Any:
    """``group[key]`` of a zarr group, or None where nothing is stored there (``where``: the
    group's name in messages).

    Metadata that cannot be parsed is named here: zarr raises JSONDecodeError, TypeError or
    a KeyError of a metadata field for it, naming no node (and ``in``/``get`` call it
    missing). zarr's own "not there" is a KeyError raised from FileNotFoundError (a store
    read) or from KeyError (consolidated metadata). A path is walked one name at a time:
    through an array there is nothing, where consolidated metadata raises a bare KeyError."""
    head, _, rest = key.strip("/").partition("/")
    if rest:
        parent = zarr_member(group, head, where=where)
        if parent is None or is_array(parent):
            return None
        return zarr_member(parent, rest, where=f"{where}/{head}")
    try:
        return group[key]
    except KeyError as exc:
        if isinstance(exc.__cause__, FileNotFoundError | KeyError):
            return None
        error: Exception = exc
    except Exception as exc:  # zarr raises many types for bad metadata
        error = exc
    codec = unknown_codec_id(error)
    if codec is not None:  # intact metadata naming a codec no package here registers
        raise DatasetError(
            f"{where}/{key}: {missing_codec_advice(codec)} (its Zarr metadata names it; "
            f"{type(error).__name__}: {error})."
        ) from error
    raise DatasetError(
        f"{where}/{key}: its Zarr metadata cannot be read ({type(error).__name__}: {error}); "
        "the store is corrupted there: restore that node's zarr.json (v3) or .zarray/.zgroup/"
        ".zattrs (v2), or re-write the store."
    ) from error


def frame_index(frame: Any, *, where: str) -> Any:
    """The array of a Zarr dataframe group's index (``_index`` attribute), one entry per
    row: a plain array (anndata 0.12, or 0.13 with object strings), the ``values`` array
    of anndata 0.13's ``nullable-string-array`` group (pandas 3's strings), or the codes of
    a categorical index (a ``pd.CategoricalIndex``). None where there is none. Zarr only
    (it names unreadable metadata through :func:`zarr_member`)."""
    return index_array(_index_node(frame, where=where))


def frame_index_names(frame: Any, *, where: str) -> tuple[str, ...] | None:
    """The names of a Zarr dataframe group's index rows, as anndata reads them (a
    categorical index's rows by their codes; a missing one is ``"nan"``, as pandas prints
    it); None where there is no index."""
    node = _index_node(frame, where=where)
    rows = index_array(node)  # the names, or a categorical index's codes
    if rows is None:
        return None
    if not _is_categorical(node):
        return as_text(rows[...])
    categories = text_values(node["categories"]) if "categories" in node else None
    if categories is None:
        return None
    labels = np.array([*as_text(categories[...]), "nan"], dtype=object)
    codes = np.asarray(rows[...]).astype(np.int64)
    return tuple(labels[np.where(codes < 0, len(labels) - 1, codes)].tolist())


def _index_node(frame: Any, *, where: str) -> Any:
    key = attribute(frame, "_index")
    return zarr_member(frame, key, where=where) if isinstance(key, str) else None


def _is_categorical(node: Any) -> bool:
    return (
        node is not None
        and not is_array(node)
        and attribute(node, "encoding-type") == "categorical"
        and "codes" in node
    )


def index_array(node: Any) -> Any:
    """A dataframe index node's array of one entry per row: :func:`text_values`, or a
    categorical index's codes. Plain ``in`` and ``[]``, so it serves h5py groups too."""
    if _is_categorical(node):
        return node["codes"] if is_array(node["codes"]) else None
    return text_values(node)


def as_text(values: np.ndarray) -> tuple[str, ...]:
    """Names (var index, category labels) as text, as pandas prints them, so that stores of
    a collection merge labels by what they mean, not by how they were stored:

    - fixed-length bytes (``S`` dtype, older tools) are decoded as UTF-8 (``str`` gave
      ``"b'g1'"``, which matched no name anndata reads);
    - floats by the shortest text of their own precision (float32 0.1 is ``0.1``, not the
      ``0.10000000149011612`` of its float64 value);
    - dates whatever their stored unit (:func:`_timestamp_text`; anndata 0.12 writes ns,
      0.13 us, and ns values came out as integers).
    """
    values = np.asarray(values)
    if values.dtype.kind == "M":
        return _timestamp_text(values)
    if values.dtype.kind == "f":
        return tuple(str(v) for v in values.reshape(-1))
    return tuple(
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values.tolist()
    )


def _timestamp_text(values: np.ndarray) -> tuple[str, ...]:
    """``datetime64`` values as ``str(pandas.Timestamp)`` writes them: ``YYYY-MM-DD
    HH:MM:SS``, then 6 digits where the microseconds are not 0 and 9 where the nanoseconds
    are not (units finer than nanoseconds are cut to them)."""
    unit = np.datetime_data(values.dtype)[0]
    fine = "ns" if unit in ("ns", "ps", "fs", "as") else "us"
    exact = values.astype(f"datetime64[{fine}]").reshape(-1)
    seconds = exact.astype("datetime64[s]")  # floors, also before 1970
    fraction = (exact - seconds).astype(np.int64)  # in `fine` units, >= 0
    per_us = 1000 if fine == "ns" else 1
    texts = []
    stamps = np.datetime_as_string(seconds, unit="s").tolist()
    for stamp, part in zip(stamps, fraction.tolist(), strict=True):
        text = str(stamp)
        if text != "NaT":
            text = text.replace("T", " ")
            if part % per_us:
                text += f".{part:09d}"
            elif part:
                text += f".{part // per_us:06d}"
        texts.append(text)
    return tuple(texts)


def text_values(node: Any) -> Any:
    """A dataframe's index (or text column) node as the array of its values: the node
    itself, or the ``values`` array of anndata 0.13's ``nullable-string-array`` group; None
    otherwise.
    Plain ``in`` and ``[]``, so it serves h5py groups too (:func:`store_n_obs`)."""
    if node is not None and not is_array(node):
        if attribute(node, "encoding-type") != "nullable-string-array" or "values" not in node:
            return None
        node = node["values"]
    return node if is_array(node) else None


def _rows(node: Any) -> int | None:
    if is_array(node):
        return int(node.shape[0]) if len(node.shape) else None
    shape = _valid_shape(_shape_of(node))
    return None if shape is None else shape[0]


def store_n_obs(root: Any) -> int | None:
    """Number of observations by the store's ``obs`` index (None where it has no obs index)."""
    if "obs" not in root or is_array(root["obs"]):
        return None
    index = attribute(root["obs"], "_index")
    if index is None or index not in root["obs"]:
        return None
    node = index_array(root["obs"][index])
    return None if node is None else _rows(node)


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
    try:
        present = name in root
    except (ValueError, TypeError, KeyError):  # zarr parses the node's metadata to answer
        zarr_member(root, name, where=store)  # raises the DatasetError naming that node
        raise
    if not present:
        what = "has no 'X'; nothing to load" if name == "X" else f"has no {name!r}"
        raise DatasetError(
            f"{store}: AnnData store {what}. Pass element= one of: {_listing(root)}."
            + stale_listing_hint(root, name)
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


class Picked(NamedTuple):
    """The matrix :func:`pick_element` found: its node, its key in the store (None: the
    store is that array), and whether the store is an AnnData store (obs, var)."""

    node: Any
    key: str | None
    anndata: bool


def pick_element(
    root: Any, element: str | None, *, store: str, anndata: bool | None = None
) -> Picked:
    """The matrix ``element`` names in the opened store ``root`` (an array, an AnnData
    store, or a plain group), named ``store`` in errors.

    AnnData: ``element`` or ``"X"`` (:func:`anndata_element`). A plain group: the array at
    the path ``element``, which must be given. An array: ``element`` must not be given.
    ``anndata``: whether ``root`` is an AnnData store; None: by its ``encoding-type``
    attribute (an ``.h5ad`` file is AnnData whatever its attributes say).
    """
    if is_array(root):
        if element is not None:
            raise ConfigError(
                f"{store}: is a Zarr array, so element={element!r} has nothing to pick from; "
                "drop element= (--element on the command line)."
            )
        _refuse_sparse_member(_parent_group(root), store)
        return Picked(root, None, False)
    encoding = attribute(root, "encoding-type")
    if anndata or (anndata is None and encoding == "anndata"):
        key = (element or "X").strip("/")
        return Picked(anndata_element(root, key, store=store), key, True)
    # AnnData stores written inside a plain group (anndata's write_elem(group, "sample1", ...))

    def inside() -> str:  # only errors say it: the listing opens every member
        nested = [f"{store}/{k}" for k in _nested_anndata(root)]
        return f" It holds AnnData stores: open one of {', '.join(nested)}." if nested else ""

    if element is None and encoding in _SPARSE_ENCODINGS:
        # its arrays (data, indices, indptr) are no observations: loading one is no advice
        raise DatasetError(
            f"{store}: is a sparse matrix group (encoding-type {encoding!r}), an element of an "
            "AnnData store, not a store: open the AnnData store that holds it and name the "
            "matrix with element= (e.g. dz.open_dataset('cells.zarr', element='layers/counts'); "
            "X is the default; `dali-zarr inspect cells.zarr` lists the elements)."
        )
    if element is None:
        arrays = _arrays_in(root)
        listing = _listing_of(arrays)
        coords = _coordinates(root, arrays)
        data = [a for a in arrays if a not in coords] or arrays
        hint = f" To load one of its arrays, pass element={data[0]!r}{listing}." if arrays else ""
        if coords and len(data) < len(arrays):  # xarray's coordinates: labels, no samples
            are = "are coordinates" if len(coords) > 1 else "is a coordinate"
            hint += f" {', '.join(coords)} {are} (xarray's, not data variables)."
        raise DatasetError(
            f"{store}: is a Zarr group but neither an AnnData store (root attribute "
            f"'encoding-type' is {encoding!r}, expected 'anndata') nor an array."
            f"{_enclosing_store_hint(root) or hint}{inside()}"  # its arrays: no advice there
        )
    key = element.strip("/")
    if any(part in (".", "..") for part in key.split("/")):  # zarr raises a bare ValueError
        raise DatasetError(
            f"{store}: element={element!r} is not a path zarr takes: give the array's path "
            f"from the group's root, without '.' or '..' segments{_listing_of(_arrays_in(root))}."
        )
    node = zarr_member(root, key, where=store) if key else None
    if node is not None and not is_array(node):  # a subgroup: name the arrays under it
        kind = attribute(node, "encoding-type")
        encoded = f" (encoding-type {kind!r})" if kind else ""
        inner = [] if kind else [f"{key}/{a}" for a in _arrays_in(node)]
        held = f" (arrays in it: {_names(inner)})" if inner else ""
        raise DatasetError(
            f"{store}: {element!r} is a group{encoded}, not an array{held}; pass element= the "
            f"path of an array.{inside()}"
        )
    if node is None:
        raise DatasetError(
            f"{store}: has no array {element!r}{_listing_of(_arrays_in(root))}; pass "
            f"element= the path of one.{inside()}" + stale_listing_hint(root, key)
        )
    parent = root
    if "/" in key:
        with contextlib.suppress(DatasetError, ConfigError):  # it was found, so is its group
            parent = zarr_member(root, key.rsplit("/", 1)[0], where=store)
    _refuse_sparse_member(parent, store)
    return Picked(node, key, False)


def _parent_group(array: Any) -> Any:
    """The group holding ``array`` (None where it has none): in its own store where the
    array sits below the store's root (a node opened from a store), else the folder above
    a local store's (an array opened by its own path)."""
    import zarr

    from dali_zarr.io import local_directory

    path = str(getattr(getattr(array, "store_path", None), "path", "") or "").strip("/")
    try:
        if path:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            return zarr.open_group(store=array.store, path=parent, mode="r")
        directory, _ = local_directory(array)
        if directory is None:
            return None
        return zarr.open_group(os.path.dirname(os.path.normpath(directory)), mode="r")
    except Exception:  # no group above it (a store of its own), or an h5py dataset
        return None


def _refuse_sparse_member(parent: Any, store: str) -> None:
    """DatasetError where the array picked is ``data``, ``indices`` or ``indptr`` of a
    sparse matrix group: one entry per stored non-zero (or row), not per observation, so
    each "row" of a batch would be one non-zero, trained on as a sample, without an error."""
    if parent is None or is_array(parent):
        return
    encoding = attribute(parent, "encoding-type")
    if encoding not in _SPARSE_ENCODINGS:
        return
    raise DatasetError(
        f"{store}: is an array of a sparse matrix group (encoding-type {encoding!r}): it holds "
        "one entry per stored non-zero (or per row offset), not one per observation. Open "
        "the AnnData store that holds the matrix and name it with element= (e.g. "
        "dz.open_dataset('cells.zarr', element='layers/counts'); X is the default; "
        "`dali-zarr inspect cells.zarr` lists the elements)."
    )


#: arrays an error lists by name (then "..." where there are more)
_LISTED_ARRAYS = 12


def _arrays_in(group: Any, limit: int = _LISTED_ARRAYS + 1) -> list[str]:
    """Paths of the arrays under ``group``, its subgroups' too (climate stores keep their
    variables in groups such as ``surface/t2m``), at most ``limit``: only errors list them.
    Groups anndata encoded (AnnData stores, CSR matrices) are not entered: their arrays
    load through the store itself."""
    found: list[str] = []
    todo = [("", group)]
    while todo and len(found) < limit:
        prefix, node = todo.pop(0)
        for key, child in _readable_members(node):  # unreadable metadata: not loadable
            if is_array(child):
                found.append(prefix + key)
            elif not attribute(child, "encoding-type"):  # not AnnData's (nor a CSR)
                todo.append((f"{prefix}{key}/", child))
    return found[:limit]


def _coordinates(root: Any, arrays: list[str]) -> list[str]:
    """Which of ``arrays`` (paths under ``root``) are xarray coordinates: dimension
    coordinates (``lat``, ``time``: 1-D, their one dimension named as themselves, in
    ``_ARRAY_DIMENSIONS`` (v2) or ``dimension_names`` (v3)) and those a variable's
    ``coordinates`` attribute lists (a curvilinear grid's 2-D ``lat2d``). Loading one gives
    labels as rows, not the samples a data variable holds."""
    nodes = {a: root[a] for a in arrays}
    listed = set()
    for path, node in nodes.items():
        prefix = path.rpartition("/")[0]
        for name in str(attribute(node, "coordinates") or "").split():
            listed.add(f"{prefix}/{name}" if prefix else name)
    found = []
    for path, node in nodes.items():
        dims = dimension_names(node)
        own = len(node.shape) == 1 and dims == (path.rpartition("/")[2],)
        if own or path in listed:
            found.append(path)
    return found


def dimension_names(node: Any) -> tuple[str, ...] | None:
    """An array's dimension names as xarray writes them (``_ARRAY_DIMENSIONS`` in v2,
    ``dimension_names`` in v3), or None where it names none (or not every axis)."""
    dims = node.attrs.get("_ARRAY_DIMENSIONS")
    if dims is None:
        dims = getattr(getattr(node, "metadata", None), "dimension_names", None)
    if not isinstance(dims, list | tuple) or len(dims) != len(node.shape):
        return None
    return tuple(str(d) for d in dims) if all(d is not None for d in dims) else None


#: dimension names of a grid or a vertical axis, and of the axis samples usually run along
_GRID_DIMS = frozenset(
    [
        "lat",
        "latitude",
        "lon",
        "longitude",
        "rlat",
        "rlon",
        "x",
        "y",
        "level",
        "lev",
        "plev",
        "pressure_level",
        "isobaricinhpa",
        "height",
        "depth",
        "z",
    ]
)
_SAMPLE_DIMS = frozenset({"time", "valid_time", "time_counter", "t", "sample", "samples"})


def misplaced_observation_axis(dims: tuple[str, ...] | None) -> str | None:
    """The name of a later axis that looks like the samples' one (``time``) where axis 0,
    along which the loader takes observations, is a grid axis (``lat``); None otherwise.
    A ``(lat, lon, time)`` variable batches by latitude: every batch then holds whole time
    series of a few latitude bands, which nothing else would point out."""
    if not dims or dims[0].lower() not in _GRID_DIMS:
        return None
    return next((d for d in dims[1:] if d.lower() in _SAMPLE_DIMS), None)


def _enclosing_store_hint(group: Any) -> str:
    """Where ``group`` is a part of a local AnnData store (``cells.zarr/raw``, opened as a
    path of its own), the store and the element= that loads the matrix under it."""
    import zarr

    from dali_zarr.io import local_directory

    directory, _ = local_directory(group)
    if directory is None:
        return ""
    below, parent = [], directory
    for _ in range(3):  # raw, layers/<name>, obsm/<name>...: a few levels at most
        parent, part = os.path.split(parent)
        below.insert(0, part)
        try:
            root = zarr.open_group(parent, mode="r")
        except Exception:  # not a group (or nothing): look further up
            continue
        if attribute(root, "encoding-type") != "anndata":
            continue
        rel = "/".join(below)
        found = [e for e in available_elements(root) if e == rel or e.startswith(rel + "/")]
        return (
            f" It is {rel!r} of the AnnData store {parent}: open that store with element= "
            f"one of: {', '.join(found or available_elements(root))}."
        )
    return ""


def _readable_members(group: Any) -> list[tuple[str, Any]]:
    """``(name, node)`` of ``group``'s members whose metadata zarr can read: one member
    with broken metadata must not keep the others from loading (zarr's listing of a group
    parses every member, and raised a bare JSONDecodeError)."""
    found = []
    for key in member_names(group):
        try:
            found.append((key, group[key]))
        except (KeyError, ValueError, TypeError):  # named when it is the element asked for
            continue
    return found


def _nested_anndata(root: Any) -> list[str]:
    """Names of ``root``'s members that are AnnData stores, also those in the other Zarr
    format (anndata 0.12 writes v2 into a v3 group that zarr 3 made; zarr lists a group's
    members in its own format only, so the error named none of them): a local store's
    folders are opened as groups of either format."""
    import zarr

    from dali_zarr.io import local_directory

    found = {k for k, v in _readable_members(root) if _is_anndata_group(v)}
    directory, _ = local_directory(root)
    if directory is not None:
        for entry in os.scandir(directory):
            if not entry.is_dir() or entry.name in found:
                continue
            try:
                node = zarr.open_group(entry.path, mode="r")
            except Exception:  # an array, a plain folder, unreadable metadata: no store
                continue
            if _is_anndata_group(node):
                found.add(entry.name)
    return sorted(found)


def _is_anndata_group(node: Any) -> bool:
    return not is_array(node) and attribute(node, "encoding-type") == "anndata"


def _listing_of(arrays: list[str]) -> str:
    return f" (arrays here: {_names(arrays)})" if arrays else " (it holds no arrays)"


def _names(paths: list[str]) -> str:
    """``paths`` joined, the list cut short after `_LISTED_ARRAYS` of them."""
    more = ", ..." if len(paths) > _LISTED_ARRAYS else ""
    return ", ".join(paths[:_LISTED_ARRAYS]) + more


def matrix_layout(node: Any, *, where: str, any_rank: bool = False) -> Literal["csr", "dense"]:
    """``"dense"`` for a 2-D array, ``"csr"`` for a CSR group (anndata's or h5sparse's
    encoding); anything else (CSC, other encodings, N-D arrays) is refused. ``any_rank``:
    an array of any rank is dense too (``obsm`` entries: anndata only asks for observations
    on axis 0, and the loader batches N-D rows as it does plain arrays)."""
    if is_array(node):
        if len(node.shape) != 2 and not (any_rank and len(node.shape) >= 1):
            raise DatasetError(f"{where}: a dense matrix must be 2-D, found shape {node.shape}.")
        return "dense"
    encoding = attribute(node, "encoding-type") or attribute(node, "h5sparse_format")
    if encoding in ("csr_matrix", "csr"):
        return "csr"
    if encoding in ("csc_matrix", "csc"):
        raise DatasetError(
            f"{where}: is CSC (column-major); rows cannot be read by range. Re-write it as "
            "CSR (e.g. adata.X = adata.X.tocsr(), then write it again with "
            "adata.write_zarr(...) or, for an .h5ad file, adata.write_h5ad(...))."
        )
    raise DatasetError(
        f"{where}: encoding {encoding!r} is not supported (expected csr_matrix or a dense "
        "2-D array)."
    )


def var_key(element: str) -> str | None:
    """Where the features of ``element`` are named: ``raw/X`` has its own ``raw/var``; ``X``
    and layers share ``var``; ``obsm``/``obsp`` columns have no names."""
    element = element.strip("/")
    if element == "raw/X":
        return "raw/var"
    return "var" if element == "X" or element.startswith("layers/") else None


def stale_listing_hint(root: Any, key: str) -> str:
    """Where zarr says a node is missing but a local store holds it on disk, the store's
    consolidated metadata (what zarr lists from) predates it: say so, and how to fix it."""
    from dali_zarr.io import local_directory, metadata_file  # zarr only; h5py has no folders

    directory, _ = local_directory(root)
    if not key or directory is None:
        return ""
    where = os.path.join(directory, *key.split("/"))
    found = metadata_file(where)
    if found is None:
        return ""
    fmt = 3 if os.path.basename(found) == "zarr.json" else 2
    root_fmt = getattr(getattr(root, "metadata", None), "zarr_format", fmt)
    if fmt != root_fmt:  # zarr does not walk from a group into members of the other format
        return (
            f" (It is on disk at {where}, in Zarr format {fmt} inside a format {root_fmt} "
            "group, which zarr does not read through: open the store it belongs to by its "
            "own path.)"
        )
    return (
        f" (It is on disk at {where}, but not in the store's consolidated metadata, which was "
        "written before it: run zarr.consolidate_metadata on the store.)"
    )


def _listing(root: Any) -> str:
    return ", ".join(available_elements(root)) or "no loadable element"


# ---------------------------------------------------------------------------- CSR checks
# shared by the loader's datasets and the converter, which must refuse what the loader does


def refuse_non_integer(dtype: Any, where: str, *, part: str) -> None:
    """A CSR's ``part`` (``"indptr"`` or ``"indices"``) must hold integers: cast to int64,
    an offset of 2.5 becomes 2 and rows shift silently (ids likewise move columns)."""
    if np.dtype(dtype).kind not in "iu":
        what, cast = _CSR_INTEGER_PARTS[part]
        raise DatasetError(
            f"{where}: dtype {dtype} is not an integer dtype; {what} must be integers "
            "(anndata and scipy refuse others too). Re-write the matrix with integer "
            f"{part} (e.g. X.{part} = X.{part}.astype(np.{cast}))."
        )


def indptr_as_int64(indptr: np.ndarray, where: str) -> np.ndarray:
    """Row offsets (integers) as int64, refused where the cast would change them: uint64
    ones past int64 wrap negative (then named as offsets that decrease, or passed)."""
    wide = indptr.dtype.itemsize == 8 and indptr.dtype.kind == "u" and indptr.size
    if wide and indptr.max() > 2**63 - 1:
        raise DatasetError(
            f"{where}: offset {int(indptr.max())} is beyond int64 (the largest is "
            f"{2**63 - 1}); the store is corrupted: re-write the matrix."
        )
    return indptr.astype(np.int64, copy=False)


def refuse_bad_indptr(indptr: np.ndarray, where: str) -> None:
    """Row offsets (int64) must start at 0 and never decrease; refused otherwise, naming the
    first bad offset (on a 10**8-row store "never decrease" alone leaves the row unfound).
    A bool per row, not np.diff's int64 copy (at 10**8 cells: 0.1 GB, not 0.8 GB more)."""
    if indptr[0] != 0:
        fix = (  # a slice of a larger matrix's arrays keeps its offsets into them
            "corrupted or was cut from a larger one without rebasing its offsets: re-write "
            "it, e.g. from scipy.sparse.csr_matrix((data[indptr[0]:], indices[indptr[0]:], "
            "indptr - indptr[0]))"
            if indptr[0] > 0
            else "corrupted: re-write it from its source"
        )
        raise DatasetError(
            f"{where}: indptr[0] is {int(indptr[0])}, not 0; row offsets must start at 0 "
            f"(scipy refuses others too). The matrix is {fix}."
        )
    drops = indptr[1:] < indptr[:-1]
    if drops.any():
        row = int(np.argmax(drops))
        raise DatasetError(
            f"{where}: decreases at row {row}: indptr[{row}] = {int(indptr[row])} > "
            f"indptr[{row + 1}] = {int(indptr[row + 1])} (a row of negative length); row "
            f"offsets never decrease ({int(np.count_nonzero(drops))} row(s) do). The matrix "
            "is corrupted: re-write it from its source."
        )


#: what each integer part of a CSR holds, and the dtype its fix casts to
_CSR_INTEGER_PARTS = {"indptr": ("row offsets", "int64"), "indices": ("column ids", "int32")}


def first_bad_column(ids: np.ndarray, n_features: int) -> int | None:
    """Position in ``ids`` (integers) of the first column id outside ``[0, n_features)``, or
    None. One ``max()`` over the ids viewed as unsigned bounds them from both sides (a
    negative id is then at least ``2**(bits-1)``); ``min()`` and ``max()`` took two passes."""
    ids = np.asarray(ids)  # a view of the same item size needs no contiguity
    unsigned = ids.view(ids.dtype.str.replace("i", "u")) if ids.dtype.kind == "i" else ids
    if not len(ids) or int(unsigned.max()) < n_features:
        return None
    return int(np.flatnonzero((ids < 0) | (ids >= n_features))[0])


def bad_column_error(
    where: str, column: int, n_features: int, element: int, row: str, chunk: str
) -> DatasetError:
    """A column id outside the matrix (which densify would write out of bounds), named by
    its element, ``row`` (how the caller names the row) and ``chunk`` of ``X/indices``."""
    return DatasetError(
        f"{where}: column index {column} is outside [0, {n_features}): element {element:,} "
        f"({row}), in {chunk}. The store is corrupted, or its 'shape' attribute is wrong: "
        "re-write X, or set 'shape' to the matrix's real width."
    )
