"""ZarrDataModule: splits from an obs column or masks, epochs reshuffled by the Trainer, exact
validation; and pipelines/lightning_train.py under Trainer(strategy="ddp", devices=2)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.errors import ConfigError

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from dali_zarr.lightning import ZarrDataModule  # noqa: E402
from tests.processes import ROOT, run_ok  # noqa: E402

EXAMPLE = ROOT / "pipelines" / "lightning_train.py"


def load_example():
    sys.path.insert(0, str(EXAMPLE.parent))  # its shared model module, as when it runs
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


example = load_example()


@pytest.fixture(scope="module")
def split_store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lightning") / "sc.zarr"
    synthetic.make_single_cell(path, n_obs=1_200, n_features=32, chunk_elements=512)
    example.write_split_column(str(path), n_val=151, n_test=100)
    return str(path)


def split_codes(path: str) -> np.ndarray:
    return zarr.open_group(path)["obs/split/codes"][...]


def test_splits_from_column_masks_and_ids(split_store: str) -> None:
    codes = split_codes(split_store)
    dm = ZarrDataModule(data=split_store)  # split_column defaults to "split"
    dm.setup()
    for code, name in enumerate(("train", "val", "test")):
        np.testing.assert_array_equal(dm.split_rows[name], np.flatnonzero(codes == code))
    assert dz.open_dataset(split_store).categories("split") == ("train", "val", "test")
    sub = dm.subset("val")
    assert isinstance(sub, dz.Subset) and sub.n_obs == 151
    masks = ZarrDataModule(data=dz.open_dataset(split_store), splits={"train": codes == 0})
    masks.setup()
    np.testing.assert_array_equal(masks.split_rows["train"], dm.split_rows["train"])
    with pytest.raises(dz.ConfigError, match="split 'val' is empty"):
        masks.subset("val")
    ids = ZarrDataModule(data=split_store, splits={"train": [5, 1, 2], "val": [3]})
    ids.setup()
    np.testing.assert_array_equal(ids.split_rows["train"], [1, 2, 5])
    labels = ZarrDataModule(data=split_store, split_labels={"train": ["train", "test"]})
    labels.setup()
    assert len(labels.split_rows["train"]) == 1_200 - 151
    with pytest.raises(dz.ConfigError, match="share 1 observations"):
        ZarrDataModule(data=split_store, splits={"train": [1, 2], "val": [2]}).setup()
    with pytest.raises(dz.ConfigError, match=r"'train' and 'val' share 151 observations"):
        ZarrDataModule(  # labels that overlap gave overlapping splits, a leak
            data=split_store, split_labels={"train": ["train", "val"], "val": "val"}
        ).setup()
    with pytest.raises(dz.ConfigError, match=r"obs='split': pass a list of column names"):
        ZarrDataModule(data=split_store, obs="split")  # had asked for columns 's', 'p', ...
    with pytest.raises(dz.ConfigError, match="not both"):
        ZarrDataModule(data=split_store, split_column="split", splits={"train": [1]})
    with pytest.raises(dz.ConfigError, match="unknown split"):
        ZarrDataModule(data=split_store, splits={"valid": [1]})


def test_splits_of_a_subset_are_rows_of_that_subset(split_store: str) -> None:
    """data= a Subset (a QC filter): splits= masks or ids over its rows were turned into the
    store's rows, which subset() then read as the subset's rows again, so every split
    delivered rows shifted past the filtered-out ones (other rows than asked, silently), or
    was refused as out of range where a split held the last rows."""
    keep = np.ones(1_200, bool)
    keep[[10, 500]] = False  # QC drops two cells: local row i > 10 is stored row i + 1 ...
    data = dz.Subset(dz.open_dataset(split_store), keep)
    rng = np.random.default_rng(0)
    order = rng.permutation(data.n_obs)
    train = np.zeros(data.n_obs, bool)
    train[order[:900]] = True
    dm = ZarrDataModule(
        data=data, splits={"train": train, "val": order[900:1_100]}, batch_size=32,
        chunk_size=16, return_index=True, device="cpu",
    )  # fmt: skip
    dm.setup()
    stored = np.flatnonzero(keep)
    for name, local in (("train", np.flatnonzero(train)), ("val", np.sort(order[900:1_100]))):
        np.testing.assert_array_equal(dm.split_rows[name], local)
        np.testing.assert_array_equal(dm.subset(name).parent_rows, stored[local])
        loader = dm.train_dataloader() if name == "train" else dm.val_dataloader()
        ids = np.concatenate([batch["index"].numpy() for batch in loader])
        np.testing.assert_array_equal(np.sort(ids), stored[local])  # the store's own ids
    with pytest.raises(dz.DatasetError, match=r"splits\['val'\] of .*row id 1198 is outside"):
        ZarrDataModule(data=data, splits={"val": [1_198]}).setup()


def test_integer_labels_select_an_integer_categorical(tmp_path) -> None:
    """obs categories are text, so split_labels={"train": 0, ...} on an integer categorical
    matched nothing and said "no observation has fold=0" of a column a third of which is 0."""
    import anndata
    import pandas as pd
    import scipy.sparse as sp

    n = 90
    adata = anndata.AnnData(
        X=sp.random(n, 8, density=0.3, format="csr", dtype=np.float32, random_state=0),
        obs=pd.DataFrame(
            {"fold": pd.Categorical(np.arange(n) % 3)}, index=[str(i) for i in range(n)]
        ),
    )
    adata.write_zarr(tmp_path / "folds.zarr")
    for labels in ({"train": 0, "val": [1], "test": 2}, {"train": np.int64(0), "val": 1}):
        dm = ZarrDataModule(data=str(tmp_path / "folds.zarr"), split_column="fold",
                            split_labels=labels)  # fmt: skip
        dm.setup()
        for fold, name in enumerate(labels):
            np.testing.assert_array_equal(dm.split_rows[name], np.arange(fold, n, 3))


def test_too_small_eval_split_is_refused(split_store: str) -> None:
    dm = ZarrDataModule(data=split_store, splits={"val": [1, 2, 3]}, dist_info=lambda: (1, 4))
    with pytest.raises(dz.ConfigError, match="3 observations for 4 ranks"):
        dm.val_dataloader()


def test_too_small_train_split_says_what_the_module_lets_you_change(split_store: str) -> None:
    """The refusal came from the sampler at the first len() or batch and advised
    enforce_equal_batches=False, which the module does not take; it comes when the train
    loader is built and names what may change."""
    dm = ZarrDataModule(
        data=split_store, splits={"train": np.arange(100)}, batch_size=64, dist_info=lambda: (0, 4)
    )
    with pytest.raises(
        dz.ConfigError,
        match=r"split 'train' has 100 observations for 4 ranks: .* at most 1 ranks .*"
        r"batch_size and chunk_size of at most 25, use at most 1 devices",
    ) as refused:
        dm.train_dataloader()
    assert "enforce_equal_batches=False" not in str(refused.value)


def test_eval_splits_smaller_than_a_batch_are_served(split_store: str) -> None:
    """An eval split of fewer rows than a batch (settings suggested, or chunks cut down so
    each rank gets one) still has a window of a batch: every row once, one partial batch."""
    for settings, world in (
        ({}, 1),
        ({"chunk_size": 64, "preload_nchunks": 1, "batch_size": 64}, 2),
    ):
        dm = ZarrDataModule(data=split_store, splits={"train": np.arange(100),
                            "val": np.arange(100, 140)}, eval_batch_size=64, return_index=True,
                            dist_info=lambda world=world: (0, world), **settings)  # fmt: skip
        rows = np.concatenate([b["index"].numpy() for b in dm.val_dataloader()])
        want = np.arange(100, 140)[: 40 // world] if world > 1 else np.arange(100, 140)
        np.testing.assert_array_equal(np.sort(rows), want)


def test_an_eval_batch_larger_than_the_train_window_is_served(split_store: str) -> None:
    """chunk_size/preload_nchunks sized for the train batch and a larger eval_batch_size were
    refused at construction ("raise preload_nchunks to at least 16"), though the eval loaders
    widen their own window to a batch; the advice would have made train windows 8x larger."""
    dm = ZarrDataModule(data=split_store, splits={"train": np.arange(600),
                        "val": np.arange(600, 1_200)}, chunk_size=64, preload_nchunks=2,
                        batch_size=128, eval_batch_size=1_024, return_index=True)  # fmt: skip
    sizes = [len(b["index"]) for b in dm.val_dataloader()]
    rows = np.concatenate([b["index"].numpy() for b in dm.val_dataloader()])
    assert sizes == [600]
    np.testing.assert_array_equal(np.sort(rows), np.arange(600, 1_200))
    assert max(len(b["index"]) for b in dm.train_dataloader()) == 128
    with pytest.raises(dz.ConfigError, match="batch_size=256 is larger than a window"):
        ZarrDataModule(data=split_store, chunk_size=64, preload_nchunks=2, batch_size=256)
    dm.teardown()


def test_loader_kwargs_are_checked_against_the_modules_own_arguments(split_store: str) -> None:
    """loader_kwargs={"allow_uneven_batches": True} (a Loader argument the docs send there)
    made every val/test loader fail with "got multiple values for keyword argument"; so did
    one of the module's own arguments (obs, device, ...), for every loader, at the first
    batch Lightning asked for. The latter are refused at construction, by name."""
    splits = {"train": np.arange(600), "val": np.arange(600, 700)}
    dm = ZarrDataModule(data=split_store, splits=splits, return_index=True,
                        loader_kwargs={"allow_uneven_batches": True, "num_threads": 1})  # fmt: skip
    rows = np.concatenate([b["index"].numpy() for b in dm.val_dataloader()])
    np.testing.assert_array_equal(np.sort(rows), np.arange(600, 700))
    assert len(dm.train_dataloader()) > 0
    dm.teardown()
    for key, value in (("obs", ["cell_type"]), ("device", "cpu")):
        with pytest.raises(dz.ConfigError, match=f"loader_kwargs: {key} set by ZarrDataModule"):
            ZarrDataModule(data=split_store, splits=splits, loader_kwargs={key: value})
    # split_labels beside splits were ignored without a word
    with pytest.raises(dz.ConfigError, match=r"with splits .* they select nothing"):
        ZarrDataModule(data=split_store, splits=splits, split_labels={"train": "a"})
    # a list where a dict goes was dict()'s bare TypeError or ValueError; eval_batch_size
    # was called batch_size
    for key in ("loader_kwargs", "open_kwargs", "split_labels"):
        with pytest.raises(dz.ConfigError, match=rf"{key} must be a dict .*got \['train'\]"):
            ZarrDataModule(data=split_store, **{key: ["train"]})
    with pytest.raises(dz.ConfigError, match="eval_batch_size must be a positive integer"):
        ZarrDataModule(data=split_store, eval_batch_size=-1)


def test_open_kwargs_beside_an_opened_dataset_are_refused(split_store: str) -> None:
    """open_kwargs go to open_dataset, which a Dataset given as data= never reaches: with
    ``data=ds, open_kwargs={"element": "layers/counts"}`` (or ``features=``) the module
    served ds's X, all of its features, without a word. Refused at construction, naming
    them; data= a path still takes them."""
    ds = dz.open_dataset(split_store)
    for kwargs in ({"features": [3, 1]}, {"element": "X"}):
        key = next(iter(kwargs))
        with pytest.raises(dz.ConfigError, match=f"open_kwargs {key!r} .* data= is a Dataset"):
            ZarrDataModule(data=ds, open_kwargs=kwargs)
    dm = ZarrDataModule(data=split_store, open_kwargs={"features": [3, 1]}, batch_size=32)
    loader = dm.train_dataloader()
    loader.set_epoch(0)
    assert next(iter(loader))["X"].shape == (32, 2)
    dm.teardown()


def test_a_split_column_the_data_lacks_says_what_the_module_takes(tmp_path) -> None:
    """A plain array has no obs: the default split_column="split" failed with the Loader's
    advice, "open an AnnData store or drop obs=[...]", to a user who passed no obs. The
    error now names split_column and splits=; predict still serves every row."""
    path = tmp_path / "plain.zarr"
    zarr.create_array(path, shape=(100, 3), chunks=(50, 3), dtype="f4")[...] = 1
    dm = ZarrDataModule(data=str(path), batch_size=10)
    with pytest.raises(dz.DatasetError, match=r"split_column='split' \(the default.*splits="):
        dm.train_dataloader()
    assert len(dm.predict_dataloader()) == 10
    dm.teardown()


def test_unset_sampler_settings_take_the_splits_suggestion(split_store: str) -> None:
    """chunk_size / preload_nchunks left unset: each split gets inspect's suggestion for its
    own rows and batch size (CSR: spanning several store chunks), still a full epoch."""
    from dali_zarr.inspection import dataset_suggestion

    dm = ZarrDataModule(data=split_store, batch_size=64, eval_batch_size=40, return_index=True)
    train = dm.train_dataloader()
    wanted = dataset_suggestion(dm.subset("train"), batch_size=64)
    assert (train.sampler.chunk_size, train.sampler.preload_nchunks) == (
        wanted.chunk_size,
        wanted.preload_nchunks,
    )
    assert train.sampler.chunk_size > 64  # the old fixed default decoded ~2x what it used
    rows = np.concatenate([b["index"].numpy() for b in train])
    np.testing.assert_array_equal(np.sort(rows), dm.split_rows["train"])
    val = dm.val_dataloader()
    wanted = dataset_suggestion(dm.subset("val"), batch_size=40)
    assert (val.sampler.chunk_size, val.sampler.preload_nchunks) == (
        wanted.chunk_size,
        wanted.preload_nchunks,
    )
    dm.teardown()
    given = ZarrDataModule(data=split_store, chunk_size=48, batch_size=64)
    wanted = dataset_suggestion(given.subset("train"), batch_size=64)
    sampler = given.train_dataloader().sampler
    # a given chunk_size keeps the suggested window size in rows
    assert sampler.chunk_size == 48
    assert sampler.preload_nchunks == -(-wanted.preload_nchunks * wanted.chunk_size // 48)
    given.teardown()
    with pytest.raises(dz.ConfigError, match="chunk_size"):
        ZarrDataModule(data=split_store, chunk_size=0)
    with pytest.raises(dz.ConfigError, match="larger than a window"):
        ZarrDataModule(data=split_store, chunk_size=8, preload_nchunks=2, batch_size=64)


def test_loader_stopped_at_exactly_len_then_next_epoch(split_store: str) -> None:
    """Lightning takes len(loader) batches and never asks for one more (no StopIteration):
    the next epoch must still be complete."""
    sampler = dz.ChunkSampler(chunk_size=32, preload_nchunks=4, batch_size=100, seed=2)
    loader = dz.Loader(dz.open_dataset(split_store), sampler, return_index=True)
    it = iter(loader)
    first = [next(it)["index"].numpy() for _ in range(len(loader))]
    loader.set_epoch(1)
    second = [b["index"].numpy() for b in loader]
    assert len(second) == len(first) == len(loader)
    np.testing.assert_array_equal(np.sort(np.concatenate(second)), np.arange(1_200))
    loader.close()


def make_dm(path: str) -> ZarrDataModule:
    return ZarrDataModule(
        data=path,
        chunk_size=32,
        preload_nchunks=4,
        batch_size=64,
        eval_batch_size=40,
        obs=["cell_type"],
        return_index=True,
    )


def trainer(**kwargs) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


def model():
    L.seed_everything(0, verbose=False)
    return example.Classifier((32,), 8, hidden=16, lr=1e-2, label="cell_type")


def test_trainer_reshuffles_validates_exactly_and_resumes(split_store: str, tmp_path) -> None:
    codes = split_codes(split_store)
    train_rows, val_rows = np.flatnonzero(codes == 0), np.flatnonzero(codes == 1)
    dm = make_dm(split_store)
    full = model()
    # num_sanity_val_steps leaves the val loop after 2 batches: that must not cost rows
    trainer(max_epochs=3, num_sanity_val_steps=2).fit(full, datamodule=dm)
    orders = [full.ids[f"train{e}"] for e in range(3)]
    for order in orders:  # one rank, drop_last=False: every train row once per epoch
        np.testing.assert_array_equal(np.sort(order), train_rows)
    assert not np.array_equal(orders[0], orders[1]), "the trainer's epoch reached set_epoch"
    assert not np.array_equal(orders[1], orders[2])
    for e in range(3):
        np.testing.assert_array_equal(full.ids[f"val{e}"], val_rows)  # unshuffled, once
    assert full.record["val_count"] == [151] * 3
    assert full.record["val_steps"] == [-(-151 // 40)] * 3
    assert all(np.isfinite(full.record["val_loss"]))
    assert full.record["train_loss"][-1] < full.record["train_loss"][0]
    assert not dm._loaders, "teardown closed the loaders"

    # Lightning checkpoints the train loader's position mid-epoch and resumes from it: the
    # resumed run continues the same stream (the model need not match; the data must)
    steps = len(train_rows) // 64 // 2
    fit = dict(max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0)
    first = model()
    trainer(
        max_steps=steps,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, save_top_k=-1)],
        enable_checkpointing=True,
        **fit,
    ).fit(first, datamodule=make_dm(split_store))
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert saved["combined_loader"][0]["consumed"] == steps
    rest = model()
    trainer(**fit).fit(rest, datamodule=make_dm(split_store), ckpt_path=path)
    np.testing.assert_array_equal(
        np.concatenate([first.ids["train0"], rest.ids["train0"]]), orders[0]
    )
    np.testing.assert_array_equal(rest.ids["train1"], orders[1])


def test_a_checkpoint_resumed_on_more_ranks_than_lightning_can_finish_is_refused(
    split_store: str, tmp_path
) -> None:
    """Lightning restores its batch counter and ends the epoch at len(loader), taken before
    the state is loaded: a mid-epoch checkpoint of 1 rank resumed on 2 (each rank a trainer
    of its own here, no process group) stopped each new rank 3 batches short of the
    remainder it owed, and 373 of 949 train rows were never delivered in that epoch. It is
    refused; on fewer ranks (2 -> 1) the epoch ends on the loader's own end, exactly."""

    def dm(world: int, rank: int) -> ZarrDataModule:
        return ZarrDataModule(
            data=split_store, chunk_size=32, preload_nchunks=4, batch_size=64,
            obs=["cell_type"], return_index=True, dist_info=lambda: (rank, world),
        )  # fmt: skip

    fit = dict(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)

    def checkpoint(world: int, rank: int, where: Path) -> tuple[Path, np.ndarray]:
        first = model()
        trainer(
            max_steps=5,
            callbacks=[ModelCheckpoint(dirpath=where, every_n_train_steps=5, save_top_k=-1)],
            enable_checkpointing=True,
            **fit,
        ).fit(first, datamodule=dm(world, rank))
        (path,) = where.glob("*.ckpt")
        return path, first.ids["train0"]

    path, _ = checkpoint(1, 0, tmp_path / "one")
    with pytest.raises(ConfigError, match=r"cannot resume epoch 0 .* on 2 ranks under Lightning"):
        trainer(**fit).fit(model(), datamodule=dm(2, 0), ckpt_path=path)
    # 2 -> 1: Lightning saves rank 0's loader state; the ranks ran in lockstep
    paths, got = zip(
        *(checkpoint(2, rank, tmp_path / f"two{rank}") for rank in range(2)), strict=True
    )
    rest = model()
    trainer(**fit).fit(rest, datamodule=dm(1, 0), ckpt_path=paths[0])
    delivered = np.concatenate([*got, rest.ids["train0"]])
    train_rows = np.flatnonzero(split_codes(split_store) == 0)
    assert len(np.unique(delivered)) == len(delivered), "a row delivered twice"
    assert np.isin(delivered, train_rows).all()
    assert len(train_rows) - len(delivered) < 64  # the 2-rank plan's equal-batch leftovers


