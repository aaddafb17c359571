"""Find this process's rank and the world size, and check that the ranks agree.

Kept apart from the planning code (which never communicates) so that the only places
that touch torch.distributed / jax are here, imported lazily: the planner stays importable
and testable without either framework being initialised.

Disjoint shards need every rank to plan from the same inputs. A rank seeded with
``seed + rank``, opening another store, or resuming from another step's state would plan
alone: rows delivered twice or never, or batch counts that differ and leave DDP waiting
forever. Where the sampler's ranks are torch.distributed's own, or JAX's processes under
``jax.distributed``, :func:`gather_across_ranks` exchanges those inputs once (at a sampler's
and a loader's construction and on ``load_state_dict``, never per batch or epoch) and
:func:`refuse_disagreement` raises the same error on every rank, so no rank is left waiting.
"""

from __future__ import annotations

import operator
import os
import pickle
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal, TypeAlias

from dali_zarr.errors import ConfigError

__all__ = [
    "CHECK_RANKS_ENV",
    "DistInfo",
    "Exchange",
    "agree_or_raise",
    "broadcast_seed",
    "cgroup_cpus",
    "collectives_may_hang",
    "cpu_share",
    "exchange_of_initialized",
    "exchange_over",
    "gather_across_ranks",
    "initialized_worlds",
    "jax_world_is",
    "refuse_another_world",
    "refuse_disagreement",
    "resolve_rank_world",
    "torch_dist_initialized",
    "torch_world_is",
    "world_is",
]

DistInfo: TypeAlias = Literal["torch", "jax", "env"] | Callable[[], tuple[int, int]]

_DIST_INFO_HELP = (
    'dist_info must be "torch" (torch.distributed), "jax" (jax.process_index/process_count), '
    '"env" (RANK/WORLD_SIZE as set by torchrun, or SLURM_PROCID/SLURM_NTASKS) or a callable '
    "returning (rank, world_size)"
)


