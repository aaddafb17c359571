"""What every runner shares: the command line, the timing loop and the one-line result.

Runners are scripts run in a subprocess, possibly by another interpreter (annbatch needs
Python 3.12 in its own virtual environment), so this module needs only the standard library
and NumPy, and the protocol is plain text:

    python <runner>.py --store PATH --settings '<json>'

prints any logs on stderr and, last on stdout, one line ``RESULT {json}`` with ``rows``,
``seconds``, ``batches`` and ``bytes`` (the bytes of the batches it handed out), or
``{"skipped": "<why>"}`` when the contender cannot run here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PREFIX = "RESULT "


def parse() -> tuple[str, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--settings", default="{}", help="JSON object")
    args = parser.parse_args()
    return args.store, json.loads(args.settings)


def emit(result: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def skip(reason: str) -> None:
    emit({"skipped": reason})


def epochs(make_epoch: Callable[[int], Iterable[Any]]) -> Iterator[Any]:
    """Batches of epoch 0, 1, 2, ... without end (``make_epoch(epoch)`` gives one epoch)."""
    epoch = 0
    while True:
        empty = True
        for batch in make_epoch(epoch):
            empty = False
            yield batch
        if empty:
            raise RuntimeError("an epoch yielded no batch")
        epoch += 1


def measure(
    batches: Iterator[Any],
    consume: Callable[[Any], tuple[int, int]],
    *,
    warmup: int,
    max_batches: int,
    max_seconds: float,
) -> dict[str, Any]:
    """Time ``consume`` over batches after ``warmup`` of them.

    ``consume(batch)`` does what a user does with a batch (densify, touch it) and returns
    ``(rows, bytes)``. The clock stops after ``max_batches`` batches or at the first batch
    that ends past ``max_seconds`` (at least one batch is always timed).
    """
    for _ in range(warmup):
        consume(next(batches))
    rows = nbytes = count = 0
    start = time.perf_counter()
    elapsed = 0.0
    while count < max_batches and (count == 0 or elapsed < max_seconds):
        r, b = consume(next(batches))
        rows += r
        nbytes += b
        count += 1
        elapsed = time.perf_counter() - start
    return {"rows": rows, "seconds": elapsed, "batches": count, "bytes": nbytes}
