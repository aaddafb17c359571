"""The ``dali-zarr`` command line: ``convert``, ``inspect`` and ``bench``.

Each subcommand is a thin shell over a library function (`dali_zarr.convert.convert`,
`dali_zarr.inspection.inspect_store`, `dali_zarr.Loader`), so everything it does can also be
done from Python. Errors dali_zarr raises on purpose, and bad options, are printed as one
line on stderr with exit status 2; an interrupted command exits with 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from dali_zarr.errors import DaliZarrError

__all__ = ["bench_summary", "build_parser", "main", "parse_size"]

PROG = "dali-zarr"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"1GB"`` → 10**9, ``"256MiB"`` → 2**28, ``"0"``/``"none"`` → 0 (no sharding)."""
    t = text.strip().lower().replace("_", "")
    if t in ("none", "off", "0"):
        return 0
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([a-z]*)", t)
    if not m or m.group(3) not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number of bytes with an optional unit, e.g. 256MB, "
            "1GB, 512MiB, or 0/none"
        )
    try:
        value = float(m.group(1)) * 10 ** int(m.group(2) or 0) * _UNITS[m.group(3)]
    except OverflowError:
        value = math.inf
    if value == 0:
        return 0
    if not 1 <= value < 2**63:  # 0.5 would be read as 0 (no sharding), 1e400 overflowed
        raise ValueError(
            f"invalid size {text!r}: {'more than 2**63 bytes' if value >= 1 else 'under 1 byte'}"
            "; use e.g. 256MB or 1GB, or 0/none for no sharding"
        )
    return int(value)