def test_a_checkpoint_of_an_epoch_end_resumes_on_more_ranks(split_store: str, tmp_path) -> None:
    """A checkpoint of an epoch's last step (every_n_train_steps) owes nothing of that
    epoch, but the refusal above took it for one whose rest Lightning could not finish (its
    15 steps against the 7 an epoch takes on 2 ranks), advising "a checkpoint saved at the
    end of an epoch", which it is. Resumed on 2 ranks, each runs the next epoch's plan."""

    def dm(world: int, rank: int) -> ZarrDataModule:
        return ZarrDataModule(
            data=split_store, chunk_size=32, preload_nchunks=4, batch_size=64,
            obs=["cell_type"], return_index=True, dist_info=lambda: (rank, world),
        )  # fmt: skip

    fit = dict(limit_val_batches=0, num_sanity_val_steps=0)
    steps = -(-int((split_codes(split_store) == 0).sum()) // 64)  # epoch 0's, on 1 rank
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, save_top_k=-1)
    first = trainer(
        max_epochs=2, max_steps=steps, callbacks=[every], enable_checkpointing=True, **fit
    )
    first.fit(model(), datamodule=dm(1, 0))
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    loader_state = saved["combined_loader"][0]
    assert loader_state["consumed"] == loader_state["n_batches"]  # the whole epoch 0
    for rank in range(2):
        rest, whole = model(), model()
        trainer(max_epochs=2, **fit).fit(rest, datamodule=dm(2, rank), ckpt_path=path)
        trainer(max_epochs=2, **fit).fit(whole, datamodule=dm(2, rank))
        assert "train0" not in rest.ids
        np.testing.assert_array_equal(rest.ids["train1"], whole.ids["train1"])


