"""Chunk I/O and decoding: read rows of zarr arrays, fast on local stores.

`open_reader` picks `DirectReader` (``os.preadv`` + our own decode, for LocalStore arrays
with codecs we handle) or `ZarrReader` (zarr-python, for everything else); both implement
the `ArrayReader` protocol. See `dali_zarr.io.readers` for exactly which arrays take which.
"""

from .codecs import ChunkDecoder, DecodeError
from .layout import (
    ArrayLayout,
    ChunkCodecs,
    ShardLayout,
    error_chain,
    missing_codec_advice,
    parse_layout,
    unknown_codec_id,
)
from .readers import (
    WRITER_MARKER,
    ArrayReader,
    DirectReader,
    StoredObjectsWatch,
    ZarrReader,
    check_ranges,
    checked_around,
    default_executor,
    first_failing_chunk,
    local_directory,
    metadata_file,
    open_reader,
    read_whole,
    refuse_stale_metadata,
    refuse_unfinished,
)

__all__ = [
    "WRITER_MARKER",
    "ArrayLayout",
    "ArrayReader",
    "ChunkCodecs",
    "ChunkDecoder",
    "DecodeError",
    "DirectReader",
    "ShardLayout",
    "StoredObjectsWatch",
    "ZarrReader",
    "check_ranges",
    "checked_around",
    "default_executor",
    "error_chain",
    "first_failing_chunk",
    "local_directory",
    "metadata_file",
    "missing_codec_advice",
    "open_reader",
    "parse_layout",
    "read_whole",
    "refuse_stale_metadata",
    "refuse_unfinished",
    "unknown_codec_id",
]
