"""Writing a store whole: a writer (``convert``, the synthetic stores) writes into
``DST.partial``, marked as ours and locked, then everything is fsynced and renamed to ``DST``
in one step (``overwrite`` swaps it with the old ``DST`` where the OS can). An interrupted
or killed writer never leaves a ``DST`` that looks complete; the readers refuse a folder
that holds the marker (`WRITER_MARKER`), and a re-run removes the stale ``DST.partial``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any

from dali_zarr.errors import ConfigError

from .layout import error_chain
from .readers import WRITER_MARKER, metadata_file

__all__ = ["check_replaceable", "dir_bytes", "written_whole"]

_MARKER = WRITER_MARKER  # inside DST.partial: proves the directory is ours to remove

log = logging.getLogger(__name__)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@contextlib.contextmanager
def written_whole(dest: str, *, sources: Sequence[str] = (), overwrite: bool) -> Iterator[str]:
    """A path to write a store into (``DST.partial``, locked for this writer), moved to
    ``dest`` when the block ends and removed if it raises: ``dest`` holds a whole store or
    none, and a second writer to the same ``dest`` is refused. Used by ``convert`` and by
    the synthetic stores (an interrupted demo must not leave a half store behind)."""
    partial, lock = _prepare_destination(dest, sources, overwrite)
    try:
        yield partial
        _publish(partial, os.path.normpath(dest), overwrite)
    except BaseException as exc:
        full = _disk_full(exc, dest, partial, sources)
        _discard(partial)
        if full is not None:
            raise full from exc
        raise
    finally:
        lock.close()


def _disk_full(
    exc: BaseException, dest: str, partial: str, sources: Sequence[str]
) -> ConfigError | None:
    """The words for a write that ran out of space or quota (``exc`` or an error it wraps),
    or None for any other failure. The OS says only "No space left on device", naming no
    file: the user needs to hear which destination, how far the output got and what is free."""
    if not any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in error_chain(exc)
    ):
        return None
    written = dir_bytes(partial) if os.path.isdir(partial) else 0
    folder = os.path.dirname(os.path.abspath(dest))
    try:
        free = f"{shutil.disk_usage(folder).free / 1e6:,.1f} MB are free there now"
    except OSError:
        free = "its free space could not be read"
    local = [p for p in sources if os.path.exists(p)]  # a URL has no size here
    inputs = sum(dir_bytes(p) if os.path.isdir(p) else os.path.getsize(p) for p in local)
    need = f" (the inputs take {inputs / 1e6:,.1f} MB on disk)" if local else ""
    return ConfigError(
        f"{dest}: the file system (or your quota) under {folder} ran out of space after "
        f"{written / 1e6:,.1f} MB of the output were written{need}, and {free}. The partial "
        "output was removed. Free space there, or write to a destination on another file "
        "system."
    )


def _discard(partial: str) -> None:
    """Remove a failed writer's ``partial``. zarr writes from its own event loop, which goes
    on after our thread stops (Ctrl-C, or one write's error while others are in flight):
    removing the folder under it let late writes make a ``partial`` without our marker,
    which the next run then refused. So the writes are waited for first; where that cannot
    be done, the marker stays (the next run removes the folder)."""
    if _wait_for_zarr_writes():
        _remove_marked(partial)
    else:
        _empty_but_marker(partial)


def _empty_but_marker(path: str) -> None:
    """Remove what a marked folder holds but its marker, as far as this process can."""
    for entry in os.scandir(path) if os.path.isdir(path) else ():
        if entry.name != _MARKER:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)


def _remove_marked(path: str) -> str | None:
    """Remove a marked folder, its marker last: a removal cut short leaves a folder the next
    run still knows for ours (a stale partial), not one it must refuse. Returns a path that
    stays (files of another user, a read-only folder), for the caller to name; None once
    the folder is gone."""
    if not os.path.isdir(path):
        return None
    _empty_but_marker(path)
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return None
    left = [os.path.join(d, n) for d, dirs, files in os.walk(path) for n in dirs + files]
    return next((p for p in left if os.path.basename(p) != _MARKER), path)


def _wait_for_zarr_writes(timeout: float = 30.0) -> bool:
    """Wait until zarr's event loop has no task in flight; False where that cannot be known
    (zarr's loop is internal: ``zarr.core.sync``, a one-item list from zarr 3.0 to 3.3),
    from inside that loop, or after ``timeout``."""
    try:
        from zarr.core.sync import loop as zarr_loop
    except ImportError:
        return False
    if not (isinstance(zarr_loop, list) and len(zarr_loop) == 1):
        return False
    running = zarr_loop[0]
    if running is None or not running.is_running():
        return True  # no loop, no writes
    with contextlib.suppress(RuntimeError):  # RuntimeError: no loop runs in this thread
        if asyncio.get_running_loop() is running:
            return False  # called from a task of that loop: it cannot wait for itself
    log.info("dali_zarr: waiting for zarr's writes in flight before removing the partial store")

    async def drain() -> bool:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        return not pending

    try:
        return asyncio.run_coroutine_threadsafe(drain(), running).result(timeout + 5)
    except Exception:  # a loop closed meanwhile, a timeout: keep the marker
        return False


def _prepare_destination(dest: str, sources: Sequence[str], overwrite: bool) -> tuple[str, IO[str]]:
    """``DST.partial`` made (a stale one of an interrupted run removed) and its marker file,
    locked for this run: a second convert to the same destination is refused, not merged."""
    dest = os.path.normpath(dest)
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{dest}: parent directory {parent} {what}; create it first.")
    real = os.path.realpath(dest)
    for src in sources:
        rs = os.path.realpath(src)
        if real == rs or rs.startswith(real + os.sep) or real.startswith(rs + os.sep):
            raise ConfigError(
                f"{dest}: is, holds, or lies inside the input {src}; write to another path."
            )
    check_replaceable(dest, overwrite)
    partial = dest + ".partial"
    busy = ConfigError(
        f"{partial}: another dali-zarr writer (a convert, a synthetic store) is writing this "
        "destination now; wait for it to finish, or choose another destination."
    )
    if _is_empty_folder(partial):  # a removal stopped between the marker and the folder
        with contextlib.suppress(OSError):
            os.rmdir(partial)
    if os.path.lexists(partial):
        marker = os.path.join(partial, _MARKER)
        if not os.path.exists(marker):
            raise ConfigError(
                f"{partial}: exists but was not left by an interrupted dali-zarr writer; "
                "remove it or choose another destination."
            )
        # Opened without creating it: a marker made here could land in a folder its writer
        # is renaming away; a writer that finished or another cleaner removed it: busy.
        try:
            stale = open(marker)  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise busy from None
        with stale:
            # its writer holds the lock for as long as it runs; the marker still at its path
            # after locking, or another re-run removed it (and made its own) meanwhile
            if not _try_lock(stale) or not _same_file(stale, marker):
                raise busy
            left = _remove_marked(partial)  # a stale, half-written result of an interrupted run
            # not removable by this process (a run as another user, e.g. under sudo): said so,
            # not the "busy" that makedirs' FileExistsError below would say (wait forever);
            # another run's new marker there is a writer
            if left is not None and (_same_file(stale, marker) or not os.path.exists(marker)):
                raise ConfigError(
                    f"{partial}: left by an interrupted dali-zarr writer, but this process "
                    f"cannot remove it ({left} stays: a file of another user, or in a "
                    "read-only folder); remove it yourself, or choose another destination."
                )
    try:
        os.makedirs(partial)
        return partial, _new_marker(partial)
    except FileExistsError:  # another convert made it since the check above
        raise busy from None
    except FileNotFoundError:  # another run took it for an empty leftover before it was marked
        raise busy from None


def _is_empty_folder(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
    except OSError:
        return False


def _new_marker(folder: str) -> IO[str]:
    """``folder``'s marker, locked by this process until the returned file is closed (or the
    process ends). It stays in the store through the rename that publishes it, so no step
    of a commit leaves an unmarked ``DST.partial``."""
    lock = open(os.path.join(folder, _MARKER), "a")  # noqa: SIM115 (held past this call)
    _try_lock(lock)
    lock.write(
        "dali-zarr writer's marker. In a folder named *.partial: an unfinished store, safe to "
        "delete once its writer has stopped. In a finished store (its writer was stopped as "
        "it published it): only this file is stale and safe to delete.\n"
    )
    lock.flush()
    return lock


def _same_file(f: IO[str], path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(f.fileno())
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def check_replaceable(dest: str, overwrite: bool) -> None:
    """Nothing at ``dest``, or (with ``overwrite``) a Zarr store or an empty folder. A folder
    of other files or a file (an .h5ad given as DST by mistake) is never replaced: it would
    be deleted whole."""
    if not os.path.lexists(dest):
        return
    if os.path.isdir(dest):
        if not os.listdir(dest) or metadata_file(dest):
            if overwrite and not os.path.islink(dest) and not os.access(dest, os.W_OK | os.X_OK):
                # the old store is marked (a file written in it) before the swap, then
                # removed: found out then, the whole conversion was thrown away
                raise ConfigError(
                    f"{dest}: this process cannot write in it (another user's store, or "
                    "read-only), which replacing it needs; make it writable "
                    f"(chmod u+w {dest}), or choose another destination."
                )
            if overwrite:
                return
            raise ConfigError(
                f"{dest}: already exists; pass overwrite=True (--overwrite) to replace it."
            )
        what = "a folder that is not a Zarr store (no zarr.json, .zgroup or .zarray in it)"
    elif os.path.islink(dest) and not os.path.exists(dest):
        what = f"a symbolic link to {os.readlink(dest)!r}, which does not exist"
    else:
        what = "a file, not a Zarr store"
    raise ConfigError(
        f"{dest}: already exists and is {what}; convert replaces (with --overwrite) Zarr "
        "stores only. Remove it yourself if it is meant to go, or choose another destination."
    )


def _try_lock(f: IO[str]) -> bool:
    """An exclusive lock on ``f``'s file, without waiting: False where another process holds
    it (a convert that is still writing)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _publish(partial: str, dest: str, overwrite: bool) -> None:
    """Make the finished store durable, then publish it with one rename, the commit point:
    ``dest`` holds the old store or the new one, whole, at every instant. An existing
    ``dest`` (overwrite) is swapped out atomically (Linux ``renameat2``), marked and locked
    as a stale partial, then removed; where the kernel or file system cannot swap, it is
    moved aside first (``DST`` is missing for the time between two renames)."""
    if os.path.lexists(dest) and not overwrite:  # it appeared while we converted
        raise _appeared(dest)
    _sync_tree(partial)
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.lexists(dest):
        if _renameat2(partial, dest, _RENAME_NOREPLACE) is None:
            os.rename(partial, dest)  # no renameat2: checked just above
        _sync_dir(parent)
        _unmark(dest)
        return
    folder = os.path.isdir(dest) and not os.path.islink(dest)  # else a link, replaced alone
    with _new_marker(dest) if folder else contextlib.nullcontext():
        if folder:  # the old store, marked and locked: once out, a stale partial
            _sync_dir(dest)
        if _renameat2(partial, dest, _RENAME_EXCHANGE) is not None:
            old = partial  # the two swapped
        else:
            old = f"{dest}.old-{os.getpid()}"
            os.rename(dest, old)
            os.rename(partial, dest)
        _sync_dir(parent)
        _unmark(dest)
        if folder:
            left = _remove_marked(old)
            if left is not None:  # published all the same: the old store's remains are named
                log.warning(
                    "dali_zarr: %s is the new store; the store it replaced stays at %s, which "
                    "this process cannot remove (%s: a file of another user, or in a "
                    "read-only folder); delete it yourself",
                    dest,
                    old,
                    left,
                )
        else:
            os.remove(old)


def _appeared(dest: str) -> ConfigError:
    return ConfigError(
        f"{dest}: was created while this convert ran; pass overwrite=True (--overwrite) "
        "to replace it."
    )


def _unmark(store: str) -> None:
    """The published store's marker, removed (a kill just before leaves only that file)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(store, _MARKER))
    _sync_dir(store)


def _sync_tree(top: str) -> None:
    """fsync every file and folder under ``top``: a rename is journaled, the data it points
    at is not, so without this a power loss could leave a published store of empty chunk
    files. All before the commit, in any order; from threads, so that the file system
    commits many at once (one by one, an unsharded store's thousands of files cost ~20 %
    of a convert's time)."""
    paths = [top]
    for folder, dirs, files in os.walk(top):
        paths += [os.path.join(folder, name) for name in dirs + files]
    with concurrent.futures.ThreadPoolExecutor(min(16, len(paths))) as pool:
        list(pool.map(_sync_path, paths))


def _sync_dir(path: str) -> None:
    """fsync a folder's entries; file systems that cannot (EINVAL) are left as they are."""
    _sync_path(path, os.O_DIRECTORY)


def _sync_path(path: str, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _libc_renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _renameat2(src: str, dst: str, flags: int) -> bool | None:
    """``renameat2(src, dst, flags)``: True when done, None where this kernel, libc or file
    system has no such call or flag (the caller falls back to ``os.rename``). A ``dst``
    that appeared meanwhile (RENAME_NOREPLACE) is refused as such."""
    fn = _libc_renameat2()
    if fn is None:
        return None
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):  # EPERM: a seccomp
        return None  # filter; a real permission error, os.rename raises it again
    if err == errno.EEXIST:
        raise _appeared(dst)
    raise OSError(err, os.strerror(err), src, None, dst)