def test_a_failed_fit_closes_the_loaders_and_a_retry_is_exact(split_store: str) -> None:
    """Lightning skips ``teardown`` when fit raises; ``on_exception`` closes the loaders (they
    held a pipeline and read threads each), and fitting again reads every row once."""

    class Failing(type(model())):
        def training_step(self, batch, i):
            if i == 3:
                raise RuntimeError("the model failed")
            return super().training_step(batch, i)

    dm = make_dm(split_store)
    L.seed_everything(0, verbose=False)
    with pytest.raises(RuntimeError, match="the model failed"):
        trainer(max_epochs=1, num_sanity_val_steps=0).fit(
            Failing((32,), 8, hidden=16, lr=1e-2, label="cell_type"), datamodule=dm
        )
    assert not dm._loaders, "the failed fit left its loaders open"
    retry = model()
    trainer(max_epochs=1, num_sanity_val_steps=0).fit(retry, datamodule=dm)
    train_rows = np.flatnonzero(split_codes(split_store) == 0)
    np.testing.assert_array_equal(np.sort(retry.ids["train0"]), train_rows)


def _run_example(args: list[str], timeout: int) -> str:
    # on a timeout the whole process group (Lightning's rank-1 child too) is killed
    return run_ok([sys.executable, str(EXAMPLE), *args], timeout=timeout)


