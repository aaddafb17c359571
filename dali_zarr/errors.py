"""Exceptions raised by dali_zarr.

Every message names what is wrong (dataset, array, chunk key where known) and what to
change, so a user can act on it without reading our code.
"""

from __future__ import annotations


class DaliZarrError(Exception):
    """Base class of every error dali_zarr raises on purpose."""


class ConfigError(DaliZarrError, ValueError):
    """Sampler, loader or distributed settings that cannot work together."""


class DatasetError(DaliZarrError, ValueError):
    """A path or Zarr node that is not a dataset dali_zarr can read (layout, shapes, dtypes)."""


class ChunkReadError(DaliZarrError, OSError):
    """A chunk or shard that is truncated, corrupted or unreadable."""


class PackedValuesWarning(UserWarning):
    """An array whose attributes pack its values (CF ``scale_factor``/``add_offset``, a
    non-NaN ``_FillValue``): it is delivered as stored, not unpacked."""


class ObservationAxisWarning(UserWarning):
    """An array whose dimension names put a grid axis (``lat``) first and the samples' axis
    (``time``) later: the loader takes observations along axis 0, so batches would be
    latitude bands."""