# ---------------------------------------------------------------------------- argparse


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(minimum: int, wording: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (``wording`` says so in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be {wording}")
        return value

    return parse


_positive = _int_at_least(1, "at least 1")
_non_negative = _int_at_least(0, "0 or more")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_CONVERT_HELP = """\
Convert an .h5ad file, an AnnData Zarr store or a plain Zarr array (several inputs are
concatenated along the rows) into a zarr v3 store laid out for dali_zarr: chunks of
--chunk-rows rows, shards of --shard-size, a codec the GPU path decodes. AnnData inputs give an
AnnData store (X, obs, var and dense obsm entries, which the loader serves beside X with
obs=["obsm/<key>"]; layers/obsp/uns are not copied: --element layers/counts makes a
layer, raw/X or an obsm entry the output's X) with an obs column original_index
(each output row's row number in the concatenated input) and, for several inputs,
original_source; plain arrays give a plain array.

X is streamed in blocks of --block-rows rows: peak memory is about two blocks plus one shard
per output array (obs, var and CSR indptr are held in memory). The output is written to
DST.partial, fsynced and renamed to DST when complete (--overwrite swaps it for the old DST in
one step on Linux); an interrupted or killed run leaves no DST, and a re-run removes the
stale DST.partial.
"""

_SHUFFLE_HELP = (
    "write the rows in a pseudo-random order. This is a two-level shuffle, not a uniform "
    "permutation (that would need the whole input in memory): the input rows are cut into "
    "pieces of --piece-rows consecutive rows, the pieces are put in random order, then every "
    "--block-rows // --piece-rows consecutive pieces (at least one) are read together and "
    "their rows are permuted uniformly. Rows of one input piece stay within one block of "
    "output rows. The obs column original_index (and the output's 'dali_zarr' attribute) "
    "records the order."
)


_ELEMENT_HELP = (
    "what to load: in an AnnData store X (default), raw/X, layers/<name>, obsm/<name> or "
    "obsp/<name>; in a plain Zarr group, the path of an array"
)


def build_parser() -> argparse.ArgumentParser:
    from dali_zarr.convert import (
        CODECS,
        DEFAULT_CHUNK_BYTES,
        DEFAULT_CHUNK_ROWS,
        DEFAULT_CSR_CHUNK_ELEMENTS,
    )

    parser = _Parser(
        prog=PROG,
        description="Convert, inspect and benchmark Zarr datasets for the dali_zarr loader.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser(
        "convert",
        help="convert .h5ad / AnnData Zarr / Zarr arrays into a store laid out for dali_zarr",
        description=_CONVERT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} convert [options] SRC [SRC ...] DST",
    )
    c.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="input(s) (.h5ad file, AnnData Zarr store, Zarr array), then the output path",
    )
    c.add_argument(
        "--chunk-rows",
        type=_positive,
        default=None,
        metavar="N",
        help=f"rows per chunk (default {DEFAULT_CHUNK_ROWS}, fewer for rows over "
        f"{DEFAULT_CHUNK_BYTES // DEFAULT_CHUNK_ROWS // 1024} KiB: chunks of at most "
        f"{DEFAULT_CHUNK_BYTES // 2**20} MiB decoded). Dense X / arrays: N rows x all other axes. "
        "CSR data/indices are 1-D, so a chunk holds round(nnz / n_obs * N) elements: N rows on "
        f"average (recorded in the 'dali_zarr' attribute); by default N keeps that at most "
        f"{DEFAULT_CSR_CHUNK_ELEMENTS:,}, which the GPU path decodes faster",
    )
    c.add_argument(
        "--shard-size",
        type=_size,
        default="256MiB",
        metavar="SIZE",
        help="bytes per shard, rounded down to whole chunks, e.g. 1GB, 256MiB (default "
        "%(default)s); 0 or none: no sharding",
    )
    c.add_argument(
        "--codec",
        choices=CODECS,
        default="zstd",
        help="compression of every chunk; all three are decoded by nvCOMP (default %(default)s)",
    )
    c.add_argument(
        "--element",
        default=None,
        metavar="KEY",
        help="what to convert as the output's X: in AnnData inputs X (default), raw/X, "
        "layers/<name>, obsm/<name> or obsp/<name>; in a plain Zarr group, an array's path",
    )
    c.add_argument("--shuffle", action="store_true", help=_SHUFFLE_HELP)
    c.add_argument(
        "--seed",
        type=_non_negative,
        default=0,
        metavar="S",
        help="seed of --shuffle (default %(default)s)",
    )
    c.add_argument(
        "--block-rows",
        type=_positive,
        default=None,
        metavar="N",
        help="input rows read (and, with --shuffle, shuffled) at once; bounds memory "
        "(default: about 64 MiB of decoded X)",
    )
    c.add_argument(
        "--piece-rows",
        type=_positive,
        default=None,
        metavar="N",
        help="with --shuffle: rows per shuffled piece (default: --chunk-rows, or if not given 256, "
        "fewer for rows over 64 KiB, as for dense chunks). Every piece is "
        "one read of the input: pieces much smaller than the input's own chunks make the "
        "conversion slower (those chunks are decoded several times), larger pieces mix less",
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is a Zarr store or an empty folder",
    )
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(func=_convert)

    i = sub.add_parser(
        "inspect",
        help="describe a store: layout, chunks, shards, codecs, read path, suggested settings",
        description="Describe a Zarr store as the loader sees it: layout, shape, chunking, "
        "sharding, codecs, which read path each array takes (gpu-decode: a codec nvCOMP "
        "decodes; cpu-decode: read directly, decoded on the CPU; zarr-fallback: read through "
        "zarr-python, with the reason) and a suggested chunk_size / preload_nchunks.",
    )
    i.add_argument("path", metavar="PATH", help="an AnnData Zarr store or a Zarr array")
    i.add_argument("--element", default=None, metavar="KEY", help=_ELEMENT_HELP)
    i.add_argument(
        "--batch-size",
        type=_positive,
        default=256,
        metavar="B",
        help="batch size the suggestion plans for (default %(default)s)",
    )
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_inspect)

    b = sub.add_parser(
        "bench",
        help="measure the loader's throughput on your store",
        description="Time --batches batches of dali_zarr's Loader (CPU path, shuffled "
        "ChunkSampler) on PATH after --warmup batches, and print rows/s, MB/s and batches/s. "
        "Several paths are loaded as one collection. chunk_size / preload_nchunks default to "
        "the suggestion of 'dali-zarr inspect'.",
    )
    b.add_argument("paths", nargs="+", metavar="PATH", help="store(s) to read")
    b.add_argument("--element", default=None, metavar="KEY", help=_ELEMENT_HELP)
    b.add_argument("--chunk-size", type=_positive, default=None, metavar="N")
    b.add_argument("--preload-nchunks", type=_positive, default=None, metavar="N")
    b.add_argument("--batch-size", type=_positive, default=256, metavar="B")
    b.add_argument("--output", choices=("dense", "csr"), default="dense")
    b.add_argument(
        "--mask-and-scale",
        action="store_true",
        help="decode a CF-packed plain array as xarray reads it (open_dataset's "
        "mask_and_scale=True), as training on its values would",
    )
    b.add_argument("--batches", type=_positive, default=50, metavar="N", help="timed batches")
    b.add_argument(
        "--warmup",
        type=_int_at_least(1, "at least 1: the first batch builds the DALI pipeline"),
        default=2,
        metavar="N",
        help="untimed batches (at least 1: the first builds the pipeline)",
    )
    b.add_argument("--num-threads", type=_positive, default=2, metavar="N", help="DALI threads")
    b.add_argument("--seed", type=_non_negative, default=0, metavar="S")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    b.set_defaults(func=_bench)
    return parser


