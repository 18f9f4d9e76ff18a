"""CFG-parallel and batch-parallel evaluation: independent model calls of one step spread over rank groups.

A sampling step evaluates the model on several independent *items*: the conditionings of classifier-free guidance
(cond and uncond), or the latents of a batch. Items do not talk to each other inside the model, so each rank group
evaluates its own items and the outputs are exchanged once per step (one all-gather across the groups), after
which every rank holds every item's output and the caller's sampler runs unchanged. Inside a group the model may
itself be sequence-parallel (``sampling/dit.py``) over the group's ranks: 4 ranks = 2 CFG groups x 2 sequence
ranks.

Design decisions:

* **Groups of consecutive ranks.** ``G`` groups of ``N / G`` ranks: group ``g`` holds ranks ``[g m, (g + 1) m)``
  (the *inner* context, what a sequence-parallel model gets), and ranks with the same inner rank form the
  *across* context that exchanges the outputs. The split is computed from the world size and the group count,
  which every rank shares; :class:`RankGroups` owns the subgroups and releases them in :meth:`RankGroups.close`
  without destroying them (destroying a gloo subgroup while a peer may still be in a collective on it hung that
  peer; torch.distributed keeps them until the WORLD group goes).
* **Items are assigned contiguously** (:func:`~..parallel.bands.split_extent`: the first groups one item more when
  uneven), so a batch stays in order and an uneven batch (3 latents over 2 groups) is fine: the exchange pads to
  the largest share and cuts it off.
* **The plan is decided before any work** (:func:`plan_split`), from the world size, the guidance scale and the
  batch, identically on every rank. CFG = 1 (only the positive prompt is evaluated) skips CFG-parallel with a note,
  not an error; a world size the CFG groups do not divide falls back to sequence parallelism over all ranks, with
  a note saying what to change.
* **One library for both callers.** A diffusers-style loop calls :func:`cfg_parallel` / :func:`batch_parallel`
  around its model call; ComfyUI's ``CALC_COND_BATCH`` wrapper (``nodes/bridge``) calls :func:`evaluate_split` with
  its list of conds. Nothing here knows either host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import comm
from ..comm import all_gather_padded
from ..context import ParallelContext
from ..bands import bounds_of, split_extent

__all__ = [
    "SplitPlan",
    "plan_split",
    "GroupLayout",
    "RankGroups",
    "assign_items",
    "evaluate_split",
    "cfg_parallel",
    "batch_parallel",
    "split_cost",
]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How the ranks of one sampling run are used.

    Args:
        cfg_groups: groups the CFG items (cond, uncond) are spread over (1: no CFG-parallel).
        batch_groups: groups the batch's latents are spread over (1: no batch-parallel).
        sequence: ranks per group (sequence parallelism inside a group; 1: none).
        note: why a requested split was reduced (empty when everything asked for runs).
    """

    cfg_groups: int
    batch_groups: int
    sequence: int
    note: str = ""

    @property
    def groups(self) -> int:
        return self.cfg_groups * self.batch_groups


