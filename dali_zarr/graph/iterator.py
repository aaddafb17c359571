"""A thin epoch iterator over a DALI pipeline that hands out its outputs without copying.

DALI's ``DALIGenericIterator`` copies every output into a freshly allocated framework
tensor. For a dense minibatch of 4096 x 20,000 float32 (328 MB) that copy, and the page
faults of the new allocation, cost ~10x the densify itself. With ``exec_dynamic=True`` a
DALI output owns its buffer until the last reference goes away, so exporting it through
DLPack is safe: the framework tensor keeps the DALI buffer alive, and DALI never writes
into it again.

``pipe.run()`` is called without a CUDA stream, so outputs arrive host-synchronised: when a
batch is handed out, every DALI kernel of its iteration has finished. The GPU path's ring of
window buffers relies on that (``dali_zarr.graph.gpu_pipeline``); keep it so.
"""

from __future__ import annotations

from collections.abc import Iterator

from nvidia.dali.pipeline import Pipeline


class DaliEpochIterator(Iterator[list[dict]]):
    """Yields ``[{name: DALI tensor}]`` (one sample = one minibatch) until the epoch ends.

    The list has one entry per pipeline, like DALI's framework iterators, so adapters can
    take either.

    Call :meth:`reset` to start the next epoch; DALI then advances its ``epoch_idx``, which
    the external_source callback receives in ``BatchInfo``.
    """

    def __init__(self, pipe: Pipeline, names: list[str]) -> None:
        self.pipe = pipe
        self.names = names
        self._built = False
        self._exhausted = False

    def __iter__(self) -> DaliEpochIterator:
        return self

    def __next__(self) -> list[dict]:
        if self._exhausted:
            raise StopIteration
        if not self._built:
            self.pipe.build()
            self._built = True
        try:
            outputs = self.pipe.run()
        except StopIteration:
            self._exhausted = True
            raise
        return [{name: out[0] for name, out in zip(self.names, outputs, strict=True)}]

    def reset(self) -> None:
        """Start the next epoch (after this one raised StopIteration)."""
        if self._built:
            self.pipe.reset()
        self._exhausted = False