# ---------------------------------------------------------------------------- helpers


def _bar(quiet: bool, **kwargs: Any):
    """A tqdm progress bar on stderr, off when quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=quiet or not sys.stderr.isatty(), **kwargs)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _print_json(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2, default=str))


# ---------------------------------------------------------------------------- convert


def _convert(args: argparse.Namespace) -> int:
    from dali_zarr.convert import convert

    if len(args.paths) < 2:
        raise _UsageError("convert needs at least one SRC and a DST")
    *sources, dest = args.paths
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = _bar(args.quiet or args.json, total=total, unit="rows", desc="convert")
        bar.update(done - bar.n)

    try:
        result = convert(
            sources,
            dest,
            chunk_rows=args.chunk_rows,
            shard_bytes=args.shard_size,
            codec=args.codec,
            element=args.element,
            shuffle=args.shuffle,
            seed=args.seed,
            block_rows=args.block_rows,
            piece_rows=args.piece_rows,
            overwrite=args.overwrite,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _print_json(result.to_dict())
    elif not args.quiet:
        print(_convert_summary(result))
    return 0


def _convert_summary(r: Any) -> str:
    # a 1-D input has no feature axes: "13,452 × , float32" read as a lost width
    features = "×".join(str(s) for s in r.feature_shape) or "scalar"
    kind = f"AnnData, X {r.layout}" if r.anndata else "Zarr array"
    head = f"wrote {r.path}: {kind}, {r.n_obs:,} × {features}, {r.dtype}"
    if r.nnz is not None:
        head += f", nnz {r.nnz:,}"
    chunks = (
        f"{r.chunk_elements:,} elements (~{r.chunk_rows:,} rows)"
        if r.chunk_elements is not None
        else f"{r.chunk_rows:,} rows"
    )
    shards = f"{r.shard_chunks} chunks per shard" if r.shard_chunks else "not sharded"
    lines = [head, f"  chunks of {chunks}, {shards}, codec {r.codec}"]
    if r.shuffle:
        s = r.shuffle
        lines.append(
            f"  shuffled: seed {s['seed']}, pieces of {s['piece_rows']:,} rows, "
            f"{s['window_pieces']} pieces per block"
        )
    lines.append(
        f"  {r.n_blocks} block{'' if r.n_blocks == 1 else 's'} of <= {r.block_rows:,} rows, "
        f"{_mb(r.nbytes)} on disk, {r.seconds:.1f} s"
    )
    if r.obs_columns:
        lines.append(f"  obs columns: {', '.join(r.obs_columns)}")
    if r.dropped_obs_columns:
        lines.append(
            f"  obs columns not in every input, dropped: {', '.join(r.dropped_obs_columns)}"
        )
    if r.obsm:  # what rides beside X: the summary said nothing of the entries carried
        lines.append(f'  beside X (obs=["obsm/<key>"]): {", ".join(r.obsm)}')
    lines += [f"  note: {n}" for n in r.notes]
    # quoted: a path with spaces, pasted as printed, would be two arguments
    lines.append(f"  next: {PROG} inspect {shlex.quote(str(r.path))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    from dali_zarr.inspection import format_report, inspect_store

    report = inspect_store(args.path, element=args.element, batch_size=args.batch_size)
    if args.json:
        _print_json(report.to_dict())
    else:
        print(format_report(report))
    return 0


# ---------------------------------------------------------------------------- bench


def _batches(loader: Any) -> Iterator[dict[str, Any]]:
    """Batches forever: epoch after epoch, so a short store still fills the timed run."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        got = False
        for batch in loader:
            got = True
            yield batch
        if not got:
            return
        epoch += 1


def batch_nbytes(x: Any) -> int:
    """Bytes of a batch's ``X``: a dense tensor, or a sparse CSR one's three arrays."""
    import torch

    if x.layout == torch.sparse_csr:
        parts = (x.values(), x.col_indices(), x.crow_indices())
        return sum(p.numel() * p.element_size() for p in parts)
    return x.numel() * x.element_size()