@pytest.mark.slow
def test_ddp_example_two_ranks(tmp_path: Path) -> None:
    data, record = tmp_path / "sc.zarr", tmp_path / "record"
    n_val, n_test = 301, 200  # val: 150 + 151 rows, 3 + 4 batches of 50: uneven on purpose
    _run_example(
        [
            *("--data", str(data), "--generate", "--n-obs", "3000", "--n-features", "32"),
            *("--n-val", str(n_val), "--n-test", str(n_test), "--record", str(record)),
            *("--batch-size", "64", "--eval-batch-size", "50", "--chunk-size", "32"),
            *("--preload-nchunks", "4", "--epochs", "2", "--devices", "2"),
        ],
        timeout=420,
    )
    codes = split_codes(str(data))
    ids = [dict(np.load(record / f"rank{r}.npz")) for r in range(2)]
    logs = [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]
    for split, code, keys in (("val", 1, ["val0", "val1"]), ("test", 2, ["test"])):
        expected = np.flatnonzero(codes == code)
        for key in keys:
            a, b = ids[0][key], ids[1][key]
            both = np.concatenate([a, b])
            assert len(both) == len(expected), f"{key}: rows padded, repeated or lost"
            np.testing.assert_array_equal(np.sort(both), expected)  # each exactly once
        assert logs[0][f"{split}_count"][0] == len(expected)
    assert [log["val_steps"][0] for log in logs] == [3, 4], "ranks ran uneven val loops"
    train = np.flatnonzero(codes == 0)
    per_rank = (len(train) // 2) // 64 * 64
    for epoch in range(2):
        a, b = ids[0][f"train{epoch}"], ids[1][f"train{epoch}"]
        assert len(a) == len(b) == per_rank and not set(a.tolist()) & set(b.tolist())
        assert set(a.tolist()) | set(b.tolist()) <= set(train.tolist())
    assert not np.array_equal(ids[0]["train0"], ids[0]["train1"]), "epochs reshuffled"
    for log in logs[1:]:  # the reduced metrics are the same on every rank
        assert log["val_loss"] == logs[0]["val_loss"]
    assert all(np.isfinite(logs[0]["val_loss"])) and all(np.isfinite(logs[0]["test_loss"]))
    assert logs[0]["train_loss"][1] < logs[0]["train_loss"][0], "loss falls"


def test_device_auto_follows_the_trainer(split_store: str) -> None:
    """A CPU trainer gets the CPU path even where a GPU is usable (its model is on the CPU)."""
    from dali_zarr.graph.gpu_pipeline import gpu_status

    dm = ZarrDataModule(data=split_store, chunk_size=32, preload_nchunks=8, device="auto")
    dm.trainer = trainer(max_epochs=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.device == "cpu" and loader.device_reason.endswith("(device='cpu')")
    dm.teardown("fit")
    alone = ZarrDataModule(data=split_store, chunk_size=32, preload_nchunks=8, device="auto")
    alone.setup("fit")
    usable, found = gpu_status()
    loader = alone.train_dataloader()
    assert loader.device == ("gpu" if usable else "cpu") and loader.device_reason == found
    alone.teardown("fit")
    with pytest.raises(dz.ConfigError, match="device='tpu'"):
        ZarrDataModule(data=split_store, device="tpu")


def test_no_val_rows_fit_without_validation_and_an_empty_test_split_raises(
    split_store: str,
) -> None:
    """``splits`` without "val" (or a column without val rows: lightning_train.py
    ``--n-val 0``, which its parser takes) made every fit of a model with a
    ``validation_step`` fail in its sanity check ("split 'val' is empty"). There is no val
    loader now, so Lightning skips validation, and every train row is delivered."""
    codes = split_codes(split_store)
    train_rows = np.flatnonzero(codes == 0)
    dm = ZarrDataModule(
        data=split_store, splits={"train": train_rows}, chunk_size=32, preload_nchunks=4,
        batch_size=64, obs=["cell_type"], return_index=True,
    )  # fmt: skip
    fitted = model()
    with pytest.warns(UserWarning, match="split 'val' is empty: no rows were given"):
        trainer(max_epochs=1).fit(fitted, datamodule=dm)
    np.testing.assert_array_equal(np.sort(fitted.ids["train0"]), train_rows)
    assert "val0" not in fitted.ids
    with pytest.raises(ConfigError, match="split 'test' is empty"):
        trainer().test(fitted, datamodule=dm)
    labels = ZarrDataModule(data=split_store, split_labels={"train": "train"})
    with pytest.warns(UserWarning, match="split_labels give it no value of 'split'"):
        assert labels.val_dataloader() == []


def test_seed_none_resumes_from_a_checkpoint_with_the_drawn_seed(
    split_store: str, tmp_path
) -> None:
    """``ZarrDataModule(seed=None)`` drew a new seed in the resumed process, and the train
    loader refused the checkpoint's state ("sampler seed: saved ..., now ...", advising a
    ChunkSampler the module builds itself): no such fit could resume. Lightning keeps the
    drawn seed in the checkpoint (the module's state_dict); the resumed run continues the
    same stream."""

    def dm(seed: int | None) -> ZarrDataModule:
        return ZarrDataModule(
            data=split_store, chunk_size=32, preload_nchunks=4, batch_size=64, seed=seed,
            obs=["cell_type"], return_index=True,
        )  # fmt: skip

    fit = dict(max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0)
    first = model()
    trainer(
        max_steps=5,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)],
        enable_checkpointing=True,
        **fit,
    ).fit(first, datamodule=dm(None))
    (path,) = tmp_path.glob("*.ckpt")
    seed = torch.load(path, weights_only=False)["ZarrDataModule"]["seed"]
    whole = model()
    trainer(**fit).fit(whole, datamodule=dm(seed))
    # a module whose train loader was built before the fit (its len() asked) drew a seed of
    # its own, and that loader then refused the checkpoint: it is built anew
    for built_before in (False, True):
        rest, module = model(), dm(None)
        if built_before:
            assert len(module.train_dataloader()) > 0
        trainer(**fit).fit(rest, datamodule=module, ckpt_path=path)
        np.testing.assert_array_equal(
            np.concatenate([np.concatenate(first._ids["train"]), rest.ids["train0"]]),
            whole.ids["train0"],
        )
        np.testing.assert_array_equal(rest.ids["train1"], whole.ids["train1"])


