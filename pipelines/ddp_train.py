"""DDP training on a Zarr store through dali_zarr: a small MLP predicts an obs label from X.

Launch one process per GPU (or per CPU slot) with torchrun:

    torchrun --nproc_per_node=2 pipelines/ddp_train.py --data runs/demo.zarr --generate

``--generate`` writes a synthetic single-cell store first (rank 0 only; the others wait at a
barrier). Uses gloo on CPU and nccl when CUDA is present. Each rank logs its rows/s and the
epoch's mean loss; rank 0 prints the cross-rank summary.

Checkpoints: ``--checkpoint-dir DIR`` saves ``DIR/checkpoint.pt`` every ``--checkpoint-every``
steps and at the end of each epoch; the same command with ``--resume`` continues from it, in
the middle of an epoch too, with the next batch (another number of ranks splits the rest of
the epoch among them). With ``--checkpoint-dir``, SIGTERM or SIGUSR1 (a SLURM preemption or
time limit, ``sbatch --signal=USR1@120``) makes every rank save at the same step and exit 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.inspection import suggested_settings

from classifier import categorical_classes, holds_counts, labelled_loss, mlp  # isort: skip
from classifier import non_negative, positive  # isort: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data", default="runs/demo.zarr", help="AnnData Zarr store with the --label obs column"
    )
    p.add_argument("--generate", action="store_true", help="write a synthetic store if missing")
    p.add_argument("--n-obs", type=positive, default=50_000, help="cells in the generated store")
    p.add_argument(
        "--n-features", type=positive, default=2_000, help="genes in the generated store"
    )
    p.add_argument(
        "--element",
        default=None,
        help="what to train on: X (default), raw/X, layers/<name>, obsm/<name>, obsp/<name>",
    )
    p.add_argument("--label", default="cell_type", help="categorical obs column to predict")
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument(
        "--max-steps", type=non_negative, default=0, help="stop each epoch after N steps (0: all)"
    )
    p.add_argument("--batch-size", type=positive, default=256)
    p.add_argument(
        "--chunk-size", type=positive, default=None, help="default: dali-zarr inspect's suggestion"
    )
    p.add_argument(
        "--preload-nchunks",
        type=positive,
        default=None,
        help="default: dali-zarr inspect's suggestion",
    )
    p.add_argument("--hidden", type=positive, default=128)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Adam's learning rate (default 1e-3; on --resume, the checkpoint's unless given)",
    )
    p.add_argument("--seed", type=non_negative, default=0)
    p.add_argument(
        "--device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="where dali_zarr decodes and densifies (auto: the GPU path when usable)",
    )
    p.add_argument("--log-json", default="", help="append one JSON line per rank and epoch here")
    p.add_argument(
        "--log-indices",
        default="",
        help="rank r appends each step's obs ids (epoch, step, index) as a JSON line to FILE.r",
        metavar="FILE",
    )
    p.add_argument(
        "--checkpoint-dir",
        default="",
        help="save DIR/checkpoint.pt (model, optimizer, every rank's loader position, step) "
        "at the end of each epoch and every --checkpoint-every steps; a shared filesystem "
        "across nodes",
        metavar="DIR",
    )
    p.add_argument(
        "--checkpoint-every",
        type=non_negative,
        default=0,
        help="also save every N steps, mid-epoch (0: at epoch ends only)",
        metavar="N",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint-dir's checkpoint (start afresh if it holds none yet, "
        "so a requeued job can always pass it)",
    )
    p.add_argument(
        "--stop-after-steps",
        type=non_negative,
        default=0,
        help="exit after step N, saving nothing more (a preemption, for tests; 0: never)",
        metavar="N",
    )
    args = p.parse_args(argv)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.checkpoint_dir:
        problem = unwritable_directory(Path(args.checkpoint_dir))
        if problem:  # found at the first save otherwise: after the training it was to keep
            p.error(f"--checkpoint-dir {args.checkpoint_dir}: {problem}")
    if args.checkpoint_dir and not args.resume and checkpoint_file(args.checkpoint_dir).exists():
        # a new run would overwrite the old one's checkpoint at its first save
        p.error(
            f"{checkpoint_file(args.checkpoint_dir)} exists: pass --resume to continue that "
            "run, or another --checkpoint-dir to start a new one"
        )
    return args


def unwritable_directory(directory: Path) -> str:
    """Why checkpoints cannot be written into ``directory`` (made where missing), or ""."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return ""


