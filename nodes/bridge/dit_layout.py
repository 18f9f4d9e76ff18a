"""Which ranks do what: the Distributed KSampler's ``parallelism`` widget -> a layout of CFG groups, sequence ranks
and batch rows. Pure bookkeeping (no ComfyUI, no torch.distributed): tested in CI.

Modes (every one exact: the stock KSampler's result within floating-point reordering):

* ``sequence`` — every rank takes a band of latent rows (all frames) of every model call. DiTs: tokens sharded,
  attention over all tokens (the family table, :mod:`.families`); UNets: PatchRay's row-band patch parallelism with the preset.
* ``cfg`` — two ranks: one evaluates the conditional, the other the unconditional prediction, and they exchange
  the two outputs once per step (ComfyUI's CALC_COND_BATCH extension point). Works for every model.
* ``cfg+sequence`` — ``cfg`` between two groups of N/2 ranks, each group sequence-parallel (4 ranks = 2 x 2).
* ``batch`` — the rows of each model call (the latent batch, times cond/uncond when ComfyUI batches them) are
  split across the ranks and the outputs gathered; every rank runs the sampler on the whole batch, so the noise,
  ancestral and SDE samplers included, is the stock KSampler's. Works for every model.
* ``auto`` — ``batch`` when the latent batch divides evenly over the ranks; else ``cfg`` (two ranks) or
  ``cfg+sequence`` (an even count from four) when CFG is on and the model can be sharded by sequence; else
  ``sequence``. A stale preset (displaced, compressed, otil, balanced) makes ``auto`` pick ``sequence``: the preset is
  what the user asked for, and it works between sequence ranks.

CFG = 1 has no unconditional prediction to split: a ``cfg`` layout then becomes ``sequence`` (or, for a model that
cannot be sharded by sequence, every rank samples the whole graph), with a note in the log: not an error.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

__all__ = ["MODES", "Layout", "plan_layout"]

MODES = ["auto", "sequence", "cfg", "cfg+sequence", "batch"]


class Layout(NamedTuple):
    """What the ranks do. ``cfg_groups * seq_ranks == num_ranks`` unless ``batch`` (then both are 1).

    Args:
        mode: the resolved mode (``sequence``, ``cfg``, ``cfg+sequence``, ``batch`` or ``replicated``).
        num_ranks: the cluster's ranks.
        cfg_groups: groups that split the conditionings of each step (1: no CFG split).
        seq_ranks: ranks per group that split the latent's rows (1: each rank runs the whole model).
        batch: the rows of every model call are split across all ranks.
        note: why the requested mode was changed ('' when it was not).
    """

    mode: str
    num_ranks: int
    cfg_groups: int = 1
    seq_ranks: int = 1
    batch: bool = False
    note: str = ""

    def group_of(self, rank: int) -> int:
        """The CFG group of WORLD rank ``rank`` (groups are consecutive rank ranges)."""
        return rank // self.seq_ranks

    def seq_group(self, group: int) -> list:
        """The WORLD ranks of CFG group ``group`` (its sequence-parallel ranks)."""
        return list(range(group * self.seq_ranks, (group + 1) * self.seq_ranks))

    def cfg_peers(self, position: int) -> list:
        """The WORLD ranks holding position ``position`` in each CFG group: they exchange the CFG outputs."""
        return [g * self.seq_ranks + position for g in range(self.cfg_groups)]


_PREFIX = "PatchRay: "


def _err(msg: str) -> ValueError:
    return ValueError(_PREFIX + msg)


def _bare(msg: str) -> str:
    """A message without the node's prefix (:func:`_err` adds it once)."""
    return msg[len(_PREFIX):] if msg.startswith(_PREFIX) else msg


