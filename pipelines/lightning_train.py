"""Lightning DDP training from a Zarr store: splits from an obs column, exact validation.

    python pipelines/lightning_train.py --data runs/lightning.zarr --generate

runs ``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` (Lightning starts the second
process itself). ``--generate`` writes a synthetic single-cell store with a categorical
``obs/split`` column (train / exactly ``--n-val`` val / ``--n-test`` test rows, scattered).
The data come from :class:`dali_zarr.lightning.ZarrDataModule`: the train loader reshuffles
every epoch (Lightning's ``set_epoch``) with equal batch counts per rank; the val/test
loaders give every rank its share of the split exactly once, so ranks may run different
numbers of steps. The model therefore holds no collective in its eval steps: it sums loss,
hits and counts locally and reduces them once per epoch, which makes the metrics exact.
``--record DIR`` writes each rank's observation ids per epoch and the metrics there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
import zarr

from dali_zarr import synthetic
from dali_zarr.lightning import ZarrDataModule

from classifier import categorical_classes, holds_counts, labelled_loss, mlp  # isort: skip
from classifier import non_negative, positive  # isort: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/lightning.zarr", help="AnnData Zarr store")
    p.add_argument("--generate", action="store_true", help="write a synthetic store if missing")
    p.add_argument("--n-obs", type=positive, default=20_000, help="cells in the generated store")
    p.add_argument("--n-features", type=positive, default=256, help="genes in the generated store")
    p.add_argument(
        "--n-val", type=non_negative, default=2_001, help="val cells in the generated store"
    )
    p.add_argument(
        "--n-test", type=non_negative, default=2_000, help="test cells in the generated store"
    )
    p.add_argument(
        "--element",
        default=None,
        help="what to train on: X (default), raw/X, layers/<name>, obsm/<name>, obsp/<name>",
    )
    p.add_argument("--label", default="cell_type", help="categorical obs column to predict")
    p.add_argument("--devices", type=positive, default=2)
    p.add_argument("--epochs", type=positive, default=2)
    p.add_argument("--batch-size", type=positive, default=128)
    p.add_argument("--eval-batch-size", type=positive, default=256)
    # unset: the suggestion of `dali-zarr inspect` for each split (ZarrDataModule's default)
    p.add_argument("--chunk-size", type=positive, default=None)
    p.add_argument("--preload-nchunks", type=positive, default=None)
    p.add_argument("--hidden", type=positive, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-test", action="store_true", help="skip trainer.test after fitting")
    p.add_argument("--record", default="", help="write per-rank ids and metrics to this folder")
    args = p.parse_args(argv)
    if args.generate and args.n_val + args.n_test > args.n_obs:
        p.error(f"--n-val {args.n_val} + --n-test {args.n_test} is more than --n-obs {args.n_obs}")
    return args


def write_split_column(path: str, *, n_val: int, n_test: int, seed: int = 0) -> None:
    """Add a categorical ``obs/split`` (train/val/test) to an AnnData Zarr store: exactly
    ``n_val`` val and ``n_test`` test rows. Counts that do not fit are refused: slicing the
    permutation with them silently gave other splits (``n_val=-5``: all but 5 rows val)."""
    obs = zarr.open_group(path, mode="r+")["obs"]
    n_obs = obs[obs.attrs["_index"]].shape[0]
    if n_val < 0 or n_test < 0 or n_val + n_test > n_obs:
        raise ValueError(
            f"n_val={n_val}, n_test={n_test}: need two counts >= 0 that sum to at most the "
            f"store's {n_obs} observations"
        )
    codes = np.zeros(n_obs, dtype=np.int8)  # 0 train, 1 val, 2 test
    picked = np.random.default_rng(seed).permutation(n_obs)
    codes[picked[:n_val]] = 1
    codes[picked[n_val : n_val + n_test]] = 2
    column = obs.create_group("split", overwrite=True)
    column.attrs.update({"encoding-type": "categorical", "encoding-version": "0.2.0"})
    column.attrs["ordered"] = False
    column.create_array("codes", data=codes).attrs.update(
        {"encoding-type": "array", "encoding-version": "0.2.0"}
    )
    names = column.create_array("categories", shape=(3,), dtype=str)
    names[...] = np.array(["train", "val", "test"], dtype=object)
    names.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})
    obs.attrs["column-order"] = [*obs.attrs.get("column-order", []), "split"]


class Classifier(L.LightningModule):
    """An MLP on log1p counts (or on the values, for obsm/obsp); eval metrics as (sum,
    count) reduced once per epoch."""

    def __init__(
        self,
        feature_shape: tuple[int, ...],
        n_classes: int,
        *,
        hidden: int,
        lr: float,
        label: str,
        log1p: bool = True,
    ):
        super().__init__()
        self.label, self.lr, self.log1p = label, lr, log1p
        self.net = mlp(feature_shape, hidden=hidden, n_classes=n_classes)
        self.record: dict[str, list] = {"train_loss": [], "val_loss": [], "val_acc": []}
        self.ids: dict[str, np.ndarray] = {}  # observation ids this rank saw, per stage/epoch
        # per stage: ids seen and (loss sum, hits, count); validation runs inside the train
        # epoch, so the stages keep separate accumulators
        self._ids: dict[str, list[np.ndarray]] = {}
        self._sums: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.log1p(x) if self.log1p else x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def _start(self, stage: str) -> None:
        self._ids[stage], self._sums[stage] = [], torch.zeros(3, dtype=torch.float64)

    def _add(self, stage: str, batch: dict, logits: torch.Tensor) -> torch.Tensor:
        if stage not in self._sums:  # a run resumed mid-epoch skips on_train_epoch_start
            self._start(stage)
        y = batch[self.label]
        loss, labelled = labelled_loss(logits, y)  # cells with no label count for nothing
        hits = (logits.argmax(1) == y).sum()
        self._sums[stage] += torch.stack([loss.detach(), hits, labelled]).double()
        self._ids[stage].append(batch["index"].numpy())
        return loss / labelled.clamp_min(1)

    def _end(self, stage: str, key: str) -> tuple[float, float]:
        """Reduce the stage's sums over ranks (one collective, every rank calls it)."""
        total = self.trainer.strategy.reduce(self._sums[stage].clone(), reduce_op="sum")
        loss, acc = float(total[0] / total[2]), float(total[1] / total[2])
        if not self.trainer.sanity_checking:
            self.record.setdefault(f"{stage}_loss", []).append(loss)
            self.record.setdefault(f"{stage}_acc", []).append(acc)
            self.record.setdefault(f"{stage}_steps", []).append(len(self._ids[stage]))
            self.record.setdefault(f"{stage}_count", []).append(int(total[2]))
            self.ids[f"{stage}{key}"] = np.concatenate(self._ids[stage])
        return loss, acc

    # training: plain DDP steps (every rank runs the same number)
    def on_train_epoch_start(self) -> None:
        self._start("train")

    def training_step(self, batch: dict, _: int) -> torch.Tensor:
        return self._add("train", batch, self(batch["X"]))

    def on_train_epoch_end(self) -> None:
        self._end("train", str(self.current_epoch))

    # evaluation: ranks may run different step counts, so no collective per step
    def on_validation_epoch_start(self) -> None:
        self._start("val")

    def validation_step(self, batch: dict, _: int) -> None:
        self._add("val", batch, self(batch["X"]))

    def on_validation_epoch_end(self) -> None:
        loss, acc = self._end("val", str(self.current_epoch))
        # exact already and equal on every rank; sync_dist at epoch end is one more reduce
        # (Lightning's own averaging of per-rank means would not be exact for uneven ranks)
        self.log_dict({"val_loss": loss, "val_acc": acc}, sync_dist=True)

    def on_test_epoch_start(self) -> None:
        self._start("test")

    def test_step(self, batch: dict, _: int) -> None:
        self._add("test", batch, self(batch["X"]))

    def on_test_epoch_end(self) -> None:
        loss, acc = self._end("test", "")
        self.log_dict({"test_loss": loss, "test_acc": acc}, sync_dist=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Lightning re-runs this script for rank 1 inside trainer.fit: the store exists by then
    if args.generate and not Path(args.data).exists() and "LOCAL_RANK" not in os.environ:
        # made whole under another name, then renamed: a run killed before the split column
        # was added left a store without it that every later --generate took as done
        staging = f"{args.data}.unsplit"
        synthetic.make_single_cell(
            staging, n_obs=args.n_obs, n_features=args.n_features, chunk_elements=4_096
        )
        write_split_column(staging, n_val=args.n_val, n_test=args.n_test)
        os.rename(staging, args.data)
    L.seed_everything(0, verbose=False)
    dm = ZarrDataModule(
        data=args.data,
        split_column="split",
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        seed=0,
        obs=[args.label],
        return_index=True,
        open_kwargs={"element": args.element},
    )
    dm.setup()
    n_classes = categorical_classes(dm.dataset.categories(args.label), args.label)  # type: ignore[union-attr, arg-type]
    model = Classifier(
        dm.dataset.feature_shape,  # type: ignore[union-attr]
        n_classes,
        hidden=args.hidden,
        lr=args.lr,
        label=args.label,
        log1p=holds_counts(args.element),
    )
    trainer = L.Trainer(
        strategy="ddp",
        devices=args.devices,
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    if not args.no_test and len(dm.split_rows.get("test", ())):
        trainer.test(model, datamodule=dm, verbose=False)
    elif not args.no_test and trainer.global_rank == 0:  # --n-test 0: nothing to test
        print("no test rows (split 'test' is empty): trainer.test skipped")
    rank = trainer.global_rank
    if rank == 0:
        print(json.dumps({k: v for k, v in model.record.items() if v}))
    if args.record:
        out = Path(args.record)
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / f"rank{rank}.npz", **model.ids)
        (out / f"rank{rank}.json").write_text(json.dumps(model.record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