def checkpoint_file(directory: str) -> Path:
    return Path(directory) / "checkpoint.pt"


def save_checkpoint(
    directory: str, *, loader: dz.Loader, model: torch.nn.Module, optimizer, **progress: Any
) -> None:
    """Save where the run stands (call on every rank, after the step on the last batch).

    Every rank's loader state goes into one file that rank 0 writes: a checkpoint of one
    step throughout (files per rank, replaced one by one, could hold different steps after a
    kill; load_state_dict refuses those), and the list of all ranks' states is what a resume
    on another number of ranks needs. The model and optimizer are the same on every rank
    (DDP), so rank 0's are saved. The file is written beside the old one and renamed over
    it: a kill mid-write leaves the previous checkpoint whole.
    """
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())
    if dist.get_rank() != 0:
        return
    path = checkpoint_file(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loaders": states,
        "world_size": dist.get_world_size(),
        # this MLP draws no random numbers; a model with dropout would continue its stream
        "rng": torch.get_rng_state(),
        **progress,
    }
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
    os.replace(tmp, path)


class StopSignals:
    """SIGTERM/SIGUSR1 noted on any rank → every rank stops after the same step.

    A rank that saved and left alone would hang the others in their next collective, and
    ranks saving at different steps would make a checkpoint no resume accepts. So each step
    all-reduces a "signalled" flag (MAX) over a gloo group, asynchronously: the flag of step
    ``n`` is read at step ``n + 1``, which keeps the exchange off the training step's path
    (and off the CUDA stream) at the cost of stopping one step later. Every rank calls
    :meth:`agreed` once per step, and every rank runs as many steps (the loader's equal
    batches), so the exchanges pair up.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: str | None = None
        self._group = dist.new_group(backend="gloo")
        self._pending: tuple[Any, torch.Tensor] | None = None
        for signum in self.SIGNALS:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:  # only a flag: the step runs on
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether some rank had a signal by its previous call; starts this step's exchange."""
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return stop

    def close(self) -> None:
        """Finish the last exchange (every rank does, after its last step)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


#: what save_checkpoint writes and a resume reads
CHECKPOINT_KEYS = frozenset(("model", "optimizer", "loaders", "world_size", "rng", "step"))


def load_checkpoint(directory: str) -> dict[str, Any] | None:
    """The checkpoint in ``directory`` (None: none yet), read by every rank, which compare
    what they read: ranks that saw no file, or another one (``directory`` on node-local
    disks, not a filesystem every node shares), started otherwise than the rest and waited
    forever in their first collective that differed. All stop, with one error, instead."""
    path = checkpoint_file(directory)
    resumed, seen = None, "no checkpoint"
    if path.exists():
        try:  # an error on this rank alone would leave the others waiting in the gather
            resumed = torch.load(path, map_location="cpu")
            lacking = sorted(CHECKPOINT_KEYS - set(resumed))
            if lacking:  # another program's file: a KeyError later, mid-setup, otherwise
                raise KeyError(f"it lacks {', '.join(lacking)}")
            seen = f"step {resumed['step']}"
        except Exception as exc:  # a truncated copy, another program's file
            resumed, seen = None, f"unreadable ({type(exc).__name__}: {exc})"
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, seen)
    if len(set(views)) > 1:
        each = "; ".join(f"rank {r}: {v}" for r, v in enumerate(views))
        raise SystemExit(
            f"the ranks read different checkpoints from {path} ({each}): --checkpoint-dir "
            "must be a directory every rank shares (one filesystem on all nodes), where "
            "rank 0 writes the checkpoint"
        )
    if seen.startswith("unreadable"):
        raise SystemExit(
            f"{path} cannot be read as a checkpoint of pipelines/ddp_train.py: {seen}. "
            "Restore a whole copy of it, or move it away to start from step 0"
        )
    return resumed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    if args.generate and rank == 0 and not Path(args.data).exists():
        print(f"[rank 0] writing {args.n_obs} x {args.n_features} synthetic store {args.data}")
        synthetic.make_single_cell(
            args.data,
            n_obs=args.n_obs,
            n_features=args.n_features,
            n_types=min(8, args.n_features),  # a cell type is marked by genes of its own
        )
    dist.barrier()

    dataset = dz.open_dataset(args.data, element=args.element)
    resumed = load_checkpoint(args.checkpoint_dir) if args.resume else None
    if resumed is not None:
        # the suggestion depends on the number of ranks: keep the saved run's, which the
        # loader state must match (flags given explicitly are checked against it instead)
        args.chunk_size = args.chunk_size or resumed["chunk_size"]
        args.preload_nchunks = args.preload_nchunks or resumed["preload_nchunks"]
    elif args.resume and rank == 0:
        print(f"[rank 0] no checkpoint in {args.checkpoint_dir} yet: starting from step 0")
    # CSR rows straddle store chunks: the suggestion spans several (read_amplification)
    chunk_size, preload_nchunks = suggested_settings(
        dataset,
        batch_size=args.batch_size,
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        world_size=world,
    )
    sampler = dz.DistributedSampler(
        dz.ChunkSampler(
            chunk_size=chunk_size,
            preload_nchunks=preload_nchunks,
            batch_size=args.batch_size,
            shuffle=True,
            seed=args.seed,
        ),
        dist_info="torch",
    )
    loader = dz.Loader(
        dataset,
        sampler,
        device=args.device,
        device_id=local_rank,
        obs=[args.label],
        return_index=bool(args.log_indices),
    )
    if resumed is not None:
        # all ranks' states: on as many ranks, each continues its own stream with the next
        # batch; on another number, the rest of the epoch is split among the new ranks.
        # Before the model: a checkpoint of other data is refused naming what differs, not
        # as a weight shape torch cannot copy. Before the first plan (len(loader)): a world
        # the checkpoint cannot use failed there, on rank 0 alone, advising a new chunk_size
        loader.load_state_dict(resumed["loaders"])
    n_classes = categorical_classes(loader.categories(args.label), args.label)
    log1p = holds_counts(args.element)
    if rank == 0:
        print(
            f"[rank 0] {dataset}; chunk_size {chunk_size}, preload_nchunks {preload_nchunks}; "
            f"{world} ranks x {sampler.num_batches(dataset.n_obs)} batches/epoch; input "
            f"{'log1p(x)' if log1p else 'x as stored'}; "
            f"{loader.device_reason}; read paths {loader.read_paths()}"
        )

    torch.manual_seed(args.seed)
    model = mlp(dataset.feature_shape, hidden=args.hidden, n_classes=n_classes).to(device)
    if resumed is not None:
        try:
            model.load_state_dict(resumed["model"])
        except RuntimeError as exc:  # torch's message names layers, not the flag
            raise SystemExit(
                f"{checkpoint_file(args.checkpoint_dir)} holds a model of other shapes than "
                f"--hidden {args.hidden} builds: resume with the --hidden it was trained "
                f"with ({exc})"
            ) from None
        torch.set_rng_state(resumed["rng"])
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3 if args.lr is None else args.lr)
    step, epoch_step = 0, 0  # optimizer steps in all; batches of the current epoch
    if resumed is not None:
        optimizer.load_state_dict(resumed["optimizer"])  # its learning rate too
        if args.lr is not None:  # given: it was silently replaced by the checkpoint's
            for group in optimizer.param_groups:
                group["lr"] = args.lr
        step, epoch_step = resumed["step"], resumed["epoch_step"]
        if rank == 0:
            print(
                f"[rank 0] resumed {checkpoint_file(args.checkpoint_dir)}: step {step}, "
                f"epoch {loader.epoch} after {epoch_step} of its batches, saved by "
                f"{resumed['world_size']} ranks; {len(loader)} batches/rank left in it",
                flush=True,
            )
            if loader.epoch >= args.epochs:
                print(f"[rank 0] --epochs {args.epochs} are done: raise it to train on")

    def checkpoint() -> None:
        save_checkpoint(
            args.checkpoint_dir,
            loader=loader,
            model=model,
            optimizer=optimizer,
            step=step,
            epoch_step=epoch_step,
            chunk_size=chunk_size,
            preload_nchunks=preload_nchunks,
        )

    stop_signals = StopSignals() if args.checkpoint_dir else None
    stopped, signalled = False, False
    # load_state_dict set loader.epoch: a resumed run continues that epoch
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        rows, loss_sum, steps = 0, 0.0, 0  # steps: of this process (rows/s, mean loss)
        start = time.perf_counter()
        startup_s = 0.0  # until the first step is done: pipeline build + JIT on epoch 0
        # resumed from a checkpoint of the step --max-steps ended this epoch at: it is done
        # (iterated, the loader would hand out one batch the uninterrupted run never took)
        cut = bool(args.max_steps) and epoch_step >= args.max_steps
        for batch in () if cut else loader:
            x = batch["X"].to(device, non_blocking=True)
            y = batch[args.label].to(device, non_blocking=True)
            loss_sum_batch, labelled = labelled_loss(ddp(torch.log1p(x) if log1p else x), y)
            loss = loss_sum_batch / labelled.clamp_min(1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach())
            steps += 1
            step += 1
            epoch_step += 1
            if steps == 1:  # rows/s counts steady state: from the end of the first step on
                startup_s = time.perf_counter() - start
                start = time.perf_counter()
            else:
                rows += len(y)
            if args.log_indices:  # closed each step: a kill loses none of the lines
                with open(f"{args.log_indices}.{rank}", "a") as f:
                    ids = batch["index"].tolist()
                    f.write(json.dumps({"epoch": epoch, "step": step, "index": ids}) + "\n")
            if stop_signals is not None and stop_signals.agreed():
                checkpoint()
                stopped = signalled = True
                break
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpoint()
            if step == args.stop_after_steps:
                stopped = True
                break
            if args.max_steps and epoch_step >= args.max_steps:
                break
        if signalled:
            print(
                f"[rank {rank}] a rank got {stop_signals.received or 'a signal'}: saved "
                f"{checkpoint_file(args.checkpoint_dir)} after step {step} and stopped; the "
                "same command with --resume continues",
                flush=True,
            )
            break
        if stopped:
            print(f"[rank {rank}] stopped after step {step} (--stop-after-steps)", flush=True)
            break
        elapsed = time.perf_counter() - start
        # one step has no steady state to time: its rate is unknown (None), not 0
        rate = rows / elapsed if rows else None
        shown = "rows/s n/a (timed from the 2nd step on)" if rate is None else f"{rate:,.0f} rows/s"
        # no step (a resume of an epoch with nothing left): no loss, not a loss of 0
        mean_loss = loss_sum / steps if steps else None
        loss_shown = "n/a (no step)" if mean_loss is None else f"{mean_loss:.4f}"
        record = {
            "rank": rank,
            "epoch": epoch,
            "steps": steps,
            "rows_per_s": rate,
            "startup_s": startup_s,
            "loss": mean_loss,
        }
        print(
            f"[rank {rank}] epoch {epoch}: {steps} steps, {shown} "
            f"(first step {startup_s:.2f} s), loss {loss_shown}",
            flush=True,
        )
        if args.log_json:
            with open(args.log_json, "a") as f:
                f.write(json.dumps(record) + "\n")
        # NaN: the total of the ranks' rates is unknown if one's is
        summary = torch.tensor(
            [math.nan if mean_loss is None else mean_loss, math.nan if rate is None else rate],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(summary)
        if rank == 0:
            loss, total = summary[0].item() / world, summary[1].item()
            shown = "rows/s n/a" if math.isnan(total) else f"{total:,.0f} rows/s"
            loss_shown = "n/a" if math.isnan(loss) else f"{loss:.4f}"
            print(f"[all] epoch {epoch}: mean loss {loss_shown}, total {shown}", flush=True)
        epoch_step = 0
        if args.checkpoint_dir:
            # saved as the next epoch's start, not this one's end: resumed, an epoch that
            # --max-steps cut short would otherwise run on to its last batch
            loader.set_epoch(epoch + 1)
            checkpoint()
    if stop_signals is not None:
        stop_signals.close()
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