def torch_dist_initialized() -> bool:
    """True when torch.distributed is importable, available and has a process group."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _from_torch() -> tuple[int, int]:
    if not torch_dist_initialized():
        raise ConfigError(
            'dist_info="torch" but torch.distributed is not initialized: call '
            "torch.distributed.init_process_group(...) before creating the DistributedSampler, "
            'or pass dist_info="env" (torchrun/SLURM variables) or a callable returning '
            "(rank, world_size)"
        )
    import torch.distributed as dist

    return int(dist.get_rank()), int(dist.get_world_size())


def _from_jax() -> tuple[int, int]:
    try:
        import jax
    except ImportError:
        raise ConfigError(
            'dist_info="jax" but jax is not installed: install jax, or pass dist_info="torch", '
            '"env" or a callable returning (rank, world_size)'
        ) from None
    return int(jax.process_index()), int(jax.process_count())


def _env_int(
    name: str, way_out: str = "pass dist_info as a callable returning (rank, world_size)"
) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer: fix or unset it, or {way_out}"
        ) from None


def _from_env() -> tuple[int, int]:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _env_int("RANK"), _env_int("WORLD_SIZE")
    # one of torchrun's pair alone is a launcher (or a script) that set it for a reason:
    # falling back to srun's variables (SLURM_PROCID=0, SLURM_NTASKS=1 inside an
    # allocation) would make this rank another one, or the only one, and its rows repeat
    for have, lack in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in env:
            raise ConfigError(
                f'dist_info="env": {have}={env[have]!r} is set but {lack} is not; set both '
                f"(torchrun does), unset {have} to use SLURM_PROCID/SLURM_NTASKS, or pass a "
                "callable returning (rank, world_size)"
            )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    raise ConfigError(
        'dist_info="env" but neither RANK and WORLD_SIZE (torchrun) nor SLURM_PROCID and '
        "SLURM_NTASKS (srun) are set: launch with torchrun/srun, set those variables, or pass "
        "a callable returning (rank, world_size)"
    )


def initialized_worlds() -> list[tuple[Exchange, int, int]]:
    """``(whose, rank, world size)`` of each of torch.distributed and jax.distributed that
    is initialized in this process."""
    worlds: list[tuple[Exchange, int, int]] = []
    if torch_dist_initialized():
        import torch.distributed as dist

        worlds.append(("torch", int(dist.get_rank()), int(dist.get_world_size())))
    if _jax_distributed_up():
        jax = sys.modules["jax"]
        worlds.append(("jax", int(jax.process_index()), int(jax.process_count())))
    return worlds


def refuse_another_world(rank: object, world: object) -> None:
    """Refuse launcher variables that count another number of processes than an initialized
    torch.distributed or jax.distributed of several, or that give this process another rank
    in one of as many: variables a wrapper or an allocation left behind (``salloc -n 1``'s
    SLURM_NTASKS=1 under ``mp.spawn``, a RANK=0 exported to every task) made every rank
    rank 0 of 1, each delivering every row, or two ranks one: rows twice, and the rank whose
    numbers matched exchanged its settings alone, paired with another rank's next
    collective (DDP's parameter check, or garbage)."""
    names = "RANK/WORLD_SIZE" if "RANK" in os.environ else "SLURM_PROCID/SLURM_NTASKS"
    for whose, their_rank, their_world in initialized_worlds():
        if their_world < 2:
            continue
        framework = f"{whose}.distributed"
        if str(their_world) != str(world).strip():
            raise ConfigError(
                f'dist_info="env": {names} say rank {rank} of {world}, but {framework} is '
                f"initialized with {their_world} processes (this one is rank {their_rank}); the "
                "sampler would split the data for another number of ranks (rows twice or "
                f"never). Fix or unset the stale {names} variables, or pass "
                f'dist_info="{whose}"'
            )
        if str(their_rank) != str(rank).strip():
            raise ConfigError(
                f'dist_info="env": {names} say rank {rank} of {world}, but {framework} '
                f"says this one is rank {their_rank}; ranks that take another rank's number "
                f"deliver its rows twice (and others never). Fix or unset the stale {names} "
                f'variables, or pass dist_info="{whose}"'
            )


def resolve_rank_world(dist_info: DistInfo) -> tuple[int, int]:
    """Return ``(rank, world_size)`` from ``dist_info``, checking ``0 <= rank < world_size``."""
    if callable(dist_info):
        try:
            rank, world = dist_info()
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"dist_info callable must return a (rank, world_size) pair of ints: {e}"
            ) from e
        source = "the dist_info callable"
    elif dist_info == "torch":
        rank, world = _from_torch()
        source = "torch.distributed"
    elif dist_info == "jax":
        rank, world = _from_jax()
        source = "jax"
    elif dist_info == "env":
        rank, world = _from_env()
        source = "the environment"
        refuse_another_world(rank, world)
    else:
        raise ConfigError(f"unknown dist_info {dist_info!r}: {_DIST_INFO_HELP}")
    try:
        rank, world = _integer(rank), _integer(world)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source} gave rank={rank!r}, world_size={world!r}; both must be integers"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"{source} gave rank={rank}, world_size={world}; need world_size >= 1 and "
            "0 <= rank < world_size: fix the launcher settings or the dist_info callable"
        )
    return rank, world


def _integer(value: object) -> int:
    """An int, or a string of one (environment variables); ``int()`` would also take 0.7
    (and True) and quietly make a rank of it."""
    if isinstance(value, str):
        return int(value)
    if isinstance(value, bool):
        raise TypeError("a bool is not a rank")
    return operator.index(value)  # type: ignore[arg-type]


def broadcast_seed(seed: int) -> int:
    """Return rank 0's ``seed`` on every rank (torch.distributed must be initialized).

    Used when the user passed ``seed=None``: each rank drew its own random seed, and they
    must agree on one so that all ranks compute the same global chunk order.
    """
    if not torch_dist_initialized():
        raise ConfigError(
            "cannot broadcast a seed: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first, or pass an explicit seed"
        )
    return int(gather_across_ranks(int(seed))[0])  # type: ignore[call-overload]


#: ``DALI_ZARR_CHECK_RANKS=0`` turns the exchanges off (and the gloo group they use under
#: NCCL): for jobs whose nodes reach each other over NCCL's network only.
CHECK_RANKS_ENV = "DALI_ZARR_CHECK_RANKS"


def _checks_off() -> bool:
    return os.environ.get(CHECK_RANKS_ENV, "1") == "0"


#: whose processes the ranks' exchanges run over
Exchange: TypeAlias = Literal["torch", "jax"]


def exchange_over(rank: int, world_size: int, *, dist_info: object = None) -> Exchange | None:
    """Over whose processes these ranks exchange their inputs: ``"torch"`` where they are
    torch.distributed's world (:func:`torch_world_is`), ``"jax"`` where they are JAX's
    processes (:func:`jax_world_is`); None for one rank, for ranks that are neither's
    (nobody to ask), and with the checks turned off. ``dist_info="jax"`` asks JAX first:
    the sampler's ranks are JAX's by construction, whatever torch's numbering."""
    if world_size < 2 or _checks_off():
        return None
    order: tuple[Exchange, ...] = ("jax", "torch") if dist_info == "jax" else ("torch", "jax")
    return next((over for over in order if world_is(over, rank, world_size)), None)


