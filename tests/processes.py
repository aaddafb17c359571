"""What the tests that start real processes (torchrun, JAX, Lightning, scripts) share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

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


def start(cmd: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cmd`` in the repository, in its own session, so that a timeout can kill its whole
    process group (torchrun's or Lightning's ranks too); stdout and stderr piped apart."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env if env is not None else child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """``(exit code, stdout, stderr)`` of every process. Past ``timeout`` seconds all their
    process groups are killed and the test fails with their output: a hang never blocks."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        logs = ["".join(proc.communicate())[-3000:] for proc in procs]
        head = f"{len(procs)} process(es) not done within {timeout:.0f} s (hang?):\n"
        pytest.fail(head + "\n".join(logs))
    return results


def run_ok(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` (see :func:`start`), require exit 0, return its stdout."""
    ((code, out, err),) = wait_all([start(cmd, env=env)], timeout)
    assert code == 0, out[-3000:] + err[-3000:]
    return out
