"""Progress of a decode or encode in stages, reported by rank 0 from forward hooks on the VAE's top-level blocks.

Design decisions:

* **Stages are found by structure, not per family.** A stage is a top-level block of the decoder (encoder): a
  direct child, or an item of a ``ModuleList`` child, whose subtree holds at least two layers with weights. That
  is the mid-block and every up-block (down-block) of every diffusers VAE, while ``conv_in``, ``norm_out`` and
  ``conv_out`` (one layer each, wrapped or not) are left out. A VAE class added later needs no entry here.
* **Frame chunks count as calls.** Video decoders call their decoder once per chunk of frames (Wan: one latent
  frame per call; HunyuanVideo: temporal tiles when it decodes framewise). Every call runs every stage, so the
  total is stages per call times calls. The calls still to come are estimated from the frames the latest call
  took: ``ceil(frames left / frames per call)``, so Wan's 1-then-4-frame encoder chunks are counted exactly from
  the second chunk on. A decode made of several pieces (tiles) multiplies by the pieces left.
* **No collective, no per-family branch.** Rank 0 writes two ints (:func:`~patchray.distributed.cluster.report_progress`)
  that the driver polls; the other ranks install no hooks. The total may be corrected upwards while the work
  runs (extra statistics passes of synced tiles), never below what is already done.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, List, Optional

import torch.nn as nn

from ..context import ParallelContext

__all__ = ["stage_blocks", "StageCounter", "stage_progress"]


def _layers_with_weights(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None)


def stage_blocks(half: nn.Module) -> List[nn.Module]:
    """The top-level blocks of a decoder or encoder (see the module docstring), in registration order."""
    blocks = []
    for child in half.children():
        items = list(child) if isinstance(child, nn.ModuleList) else [child]
        blocks.extend(m for m in items if _layers_with_weights(m) >= 2)
    return blocks


class StageCounter:
    """Counts stages as the hooks see them and keeps ``(done, total)``; ``report(done, total)`` receives each change.

    Args:
        stages: stages per call of the half (``len(stage_blocks(half))``).
        frames: frames of the whole input along the time axis (``None`` for images: one call per piece).
        pieces: how many times the whole input is decoded (tiles of a tiled mode; 1 in row mode).
        report: called with ``(done, total)`` after every stage.
    """

    def __init__(self, stages: int, frames: Optional[int], pieces: int, report):
        self.stages, self.frames, self.pieces, self.report = max(1, stages), frames, max(1, pieces), report
        self.done = 0
        self.total = self.stages * self.pieces
        self.history: List[tuple] = []
        self._piece = 0  # pieces finished
        self._calls_in_piece = 0
        self._frames_in_piece = 0
        self._calls_per_piece = 1

    def call_started(self, frames_in_call: Optional[int]) -> None:
        self._calls_in_piece += 1
        if self.frames and frames_in_call:
            self._frames_in_piece += frames_in_call
            left = max(0, self.frames - self._frames_in_piece)
            self._calls_per_piece = self._calls_in_piece + math.ceil(left / frames_in_call)
        self._update_total()

    def call_finished(self) -> None:
        if not self.frames or self._frames_in_piece >= self.frames:
            self._piece += 1
            self._calls_in_piece = self._frames_in_piece = 0

    def stage_done(self) -> None:
        self.done += 1
        self._update_total()
        self.history.append((self.done, self.total))
        self.report(self.done, self.total)

    def _update_total(self) -> None:
        calls_before = self._piece * self._calls_per_piece
        calls = calls_before + max(self._calls_per_piece, 1) * (self.pieces - self._piece)
        self.total = max(self.done, self.stages * calls)


def _frames_of(inputs) -> Optional[int]:
    x = inputs[0] if inputs else None
    return int(x.shape[2]) if getattr(x, "dim", None) is not None and x.dim() == 5 else None


@contextlib.contextmanager
def stage_progress(half: nn.Module, ctx: ParallelContext, frames: Optional[int] = None, pieces: int = 1,
                   report=None) -> Iterator[Optional[StageCounter]]:
    """On group rank 0, count the stages of ``half`` (a VAE's ``decoder`` or ``encoder``) for the block's duration.

    Args:
        half: the module whose calls are counted.
        ctx: the parallel context; ranks other than 0 install nothing and get ``None``.
        frames: frames of the input along the time axis (``None`` for images).
        pieces: how many times the input is decoded whole (tiles).
        report: ``report(done, total)``; default :func:`~patchray.distributed.cluster.report_progress`.

    Yields:
        the :class:`StageCounter` on rank 0 (its ``history`` holds every figure reported), else ``None``.
    """
    if ctx.rank != 0:
        yield None
        return
    if report is None:
        from ..cluster import report_progress as report
    counter = StageCounter(len(stage_blocks(half)), frames, pieces, report)
    handles = [
        half.register_forward_pre_hook(lambda _m, inputs: counter.call_started(_frames_of(inputs))),
        half.register_forward_hook(lambda _m, _i, _o: counter.call_finished()),
    ]
    handles += [b.register_forward_hook(lambda _m, _i, _o: counter.stage_done()) for b in stage_blocks(half)]
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()