def plan_split(world_size: int, *, cfg_scale: float = 1.0, conds: int = 2, batch: int = 1, cfg_parallel: bool = True,
               batch_parallel: bool = False) -> SplitPlan:
    """Decide CFG groups, batch groups and the sequence ranks per group (the same answer on every rank).

    * CFG-parallel when asked, ``cfg_scale != 1`` and there are at least two conds: 2 groups (one per cond) when
      the world size is even; otherwise no split, with a note.
    * Batch-parallel when asked and ``batch > 1``: the largest number of groups ``<= batch`` that divides the ranks
      left per CFG group.
    * The rest of the ranks of a group run sequence-parallel.

    Example:
        >>> plan_split(4, cfg_scale=5.0)
        SplitPlan(cfg_groups=2, batch_groups=1, sequence=2, note='')
        >>> plan_split(2, cfg_scale=1.0).note[:20]
        'CFG is 1: only the p'
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    notes = []
    cfg_groups = 1
    if cfg_parallel and world_size > 1:
        if conds < 2 or float(cfg_scale) == 1.0:
            notes.append("CFG is 1: only the positive prompt is evaluated, so CFG-parallel is skipped and every rank "
                         "works on the same model call")
        elif world_size % 2:
            notes.append(f"CFG-parallel needs an even number of ranks (got {world_size}); cond and uncond run one "
                         f"after the other, sequence-parallel over all {world_size} ranks. Use an even number of GPUs "
                         f"for CFG-parallel")
        else:
            cfg_groups = 2
    left = world_size // cfg_groups
    batch_groups = 1
    if batch_parallel and batch > 1 and left > 1:
        batch_groups = max(g for g in range(1, min(batch, left) + 1) if left % g == 0)
        if batch_groups == 1:
            notes.append(f"batch-parallel: no group count <= {batch} divides the {left} ranks per group; batch runs whole")
    return SplitPlan(cfg_groups, batch_groups, left // batch_groups, "; ".join(notes))


class GroupLayout(NamedTuple):
    """Where this rank sits: its group, the group's context (``inner``) and the exchange context (``across``)."""

    group: int
    groups: int
    inner: ParallelContext
    across: ParallelContext


def _subgroup(ctx: ParallelContext, members: List[int]) -> ParallelContext:
    if len(members) == 1:
        return ParallelContext.single(ctx.device)
    global_members = [ctx.global_ranks[i] for i in members] if ctx.global_ranks else list(members)
    return ParallelContext(
        group=comm.new_group(global_members),
        rank=members.index(ctx.rank),
        world_size=len(members),
        global_ranks=tuple(global_members),
        device=ctx.device,
        backend=ctx.backend,
    ).member_weights(ctx.band_weights, ctx.global_ranks or tuple(range(ctx.world_size)))


class RankGroups:
    """``groups`` groups of consecutive ranks of ``ctx``, and the exchange groups across them; owned by the caller.

    Args:
        ctx: all ranks of the run.
        groups: number of groups; must divide ``ctx.world_size`` (:func:`plan_split` picks one that does).

    Only the members of a group create it (``comm.new_group`` with local synchronisation). :meth:`close` releases
    the groups (idempotent); call it when the run ends.
    """

    def __init__(self, ctx: ParallelContext, groups: int):
        if groups < 1 or ctx.world_size % groups:
            raise ValueError(f"{groups} groups do not divide {ctx.world_size} ranks; use plan_split() to pick the groups")
        m = ctx.world_size // groups
        group, p = divmod(ctx.rank, m)
        if groups == 1:
            inner, across = ctx, ParallelContext.single(ctx.device)
        elif m == 1:
            inner, across = ParallelContext.single(ctx.device), ctx
        else:
            inner = _subgroup(ctx, [group * m + q for q in range(m)])
            across = _subgroup(ctx, [g * m + p for g in range(groups)])
        self.layout: Optional[GroupLayout] = GroupLayout(group, groups, inner, across)

    def close(self) -> None:
        """Release the subgroups (not destroyed: see the module docstring)."""
        self.layout = None


def assign_items(n_items: int, groups: int, allow_empty: bool = False) -> Tuple[Tuple[int, ...], ...]:
    """The items (indices) each group evaluates: contiguous, the first groups one more when uneven.

    With ``allow_empty`` fewer items than groups leave the last groups without any (a sampler that sometimes
    evaluates only the positive prompt); otherwise that is refused.

    Example:
        >>> assign_items(3, 2)
        ((0, 1), (2,))
        >>> assign_items(1, 2, allow_empty=True)
        ((0,), ())
    """
    if n_items < groups and not allow_empty:
        raise ValueError(f"{n_items} items cannot give each of {groups} groups one; use fewer groups (plan_split)")
    b = bounds_of(split_extent(n_items, groups))
    return tuple(tuple(range(b[g], b[g + 1])) for g in range(groups))