def test_printing_a_module_builds_no_loader(split_store: str) -> None:
    """Lightning's ``str()`` of a datamodule calls each ``*_dataloader()`` and, a Loader not
    being a torch DataLoader, drew a batch of each: printing the module crashed, cost a
    train batch, and inside a fit stopped the fit's loop. Ours describes the module only."""
    module = ZarrDataModule(data=split_store, chunk_size=32, preload_nchunks=4, batch_size=64)
    text = str(module)
    assert text == repr(module) == f"ZarrDataModule(data={split_store!r}, splits=not set up)"
    assert module._loaders == {}
    module.setup()
    assert "'train': " in str(module) and module._loaders == {}


def test_a_train_loader_of_your_own_reshuffles_and_resumes_exactly(
    split_store: str, tmp_path
) -> None:
    """README: a train loader given to Lightning directly must be a TrainLoader. A plain
    Loader kept epoch 0's order every epoch (Lightning's set_epoch did not reach it) and,
    resumed at step 5, Lightning ended the epoch at its len() after load_state_dict (what
    was left) counting from step 5: 304 of 1,200 rows never came. Both hold for TrainLoader."""
    from dali_zarr.lightning import TrainLoader

    def loader() -> TrainLoader:
        ds = dz.open_dataset(split_store)
        sampler = dz.ChunkSampler(chunk_size=32, preload_nchunks=4, batch_size=64, seed=0)
        return TrainLoader(ds, sampler, obs=["cell_type"], return_index=True)

    whole = model()
    trainer(max_epochs=2).fit(whole, train_dataloaders=loader())
    assert not np.array_equal(whole.ids["train0"], whole.ids["train1"])
    first = model()
    trainer(
        max_epochs=2,
        max_steps=5,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)],
        enable_checkpointing=True,
    ).fit(first, train_dataloaders=loader())
    (path,) = tmp_path.glob("*.ckpt")
    rest = model()
    trainer(max_epochs=2).fit(rest, train_dataloaders=loader(), ckpt_path=path)
    np.testing.assert_array_equal(
        np.concatenate([np.concatenate(first._ids["train"]), rest.ids["train0"]]),
        whole.ids["train0"],
    )
    np.testing.assert_array_equal(rest.ids["train1"], whole.ids["train1"])