def exchange_of_initialized() -> Exchange | None:
    """Over whose processes a rank whose own rank or world size was refused still exchanges:
    an initialized torch.distributed (else jax.distributed) of several; None without one,
    and with the checks turned off."""
    worlds = [whose for whose, _, n in initialized_worlds() if n > 1]
    return None if not worlds or _checks_off() else worlds[0]


def world_is(over: Exchange, rank: int, world_size: int) -> bool:
    """Whether ``rank`` of ``world_size`` is this process in torch's or JAX's world."""
    if over == "jax":
        return jax_world_is(rank, world_size)
    return torch_world_is(rank, world_size)


def collectives_may_hang() -> bool:
    """True where the ranks train with collectives that wait for every rank (an initialized
    torch.distributed or jax.distributed): there, uneven batch counts would hang the job."""
    return torch_dist_initialized() or _jax_distributed_up()


def _jax_distributed_up() -> bool:
    """Whether the program imported jax and initialized ``jax.distributed`` (only asked
    where jax is imported already: importing it costs seconds). JAX before 0.5.1 has no
    ``jax.distributed.is_initialized``: its distributed client says it instead."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    try:
        from jax._src import distributed as jax_distributed
    except ImportError:
        return False
    return getattr(jax_distributed.global_state, "client", None) is not None


def jax_world_is(rank: int, world_size: int) -> bool:
    """True when ``jax.distributed`` is initialized with exactly this process index and
    count."""
    if not _jax_distributed_up():
        return False
    jax = sys.modules["jax"]
    return jax.process_index() == rank and jax.process_count() == world_size


def torch_world_is(rank: int, world_size: int) -> bool:
    """True when torch.distributed is initialized with exactly this rank and world size:
    then every process of its world is one of the sampler's ranks and may be asked to take
    part in a check (a data-parallel group smaller than the world, as with pipeline
    parallelism, is not: its other processes may never build a loader)."""
    if not torch_dist_initialized():
        return False
    import torch.distributed as dist

    return dist.get_rank() == rank and dist.get_world_size() == world_size


# (the default group it was made for, a gloo group over the same ranks)
_CPU_GROUP: list[tuple[object, object]] = []


def _cpu_group() -> object | None:
    """A process group that exchanges objects on the CPU: the default one where it has a
    CPU backend (gloo, or ``cpu:gloo,cuda:nccl``), else a gloo group made once over the same
    ranks. NCCL alone would stage the objects on ``torch.cuda.current_device()``, which is
    device 0 on every rank unless the script called ``torch.cuda.set_device``, and NCCL
    refuses ranks that share a device. Made lazily, by the first check, which every rank
    reaches in the same order (a sampler's construction)."""
    import torch.distributed as dist

    if "gloo" in _backend_name() or _checks_off():
        return None
    world = dist.group.WORLD
    if not _CPU_GROUP or _CPU_GROUP[0][0] is not world:
        _CPU_GROUP[:] = [(world, dist.new_group(backend="gloo"))]
    return _CPU_GROUP[0][1]


def _backend_name() -> str:
    """The default group's backend, e.g. ``gloo``, ``nccl`` or ``cpu:gloo,cuda:nccl``."""
    import torch.distributed as dist

    return str(dist.get_backend()).lower()


def gather_across_ranks(payload: object, *, over: Exchange = "torch") -> list[object]:
    """Every rank's ``payload`` (small and picklable), in rank order, on every rank.

    A collective over torch.distributed's world or JAX's processes (``over``): every rank
    must call it at the same point.
    """
    if over == "jax":
        return _jax_gather(payload)
    import torch.distributed as dist

    rows: list[object] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(rows, payload, group=_cpu_group())
    except RuntimeError as exc:  # gloo's "Timed out waiting ..." / "Connection closed by peer"
        raise RuntimeError(
            f"dali_zarr: rank {dist.get_rank()} of {dist.get_world_size()} waited in vain for "
            "the other ranks to exchange their sampler and loader settings (every rank must "
            "build its DistributedSampler and Loader, and load a state, at the same point; "
            f"did a rank stop, or take another path?): {exc}"
        ) from exc
    return rows


def _jax_gather(payload: object) -> list[object]:
    """:func:`gather_across_ranks` over ``jax.distributed``'s processes: the pickled payloads
    as uint8 arrays through ``process_allgather`` (sizes first, then the bytes padded to the
    longest), which runs on whatever devices JAX has, the CPU included."""
    import numpy as np
    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps(payload), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int32)))
    sizes = sizes.reshape(-1).tolist()
    padded = np.zeros(max(sizes), np.uint8)
    padded[: blob.size] = blob
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(rows[r, :n].tobytes()) for r, n in enumerate(sizes)]


