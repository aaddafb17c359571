"""One rank of ``test_readme.py``: runs README.md's "Use", "Resuming" and JAX examples
as written (the ``python`` blocks that start with the lines given), in a folder holding
``cells.zarr``, after ``init_process_group("gloo")``, and writes what they left behind to
``rank{R}.json`` there."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed


def readme_block(text: str, first_line: str) -> str:
    """The README's ```python block whose first line starts with ``first_line``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(first_line)]
    if len(blocks) != 1:
        raise SystemExit(f"README.md: {len(blocks)} python blocks start with {first_line!r}")
    return blocks[0]


def main() -> None:
    readme, folder = sys.argv[1], sys.argv[2]
    text = Path(readme).read_text()
    os.chdir(folder)
    torch.distributed.init_process_group("gloo")
    names: dict[str, object] = {"os": os, "torch": torch}
    use = readme_block(text, "# one process per GPU under torchrun")
    exec(compile(use, "README.md (Use)", "exec"), names)
    used = names["loader"]
    seen = {
        "device": used.device,
        "batches": len(used),
        "x_shape": list(names["batch"]["X"].shape),
        "index_dtype": str(names["batch"]["index"].dtype),
    }
    exec("model = torch.nn.Linear(ds.feature_shape[0], 3)\nn_epochs = 4\n", names)
    resume = readme_block(text, "rank = torch.distributed.get_rank()")
    exec(compile(resume, "README.md (Resuming)", "exec"), names)
    seen["resumed_epoch"] = names["loader"].epoch
    seen["saved"] = sorted(os.listdir("ckpt"))
    # JAX's block: each torchrun rank is a JAX process of its own here (no jax.distributed)
    jax_block = readme_block(text, "from dali_zarr.jax_loader import JaxLoader")
    exec(compile(jax_block, "README.md (JAX)", "exec"), names)
    seen["jax_batches"] = len(names["loader"])
    seen["jax_x_shape"] = list(names["batch"]["X"].shape)
    names["loader"].close()
    rank = torch.distributed.get_rank()
    Path(f"rank{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
