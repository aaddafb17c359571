"""What the tests that start real processes (torchrun, JAX, Lightning, scripts) share."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process: the repository importable (also without an
    installed package), one OpenMP thread per process (the ranks share two cores), plus
    ``extra``."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    """A TCP port free on loopback right now (for a rendezvous or coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