def agree_or_raise(
    mine: Mapping[str, object],
    *,
    over: Exchange,
    local_error: Exception | None,
    what: str,
    hints: Mapping[str, str] | None = None,
    not_compared: Collection[str] = (),
) -> list[dict[str, object]]:
    """Exchange ``mine`` and refuse disagreement (:func:`refuse_disagreement`) on all but
    the ``not_compared`` keys; every rank's ``mine``, in rank order. A rank whose own checks
    failed first (``local_error``) still takes part, so that every rank raises instead of
    the others waiting in the exchange for a rank that left: that rank raises its own
    error, the others one that names it."""
    error = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    rows: list[dict[str, object]] = gather_across_ranks({"error": error, **mine}, over=over)  # type: ignore[assignment]
    if local_error is not None:
        raise local_error
    failed = [(rank, row["error"]) for rank, row in enumerate(rows) if row["error"]]
    if failed:
        rank, text = failed[0]
        raise ConfigError(
            f"{what}: rank {rank} could not go on ({text}); "
            f"{len(failed)} of {len(rows)} ranks failed, so every rank stops here."
        )
    ignored = {"error", *not_compared}
    compared = [{k: v for k, v in row.items() if k not in ignored} for row in rows]
    refuse_disagreement(compared, what=what, hints=hints)
    return rows


def refuse_disagreement(
    rows: Sequence[Mapping[str, object]],
    *,
    what: str,
    hints: Mapping[str, str] | None = None,
) -> None:
    """Raise a ConfigError, on every rank alike, if the ranks' ``rows`` (from
    :func:`gather_across_ranks`) differ in any key; the error gives each differing value
    with the ranks that hold it and, from ``hints``, what to change."""
    problems = []
    for key in rows[0]:
        by_value: dict[str, list[int]] = {}
        for rank, row in enumerate(rows):
            by_value.setdefault(repr(row.get(key)), []).append(rank)
        if len(by_value) > 1:
            held = "; ".join(
                f"{_ranks_text(ranks)}: {value}" for value, ranks in list(by_value.items())[:4]
            )
            more = f"; {len(by_value) - 4} more values" if len(by_value) > 4 else ""
            hint = (hints or {}).get(key, "")
            problems.append(f"{key} ({held}{more}){': ' + hint if hint else ''}")
    if problems:
        raise ConfigError(
            f"{what}: the {len(rows)} ranks disagree on " + "; and on ".join(problems) + ". "
            "Every rank must plan from the same inputs, or rows are delivered twice or "
            "never and the ranks' batch counts can differ (DDP would wait forever)."
        )


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0, 1, 2`` / ``ranks 0, 1, 2, ... (12 ranks)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:6])
    return f"ranks {shown}" + (f", ... ({len(ranks)} ranks)" if len(ranks) > 6 else "")


#: where launchers put a process's rank on its node: torchrun, then srun
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID")


def local_rank() -> tuple[str, int] | None:
    """``(variable, value)`` of this process's rank on its node from its launcher (torchrun's
    ``LOCAL_RANK``, else srun's ``SLURM_LOCALID``); None when neither is set."""
    for name in LOCAL_RANK_VARS:
        if name in os.environ:
            return name, _env_int(name, "pass the GPU as Loader(..., device_id=...)")
    return None