def test_a_module_whose_loaders_were_built_pickles_without_them(split_store: str) -> None:
    """``strategy="ddp_spawn"`` pickles the datamodule to every rank: one whose train loader
    was built first (``len(dm.train_dataloader())``) failed with "cannot pickle
    '_queue.SimpleQueue' object". The copy builds its own loaders and reads the same rows."""
    import pickle

    dm = make_dm(split_store)
    loader = dm.train_dataloader()
    want = [b["index"].numpy() for b in loader]
    copy = pickle.loads(pickle.dumps(dm))
    assert dm._loaders and not copy._loaders
    got = [b["index"].numpy() for b in copy.train_dataloader()]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    copy.teardown()
    dm.teardown()


def test_a_split_label_no_row_holds_names_the_columns_values(split_store: str) -> None:
    """A label the column does not hold ("validation" where it says "val", "Train") left
    the split empty with "no observation has split='validation'", not what the column
    holds: a fit then ran without validation on a warning that did not show the typo."""
    dm = ZarrDataModule(data=split_store, split_labels={"train": "train", "val": "validation"})
    dm.setup()
    with pytest.raises(
        dz.ConfigError,
        match=r"no observation has split='validation' \(its values: 'train', 'val', 'test'\)",
    ):
        dm.subset("val")


