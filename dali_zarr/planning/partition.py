"""Pure functions that split a chunked dataset among ranks, epochs and windows.

Everything here is a function of its arguments only (no I/O, no global state, no
communication), works on O(chunks) numpy arrays and never on per-row Python loops, so
every rank computes the same global decisions independently and in milliseconds even for
100M observations.

A rank's rows are represented as ``row_ranges`` (``(k, 2)`` int64 global ``[start, stop)``,
each inside one chunk, in read order) plus ``offsets`` (``(k + 1,)`` int64, the position of
each range in the rank's virtual row sequence; ``offsets[0] == 0``, ``offsets[-1]`` = rows).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable
from typing import Literal

import numpy as np

from dali_zarr.errors import ConfigError

__all__ = [
    "SEED_LIMIT",
    "Shard",
    "chunk_ranges",
    "contiguous_shard",
    "global_chunk_order",
    "n_chunks_of",
    "offsets_of",
    "ranges_to_rows",
    "rank_bounds",
    "rows_delivered",
    "run_offsets",
    "short_chunk_position",
    "slice_ranges",
    "validate_count",
    "validate_plan_inputs",
    "validate_seed",
    "validate_sizes",
    "virtual_shard",
    "window_rows_of",
]

Shard = Literal["chunks", "contiguous"]
SHARD_MODES: tuple[str, ...] = ("chunks", "contiguous")
SEED_LIMIT = 2**63  # seeds must fit a (non-negative) int64 so they can be broadcast and logged

# Stream tags of np.random.default_rng([seed, epoch, TAG, ...]); fixed forever, since they
# define which rows an (epoch, seed) yields and resumed runs depend on them.
TAG_GLOBAL_ORDER = 0
TAG_CONTIGUOUS_ORDER = 1
TAG_WINDOW = 2


# --------------------------------------------------------------------------- validation


def validate_int(
    name: str, value: object, *, low: int, high: int | None = None, what: str, hint: str = ""
) -> int:
    """``value`` as a Python int in ``[low, high)``, else a ConfigError "``name`` must be
    ``what``, got ..." (bools and non-integers are refused, NumPy integers accepted)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be {what}, got {value!r}{hint}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{name} must be {what}, got {type(value).__name__} {value!r}{hint}"
        ) from None
    if v < low or (high is not None and v >= high):
        raise ConfigError(f"{name} must be {what}, got {v}{hint}")
    return int(v)