def plan_layout(
    parallelism: str,
    num_ranks: int,
    cfg: float,
    batch_size: int,
    *,
    sequence_refusal: Optional[str] = None,
    stale_preset: bool = False,
) -> Layout:
    """The layout for the node's ``parallelism`` widget; raises ``ValueError`` naming the widget when it cannot be.

    Args:
        parallelism: one of :data:`MODES`.
        num_ranks: the cluster's ranks (>= 1).
        cfg: the node's cfg (1.0: no unconditional prediction).
        batch_size: the latent batch (B of ``[B, C, ...]``).
        sequence_refusal: why this model cannot be sharded by sequence (``None``: it can).
        stale_preset: a preset with stale neighbour data (displaced, compressed, otil, balanced): it works between
            sequence ranks (a UNet's row bands, a DiT's token shards), so ``auto`` picks a sequence layout.
    """
    if parallelism not in MODES:
        raise _err(f"parallelism must be one of {MODES} (got {parallelism!r})")
    n = int(num_ranks)
    if n < 1:
        raise _err(f"the cluster needs at least one rank (got {n})")
    cfg_on = not math.isclose(float(cfg), 1.0)
    seq_ok = sequence_refusal is None
    if n == 1:
        return Layout("sequence" if seq_ok else "replicated", 1)
    if parallelism == "auto":
        if stale_preset and seq_ok:
            return Layout("sequence", n, seq_ranks=n)
        if batch_size % n == 0:
            return Layout("batch", n, batch=True)
        if cfg_on and n == 2:
            return Layout("cfg", n, cfg_groups=2)
        if cfg_on and n % 2 == 0 and seq_ok:
            return Layout("cfg+sequence", n, cfg_groups=2, seq_ranks=n // 2)
        if seq_ok:
            return Layout("sequence", n, seq_ranks=n)
        if batch_size >= n:
            return Layout("batch", n, batch=True)
        why = "cfg = 1 leaves no CFG split" if not cfg_on else f"a CFG split alone runs on exactly 2 ranks (the cluster has {n})"
        raise _err(
            f"{_bare(sequence_refusal)} parallelism=auto found no other split: the batch of {batch_size} is smaller than "
            f"the {n} ranks, so batch cannot help, and {why}; raise batch_size to {n} or more"
            + (", or set num_ranks to 2" if cfg_on else "")
        )
    if parallelism == "batch":
        if batch_size < n:
            raise _err(
                f"parallelism=batch splits the latent batch across the ranks: the batch ({batch_size}) is smaller than "
                f"the cluster's {n} ranks; raise batch_size of the latent or pick another parallelism"
            )
        return Layout("batch", n, batch=True)
    if parallelism in ("cfg", "cfg+sequence") and not cfg_on:
        note = f"cfg = 1 has no unconditional prediction to split: parallelism={parallelism} ran as "
        if seq_ok:
            return Layout("sequence", n, seq_ranks=n, note=note + f"sequence over {n} ranks")
        return Layout("replicated", n, note=note + "the whole model on every rank (this model has no sequence split)")
    if parallelism == "cfg":
        if n != 2:
            raise _err(
                f"parallelism=cfg puts the conditional and unconditional predictions on two ranks (the cluster has {n}); "
                + ("set num_ranks to 2, or pick parallelism sequence, batch or auto"
                   if n % 2 else "pick cfg+sequence (2 CFG groups of N/2 sequence ranks), or set num_ranks to 2")
            )
        return Layout("cfg", n, cfg_groups=2)
    if not seq_ok:
        raise _err(_bare(sequence_refusal))
    if parallelism == "cfg+sequence":
        if n % 2 or n < 4:
            raise _err(
                f"parallelism=cfg+sequence needs an even number of ranks from four (2 CFG groups x N/2 sequence ranks); "
                f"the cluster has {n}: " + ("pick parallelism cfg (2 ranks)" if n == 2 else "pick parallelism sequence, or set num_ranks to an even number from 4")
            )
        return Layout("cfg+sequence", n, cfg_groups=2, seq_ranks=n // 2)
    return Layout("sequence", n, seq_ranks=n)