def local_world_size() -> int:
    """Processes of this job on this node, from the launcher's variables (1 when unknown)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = os.environ.get(name, "")
        try:
            n = _tasks_on_this_node(raw) if name == "SLURM_TASKS_PER_NODE" else int(raw)
        except ValueError:
            continue
        if n >= 1:
            return n
    return 1


def _tasks_on_this_node(raw: str) -> int:
    """This node's count in SLURM's ``4(x2),3`` (4 tasks on each of 2 nodes, 3 on the
    third): the entry of srun's ``SLURM_NODEID``, else the first node's. The first node's
    alone gave a task on the third node 4 ranks' split of a node it shares with 2 others
    (``1,4(x3)``: a 4-task node's ranks each sized their pools for the whole node)."""
    counts: list[int] = []
    for part in raw.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    try:
        node = int(os.environ.get("SLURM_NODEID", ""))
    except ValueError:
        node = 0
    return counts[node] if 0 <= node < len(counts) else counts[0]


def _cpu_list_size(text: str) -> int:
    """CPUs in a cpuset list such as ``0-3,8,10-11`` (7)."""
    n = 0
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
    return n


def _own_cgroup(proc: str, controller: str) -> list[str] | None:
    """This process's cgroup path, as its parts, from ``proc`` (``/proc/self/cgroup``):
    cgroup v2's (``controller=""``, the ``0::/path`` line) or the v1 hierarchy holding
    ``controller``; None where ``proc`` names none (or cannot be read)."""
    try:
        with open(proc) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for fields in lines:
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        v2 = hierarchy == "0" and controllers == ""
        if (v2 and not controller) or (controller and controller in controllers.split(",")):
            return [part for part in path.split("/") if part]
    return None


def cgroup_cpuset(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """CPUs in this process's cgroup cpuset (v2 ``cpuset.cpus.effective``, v1
    ``cpuset.effective_cpus``), or None where it cannot be read.

    ``docker --cpuset-cpus`` and a SLURM job's cgroup narrow the affinity of every rank
    alike: an affinity equal to the cpuset is shared by the node's ranks, one narrower than
    it was made for this rank (``--cpu-bind``, ``taskset``, ``numactl``)."""
    v2, v1 = _own_cgroup(proc, ""), _own_cgroup(proc, "cpuset")
    candidates = [os.path.join(root, *v2, "cpuset.cpus.effective")] if v2 is not None else []
    if v1 is not None:
        base = os.path.join(root, "cpuset", *v1)
        candidates += [os.path.join(base, n) for n in ("cpuset.effective_cpus", "cpuset.cpus")]
    # a container that sees its own cgroup at the root, under a path named for the host
    candidates += [os.path.join(root, "cpuset.cpus.effective")]
    candidates += [os.path.join(root, "cpuset", "cpuset.effective_cpus")]
    for path in candidates:
        try:
            with open(path) as f:
                n = _cpu_list_size(f.read())
        except (OSError, ValueError):
            continue
        if n > 0:
            return n
    return None


def cgroup_cpus(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """The CPU quota of this process's container in whole cores (rounded up), or None when
    it has none: cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.

    Kubernetes and Docker limit a container's CPUs with a quota, not an affinity, so the
    affinity still shows every core of the host. Under cgroup v2 the quota may sit on this
    process's own cgroup below the root (no cgroup namespace: ``docker --cgroupns=host``,
    a systemd unit's ``CPUQuota=``) or on an ancestor (a pod's limit): every ``cpu.max``
    from this process's cgroup (``proc``) up to ``root`` counts, the tightest wins."""
    parts = _own_cgroup(proc, "") or []
    quotas = []
    for depth in range(len(parts), -1, -1):  # this cgroup, its parents, the root
        try:
            with open(os.path.join(root, *parts[:depth], "cpu.max")) as f:
                quotas.append(_quota_cores(*f.read().split()[:2]))
        except (OSError, TypeError):
            continue
    if any(q is not None for q in quotas):
        return min(q for q in quotas if q is not None)
    if quotas:  # cgroup v2 without a quota ("max")
        return None
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = f.read().strip()
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = f.read().strip()
    except OSError:
        return None
    return _quota_cores(quota, period)


def _quota_cores(quota: str, period: str) -> int | None:
    """Whole cores of a quota per period, rounded up; None for no quota ("max" in v2, -1 in
    v1) or an unreadable one."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def cpu_share() -> int:
    """CPU cores this process may count on for its I/O threads (at least 1).

    ``os.cpu_count()`` is the node's count, but torchrun starts one process per GPU and each
    would size its pools for the whole node (8 ranks x 8 readers x 16 kvikio threads on a
    32-core node). The cores this process may run on (its affinity: what SLURM's or
    taskset's binding left it) are split between the node's ranks (torchrun's
    ``LOCAL_WORLD_SIZE``, or SLURM's ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``,
    this node's entry of it, by ``SLURM_NODEID``), unless a binding already gave
    it fewer cores than its cgroup's cpuset (:func:`cgroup_cpuset`; else the node) holds,
    which is that split made by the launcher. A container's CPU quota
    (:func:`cgroup_cpus`) is split between the ranks too.
    """
    node = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        mine = node
    ranks = local_world_size()
    shared_by_all = cgroup_cpuset() or node  # what every rank of a container or job may use
    share = mine if mine < shared_by_all else mine // ranks
    quota = cgroup_cpus()
    if quota is not None:
        share = min(share, quota // ranks)
    return max(1, share)