def _bench(args: argparse.Namespace) -> int:
    from dali_zarr.data.dataset import open_dataset
    from dali_zarr.inspection import suggested_settings
    from dali_zarr.loader import Loader
    from dali_zarr.planning import ChunkSampler

    paths = args.paths
    dataset = open_dataset(
        paths[0] if len(paths) == 1 else paths,
        element=args.element,
        mask_and_scale=True if args.mask_and_scale else None,
    )
    if args.output == "csr" and dataset.layout != "csr":
        raise _UsageError(f"--output csr needs a sparse X, but {dataset.name} is dense")
    chunk_size, preload = suggested_settings(
        dataset,
        batch_size=args.batch_size,
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
    )
    sampler = ChunkSampler(
        chunk_size=chunk_size,
        preload_nchunks=preload,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
    )
    loader = Loader(dataset, sampler, output=args.output, num_threads=args.num_threads)
    try:
        if len(loader) == 0:
            raise _UsageError(
                f"{dataset.name} yields no batch of {args.batch_size} rows; lower --batch-size"
            )
        stream = _batches(loader)
        t_start = time.perf_counter()
        for _ in range(args.warmup):
            next(stream)
        t0 = time.perf_counter()
        rows = nbytes = done = 0
        with _bar(args.quiet or args.json, total=args.batches, unit="batch", desc="bench") as bar:
            for batch in stream:
                x = batch["X"]
                rows += int(x.shape[0])
                nbytes += batch_nbytes(x)
                done += 1
                bar.update(1)
                if done == args.batches:
                    break
        elapsed = max(time.perf_counter() - t0, 1e-9)
    finally:
        loader.close()
    summary = {
        "paths": list(paths),
        "dataset": dataset.name,  # which element was timed (X, a layer, ...)
        "n_obs": dataset.n_obs,
        "output": args.output,
        "chunk_size": chunk_size,
        "preload_nchunks": preload,
        "batch_size": args.batch_size,
        "num_threads": args.num_threads,
        "warmup_batches": args.warmup,
        "warmup_seconds": t0 - t_start,
        "batches": done,
        "rows": rows,
        "bytes": nbytes,
        "seconds": elapsed,
        "batches_per_s": done / elapsed,
        "rows_per_s": rows / elapsed,
        "mb_per_s": nbytes / elapsed / 1e6,
        "read_paths": loader.read_paths(),
    }
    if args.json:
        _print_json(summary)
        return 0
    print(bench_summary(summary))
    return 0


def bench_summary(s: dict[str, Any]) -> str:
    """The bench result as text (``s`` is what ``bench --json`` prints)."""
    kind = "sparse CSR" if s["output"] == "csr" else "dense float32"
    return "\n".join(
        [
            f"bench {' + '.join(s['paths'])}: {s['batches']} batches ({s['rows']:,} rows, "
            f"batch_size {s['batch_size']}) after {s['warmup_batches']} warm-up batches",
            f"  dataset: {s['dataset']}",
            f"  settings: output={s['output']}, chunk_size={s['chunk_size']}, "
            f"preload_nchunks={s['preload_nchunks']}, num_threads={s['num_threads']} "
            f"({s['n_obs']:,} observations)",
            f"  start-up + warm-up  {s['warmup_seconds']:.2f} s (builds the DALI pipeline)",
            f"  timed               {s['seconds']:.2f} s",
            f"  batches/s           {s['batches_per_s']:,.1f}",
            f"  rows/s              {s['rows_per_s']:,.0f}",
            f"  MB/s                {s['mb_per_s']:,.1f}  (batch tensors as delivered: {kind})",
            "  read paths          " + ", ".join(f"{k}: {v}" for k, v in s["read_paths"].items()),
        ]
    )


# ---------------------------------------------------------------------------- main


_QUIET_WARNINGS = (
    ".*Numcodecs codecs are not in the Zarr",
    ".*zarr v3 autosharding",
    ".*Consolidated metadata",
    ".*Writing zarr v2 data",
)


class _UsageError(DaliZarrError):
    """A combination of command-line arguments that cannot work."""


def command_line_words(message: str) -> str:
    """A library error as the command line's user reads it: ``element=`` (the keyword of
    ``open_dataset``) is ``--element`` here; a call in the message (``dz.open_dataset(...,
    element='raw/X')``) keeps its Python."""
    message = message.replace(" (--element on the command line)", "")
    keyword = r"(?<!\()(?<!, )\belement="
    message = re.sub(keyword + r"(?=[.,;:)])", "--element", message)  # "drop element=."
    return re.sub(keyword + r"\s?", "--element ", message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 error, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    prefix = f"{PROG} {args.command}"
    try:
        with warnings.catch_warnings():
            for message in _QUIET_WARNINGS:  # zarr/anndata chatter that is no use on a terminal
                warnings.filterwarnings("ignore", message=message)
            status = func(args)
            sys.stdout.flush()  # a closed pipe fails here, where it is handled, not at exit
            return status
    except DaliZarrError as e:
        print(f"{prefix}: error: {command_line_words(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dali-zarr inspect S | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except OSError as e:  # the file system said no (permissions, disk full, ...)
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