def test_predict_serves_every_row_or_the_predict_split_once(split_store: str) -> None:
    """trainer.predict had no predict_dataloader to call. Without a "predict" split it
    predicts on every row, in order; a "predict" split (which may share rows with the
    others, e.g. the test rows) serves exactly its rows."""

    class Predictor(type(model())):
        def predict_step(self, batch: dict, _: int) -> tuple[np.ndarray, torch.Tensor]:
            return batch["index"].numpy(), self(batch["X"]).argmax(1)

    codes = split_codes(split_store)
    predictor = Predictor((32,), 8, hidden=16, lr=1e-2, label="cell_type")
    out = trainer().predict(predictor, datamodule=make_dm(split_store))
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in out]), np.arange(1_200))
    assert sum(len(labels) for _, labels in out) == 1_200

    test_rows = np.flatnonzero(codes == 2)
    splits = {"train": codes == 0, "test": codes == 2, "predict": test_rows}
    dm = ZarrDataModule(data=split_store, splits=splits, batch_size=64, return_index=True)
    out = trainer().predict(predictor, datamodule=dm)
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in out]), test_rows)
    dm = ZarrDataModule(data=split_store, split_labels={"train": "train", "predict": "test"})
    assert dm.subset("predict").n_obs == len(test_rows)


def test_predict_needs_no_split_column(tmp_path: Path) -> None:
    """Predicting serves every row where no "predict" split is given, so new, unlabeled
    data (a store without the default "split" column, or a plain array without obs) must
    predict; every trainer.predict failed there with "no column 'split'" instead. The
    other splits, which do need the column, still say it is missing."""
    path = synthetic.make_single_cell(tmp_path / "new.zarr", n_obs=200, n_features=16, n_types=3)
    plain = tmp_path / "plain.zarr"
    zarr.create_array(plain, shape=(90, 6), dtype="f4", chunks=(30, 6))[:] = 1
    for data, n in ((path, 200), (str(plain), 90)):
        dm = ZarrDataModule(data=data, batch_size=32, return_index=True)
        ids = np.concatenate([b["index"].numpy() for b in dm.predict_dataloader()])
        np.testing.assert_array_equal(ids, np.arange(n))
        with pytest.raises(dz.DatasetError, match="split"):
            dm.train_dataloader()
        with pytest.raises(dz.DatasetError, match="split"):
            dm.val_dataloader()
        dm.teardown()
