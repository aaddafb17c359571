"""The model and loss the example training scripts share: an MLP that predicts an obs label
(and their argparse types for counts).

Kept beside the scripts (torchrun and Lightning put this folder on ``sys.path``) so that
``ddp_train.py`` and ``lightning_train.py`` treat every element and label alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: The code a categorical obs column gives a cell with no label (anndata stores NaN there).
MISSING_LABEL = -1


def holds_counts(element: str | None) -> bool:
    """X, raw/X and layers are counts here, fed as log1p(x); obsm/obsp entries are
    embeddings or graphs whose values may be below -1, where log1p gives NaN."""
    return not (element or "X").strip("/").startswith(("obsm/", "obsp/"))


def mlp(feature_shape: tuple[int, ...], *, hidden: int, n_classes: int) -> nn.Sequential:
    """Flattens N-D rows (an obsm entry of shape (n_obs, 2, 3)) before the first layer."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(feature_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, n_classes),
    )


def labelled_loss(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, number of labelled rows): cells with a missing label (code -1)
    are left out, not passed to cross-entropy as a class index (which raises)."""
    loss = F.cross_entropy(logits, y, reduction="sum", ignore_index=MISSING_LABEL)
    return loss, (y != MISSING_LABEL).sum()


def categorical_classes(categories: list[str] | None, label: str) -> int:
    """The number of classes of ``label``'s categories; a numeric column is refused."""
    if not categories:
        raise SystemExit(
            f"--label {label!r}: the classifier needs a categorical obs column (its codes "
            "are the classes); this one is numeric. Pick a categorical column."
        )
    return len(categories)


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: a whole number >= ``minimum`` (0 rows, genes or batches, a negative
    seed or step cap, fail far from the flag or, for --max-steps -1, silently stop every
    epoch after one step)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    parse.__name__ = "int"  # argparse: "invalid int value: 'x'"
    return parse


positive = at_least(1)
non_negative = at_least(0)