def validate_flag(name: str, value: object, *, numpy: bool = False) -> bool:
    """``value`` if it is True or False, else ConfigError (``"no"`` is truthy). ``numpy``:
    NumPy's bools too, where the flag is not saved as it is given (a state's JSON takes
    no ``np.True_``)."""
    if not isinstance(value, bool | np.bool_ if numpy else bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def validate_count(name: str, value: object, *, hint: str = "") -> int:
    """Return ``value`` as a Python int if it is a positive integer, else raise ConfigError."""
    return validate_int(name, value, low=1, what="a positive integer", hint=hint)


def validate_seed(seed: object) -> int:
    """Return ``seed`` as an int in ``[0, 2**63)``, else raise ConfigError."""
    return validate_int(
        "seed", seed, low=0, high=SEED_LIMIT, what="an integer in [0, 2**63) or None"
    )


def validate_sizes(
    *, chunk_size: int, preload_nchunks: int, batch_size: int
) -> tuple[int, int, int]:
    """Check the sampler settings that do not depend on the dataset; returns them as Python
    ints (NumPy int32 sizes wrapped around in the products below)."""
    chunk_size = validate_count("chunk_size", chunk_size)
    preload_nchunks = validate_count("preload_nchunks", preload_nchunks)
    batch_size = validate_count("batch_size", batch_size)
    if preload_nchunks * chunk_size < batch_size:
        raise ConfigError(
            f"batch_size={batch_size} is larger than a window of preload_nchunks={preload_nchunks}"
            f" x chunk_size={chunk_size} = {preload_nchunks * chunk_size} rows (a batch larger "
            f"than a window): raise preload_nchunks to at least "
            f"{-(-batch_size // chunk_size)} or lower batch_size to at most "
            f"{preload_nchunks * chunk_size}"
        )
    return chunk_size, preload_nchunks, batch_size


def validate_plan_inputs(
    *,
    n_obs: int,
    epoch: int,
    rank: int,
    world_size: int,
    chunk_size: int,
    batch_size: int,
    enforce_equal_batches: bool,
    drop_last: bool = False,
) -> None:
    """Check the settings that depend on the dataset size and the number of ranks."""
    # as Python ints: a NumPy uint64 n_obs wrapped in -(-n // k) (5 rows made 2**64 chunks)
    n_obs = validate_count("n_obs", n_obs, hint=" (the dataset has no observations to plan)")
    validate_int("epoch", epoch, low=0, what="a non-negative integer")
    world_size = validate_count("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
        raise ConfigError(f"rank must be an integer, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    n_chunks = n_chunks_of(n_obs, chunk_size)
    if world_size > n_chunks:
        # with fewer rows than ranks no chunk_size gives every rank a chunk: do not offer one
        lower = (
            f"lower chunk_size to at most {n_obs // world_size} or " if n_obs >= world_size else ""
        )
        raise ConfigError(
            f"more ranks than chunks: n_obs={n_obs} with chunk_size={chunk_size} gives "
            f"{n_chunks} chunk(s) for world_size={world_size} ranks; {lower}run on at most "
            f"{n_chunks} ranks"
        )
    if world_size > 1 and enforce_equal_batches and (n_obs // world_size) // batch_size == 0:
        raise ConfigError(
            f"dataset too small: n_obs={n_obs} split over world_size={world_size} ranks gives "
            f"{n_obs // world_size} rows per rank, less than one batch of batch_size={batch_size}"
            f" (needs n_obs >= world_size x batch_size = {world_size * batch_size}); lower "
            f"batch_size to at most {max(1, n_obs // world_size)}, use fewer ranks, or pass "
            f"enforce_equal_batches=False"
        )
    most = -(-n_obs // world_size)  # the largest rank's share
    if drop_last and most < batch_size:
        raise ConfigError(
            f"nothing to deliver: n_obs={n_obs} over world_size={world_size} rank(s) gives at "
            f"most {most} rows per rank, less than one batch of batch_size={batch_size}, and "
            f"drop_last=True drops every partial batch; lower batch_size to at most {most}, "
            "use fewer ranks, or pass drop_last=False"
        )


# --------------------------------------------------------------------------- sizes


def n_chunks_of(n_obs: int, chunk_size: int) -> int:
    """Number of chunks (the last one may be short)."""
    return -(-n_obs // chunk_size)


def window_rows_of(chunk_size: int, preload_nchunks: int, batch_size: int) -> int:
    """Rows per window: the largest multiple of batch_size within preload_nchunks chunks.

    A multiple of batch_size so that no batch spans two windows.
    """
    return (preload_nchunks * chunk_size // batch_size) * batch_size


def rank_bounds(n_obs: int, world_size: int) -> np.ndarray:
    """``(W + 1,)`` int64 boundaries ``floor(r * n_obs / W)``: rank r owns ``[b[r], b[r+1])``."""
    return np.array([r * n_obs // world_size for r in range(world_size + 1)], dtype=np.int64)


def rows_delivered(
    n_obs: int,
    world_size: int,
    batch_size: int,
    *,
    enforce_equal_batches: bool,
    drop_last: bool,
) -> np.ndarray:
    """``(W,)`` int64 rows each rank delivers in any epoch (independent of the epoch).

    With ``W > 1`` and ``enforce_equal_batches`` every rank delivers exactly
    ``floor(floor(n_obs / W) / batch_size)`` full batches, which all ranks compute without
    communicating (so DDP collectives never hang on an uneven last step). Otherwise a rank
    delivers its whole share, cut to full batches when ``drop_last``.
    """
    b = rank_bounds(n_obs, world_size)
    share = np.diff(b)
    if world_size > 1 and enforce_equal_batches:
        k = (n_obs // world_size) // batch_size
        return np.full(world_size, k * batch_size, dtype=np.int64)
    if drop_last:
        return (share // batch_size) * batch_size
    return share


# --------------------------------------------------------------------------- orders


def order_digest(blocks: Iterable[np.ndarray]) -> str:
    """16 hex digits naming a sequence of ids (``blocks`` end to end, as int64). NumPy does
    not promise its permutation streams across versions: an order recomputed later (a
    resumed epoch, a converted store's shuffle) is checked against the digest of the one
    used."""
    h = hashlib.blake2b(digest_size=8)
    for ids in blocks:
        h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()


def global_chunk_order(n_chunks: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order of all chunk ids for an epoch, identical on every rank (same seed, same epoch)."""
    if not shuffle:
        return np.arange(n_chunks, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, TAG_GLOBAL_ORDER])
    return rng.permutation(n_chunks).astype(np.int64, copy=False)


def chunk_ranges(chunk_ids: np.ndarray, chunk_size: int, n_obs: int) -> np.ndarray:
    """``(k, 2)`` global ``[start, stop)`` of whole chunks ``chunk_ids`` (last one may be short)."""
    starts = np.asarray(chunk_ids, dtype=np.int64) * chunk_size
    stops = np.minimum(starts + chunk_size, n_obs)
    return np.stack([starts, stops], axis=1)


def run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``(k + 1,)`` int64 start of each of ``k`` runs of ``lengths`` laid end to end, then
    their total (``[0, l0, l0 + l1, ...]``)."""
    lengths = np.asarray(lengths)
    out = np.empty(lengths.shape[0] + 1, dtype=np.int64)
    out[0] = 0
    np.cumsum(lengths, out=out[1:])
    return out


def offsets_of(row_ranges: np.ndarray) -> np.ndarray:
    """``(k + 1,)`` positions of each range in the concatenated sequence."""
    return run_offsets(row_ranges[:, 1] - row_ranges[:, 0])


def slice_ranges(
    row_ranges: np.ndarray, offsets: np.ndarray, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray]:
    """Restrict ranges to virtual positions ``[lo, hi)``; returns new (ranges, offsets).

    O(log k + ranges kept). Ranges cut at the ends keep only the covered rows, so the
    result may start or end mid-chunk. Offsets of the result start at 0.
    """
    total = int(offsets[-1])
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"slice [{lo}, {hi}) outside [0, {total})")
    if lo == hi:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(1, dtype=np.int64)
    i0 = int(np.searchsorted(offsets, lo, side="right")) - 1
    i1 = int(np.searchsorted(offsets, hi, side="left"))
    ranges = np.array(row_ranges[i0:i1], dtype=np.int64, copy=True)
    ranges[0, 0] += lo - int(offsets[i0])
    ranges[-1, 1] -= int(offsets[i1]) - hi
    new_off = np.array(offsets[i0 : i1 + 1], dtype=np.int64, copy=True) - lo
    new_off[0] = 0
    new_off[-1] = hi - lo
    return ranges, new_off


def short_chunk_position(order: np.ndarray, *, chunk_size: int, n_obs: int) -> int:
    """Where in ``order`` the last chunk (the one short of ``chunk_size`` rows) sits, or
    ``len(order)`` where every chunk is full: all that :func:`virtual_shard` needs to know of
    the order besides its length. O(n_chunks); compute it once to slice many ranks."""
    n_chunks = int(order.shape[0])
    if n_chunks * chunk_size == n_obs:
        return n_chunks
    return int(np.flatnonzero(np.asarray(order) == n_chunks - 1)[0])


def virtual_shard(
    order: np.ndarray,
    *,
    chunk_size: int,
    n_obs: int,
    lo: int,
    hi: int,
    short_at: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[lo, hi)`` of the virtual sequence "rows of the chunks in ``order``, concatenated".

    This is shard="chunks": every rank slices the same globally shuffled sequence, so row
    counts differ by at most one and a boundary chunk is simply split between two ranks.
    Every chunk but the short last one holds ``chunk_size`` rows, so the sequence position
    of a chunk is arithmetic: O(chunks kept), given ``short_at``
    (:func:`short_chunk_position`, else found here in O(n_chunks)). Planning every rank of a
    large world (an elastic resume does) then costs one pass over the order, not one a rank.
    """
    order = np.asarray(order)
    n_chunks = int(order.shape[0])
    missing = n_chunks * chunk_size - n_obs  # rows the short chunk lacks (0: none is short)
    if short_at is None:
        short_at = short_chunk_position(order, chunk_size=chunk_size, n_obs=n_obs)

    def offset(i: int) -> int:  # where the i-th chunk of the order starts in the sequence
        return i * chunk_size - (missing if i > short_at else 0)

    if not 0 <= lo <= hi <= n_obs:
        raise ValueError(f"slice [{lo}, {hi}) outside [0, {n_obs})")
    if lo == hi:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(1, dtype=np.int64)
    i0 = lo // chunk_size  # the last chunk starting at or before lo (offset() <= i * size)
    if i0 < n_chunks and offset(i0 + 1) <= lo:
        i0 += 1
    i1 = min(-(-hi // chunk_size), n_chunks)  # the first chunk boundary at or past hi
    if offset(i1) < hi:
        i1 += 1
    at = np.arange(i0, i1 + 1, dtype=np.int64)
    offsets = at * chunk_size - np.where(at > short_at, missing, 0)
    ranges = chunk_ranges(order[i0:i1], chunk_size, n_obs)
    return slice_ranges(ranges, offsets - offsets[0], lo - offset(i0), hi - offset(i0))


def contiguous_shard(
    *,
    chunk_size: int,
    lo: int,
    hi: int,
    seed: int,
    epoch: int,
    rank: int,
    shuffle: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """shard="contiguous": the fixed global rows ``[lo, hi)`` as chunks clipped to the range.

    The rank reads the same rows every epoch (warm node-local caches); only the order of its
    clipped chunks changes, drawn from a per-rank stream when shuffling.
    """
    if lo >= hi:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(1, dtype=np.int64)
    ids = np.arange(lo // chunk_size, (hi - 1) // chunk_size + 1, dtype=np.int64)
    if shuffle:
        rng = np.random.default_rng([seed, epoch, TAG_CONTIGUOUS_ORDER, rank])
        ids = ids[rng.permutation(ids.shape[0])]
    starts = np.maximum(ids * chunk_size, lo)
    stops = np.minimum(ids * chunk_size + chunk_size, hi)
    ranges = np.stack([starts, stops], axis=1)
    return ranges, offsets_of(ranges)


def ranges_to_rows(row_ranges: np.ndarray) -> np.ndarray:
    """Concatenate global row ranges ``[start, stop)`` into one int64 array of row ids.

    Vectorised (no per-row Python loop): O(total rows) numpy work. Use it on a window,
    not on a whole shard.
    """
    row_ranges = np.asarray(row_ranges, dtype=np.int64).reshape(-1, 2)
    return concat_aranges(row_ranges[:, 0], row_ranges[:, 1] - row_ranges[:, 0])


def concat_aranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + k) for s, k in zip(starts, lengths)])`` as int64,
    without the loop (``lengths`` >= 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    local = run_offsets(lengths)
    # the element at local position p of run i is start_i + (p - local_start_i)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - local[:-1], lengths)
    return shift + np.arange(int(local[-1]), dtype=np.int64)


def split_at_chunks(
    starts: np.ndarray, stops: np.ndarray, chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty row ranges ``[starts, stops)`` cut at chunk boundaries: one piece per
    (range, chunk) they meet, in range order, as ``(range, chunk, lo, hi)``: rows
    ``[lo, hi)`` of range ``range`` lie in chunk ``chunk``."""
    first, last = starts // chunk_size, (stops - 1) // chunk_size
    counts = last - first + 1
    piece_range = np.repeat(np.arange(len(starts)), counts)
    chunk = concat_aranges(first, counts)
    lo = np.maximum(starts[piece_range], chunk * chunk_size)
    hi = np.minimum(stops[piece_range], (chunk + 1) * chunk_size)
    return piece_range, chunk, lo, hi