def evaluate_split(evaluate: Callable[[Tuple[int, ...]], torch.Tensor], n_items: int, layout: GroupLayout, traffic=None,
                   allow_empty: bool = False) -> torch.Tensor:
    """Every item's output on every rank, each group evaluating its own items; one all-gather across the groups.

    Args:
        evaluate: ``evaluate(items)`` -> this group's outputs stacked along dim 0 (``len(items)`` rows, in the order
            given). Every rank of a group calls it with the same items (a sequence-parallel model inside).
        n_items: items in all (CFG: the conds; batch-parallel: the latents).
        layout: this rank's :class:`GroupLayout`.
        traffic: optional byte accounting (kind ``"cfg"``).
        allow_empty: fewer items than groups is allowed; ``evaluate(())`` must then return a ``[0, ...]`` tensor of
            the items' shape (e.g. ``x.new_zeros((0, *x.shape))``).

    Returns:
        ``[n_items, ...]``, item order.
    """
    assigned = assign_items(n_items, layout.groups, allow_empty)
    mine = evaluate(assigned[layout.group])
    if mine.shape[0] != len(assigned[layout.group]):
        raise ValueError(f"evaluate returned {mine.shape[0]} rows for {len(assigned[layout.group])} items")
    if layout.groups == 1:
        return mine
    out = all_gather_padded(mine.contiguous(), layout.across, dim=0, sizes=[len(a) for a in assigned])
    if traffic is not None:
        traffic.add("cfg", mine.numel() * mine.element_size() * (layout.groups - 1), collectives=1)
    return out


def cfg_parallel(model_fn: Callable[[Any], torch.Tensor], conds: Sequence[Any], layout: GroupLayout, traffic=None) -> List[torch.Tensor]:
    """``[model_fn(c) for c in conds]`` with the conds spread over the groups (cond and uncond on different groups).

    ``model_fn(cond)`` returns the model output for the whole latent under ``cond``; every output has the same shape.
    """
    out = evaluate_split(lambda items: torch.stack([model_fn(conds[i]) for i in items]), len(conds), layout, traffic)
    return list(out.unbind(0))


def _take(obj: Any, batch: int, items: Tuple[int, ...]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[items[0] : items[-1] + 1] if obj.dim() >= 1 and obj.shape[0] == batch else obj
    if isinstance(obj, dict):
        return {k: _take(v, batch, items) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_take(v, batch, items) for v in obj)
    return obj


def batch_parallel(model_fn: Callable[..., torch.Tensor], x: torch.Tensor, layout: GroupLayout, *args, traffic=None, **kwargs) -> torch.Tensor:
    """``model_fn(x, *args, **kwargs)`` for a batch ``x`` of B latents, each group computing its share of them.

    Every tensor argument (nested in lists, tuples, dicts too) whose first dimension is B is cut like ``x``; the
    output is the whole batch's, in order, on every rank.
    """
    batch = x.shape[0]

    def evaluate(items):
        return model_fn(_take(x, batch, items), *_take(args, batch, items), **_take(kwargs, batch, items))

    return evaluate_split(evaluate, batch, layout, traffic)


def split_cost(item_shape: Sequence[int], itemsize: int, n_items: int, groups: int) -> dict:
    """Modelled exchange of :func:`evaluate_split` per step per rank: ``wire_bytes`` a rank sends, ``messages``,
    and ``counted`` (what comm's accounting counts: an all-gather's N outputs plus its input, padded to the largest
    share)."""
    if groups <= 1:
        return {"wire_bytes": 0, "messages": 0, "counted": {}}
    per = int(torch.Size(item_shape).numel()) * itemsize
    share = max(len(a) for a in assign_items(n_items, groups)) * per
    return {"wire_bytes": share * (groups - 1), "messages": 1, "counted": {"all_gather": share * (groups + 1)}}
