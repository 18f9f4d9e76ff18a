"""Plan-is-data machinery: styles, the shared row-band state, applying a plan and undoing it.

Design decisions:

* **A plan is data.** ``plan: dict[str, Style]`` maps a layer *type* (the module's class name, e.g.
  ``"Conv2d"``, ``"WanCausalConv3d"``) to a frozen, keyword-only :class:`Style` whose only side effect is
  ``_apply(module, path, state)``. Class names rather than FQN globs because diffusers' VAE FQNs differ from
  family to family while the layer types are what decide the math; the same plan therefore covers every
  depth and width of a family. :func:`apply_plan` is the one function that applies it.
* **Coverage is checked before anything is patched.** Every module of the sharded half must be named by the
  plan (:class:`RowLocal` marks the layers verified to be row-local: pointwise ops, channel-only norms,
  containers whose own forward only reshapes rows locally). Anything else raises ``NotImplementedError``
  naming the module path and class, identically on every rank (it depends only on the model).
* **Adapters reuse the module's own parameters.** A style either registers a named hook or sets an
  instance-level ``forward`` that calls the module's parameters by reference; undo removes exactly that.
  No ``.data`` is copied, nothing is registered as a submodule, so ``state_dict()`` never changes.
* **Band boundaries are derived, never exchanged.** :class:`RowState` holds the latent band table; a layer
  whose input holds ``r`` rows on this rank while this rank's latent band holds ``l`` rows runs at scale
  ``r / l``, and every rank's boundaries at that layer are the latent boundaries times that scale. All ranks
  compute the same table from the same shared data, so no metadata collective is needed.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from ..context import ParallelContext

__all__ = [
    "Style",
    "RowLocal",
    "ClaimedOnly",
    "RowState",
    "Applied",
    "apply_plan",
    "undo_all",
    "check_coverage",
    "set_forward",
]


class RowState:
    """What every adapter of one parallelized VAE half shares: the context and the current latent band table.

    ``latent_bounds`` is set by the caller (``row_decode``/``row_encode``) before each run, from the latent height
    every rank knows: ``(0, b_1, ..., H_latent)``. It is the one mutable field, owned by the handle (not global).
    """

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.latent_bounds: Optional[Tuple[int, ...]] = None
        # (T, h_local, W) of the last video tensor a layout-recording hook saw (frame-causal attention needs it)
        self.video_layout: Optional[Tuple[int, int, int]] = None
        # halo receive buffers, reused across calls of the same shape (a convolution consumes its halo at once)
        self.halo_buffers: dict = {}

    def _bounds(self) -> Tuple[int, ...]:
        if self.latent_bounds is None:
            # backstop, not the guard: row_decode/row_encode always set the table before running
            raise RuntimeError("row-sharded VAE ran without a band table; call it through row_decode/row_encode")
        return self.latent_bounds

    def scale_of(self, local_rows: int) -> Fraction:
        """The layer's rows-per-latent-row, from this rank's extent (the same on every rank by construction)."""
        b = self._bounds()
        return Fraction(local_rows, b[self.ctx.rank + 1] - b[self.ctx.rank])

    def bounds_at_scale(self, scale: Fraction) -> Tuple[int, ...]:
        out = []
        for v in self._bounds():
            g = v * scale
            if g.denominator != 1:
                # backstop: families only use integer scales; row_* validate input sizes up front
                raise RuntimeError(f"band boundary {v} x {scale} is not a whole row")
            out.append(int(g))
        return tuple(out)

    def bounds_at(self, local_rows: int) -> Tuple[int, ...]:
        """Global row boundaries of every rank for a tensor holding ``local_rows`` rows on this rank."""
        return self.bounds_at_scale(self.scale_of(local_rows))

    def bounds_for_height(self, global_rows: int) -> Tuple[int, ...]:
        """Global row boundaries for a layer output of ``global_rows`` rows in all."""
        b = self._bounds()
        return self.bounds_at_scale(Fraction(global_rows, b[-1]))


@dataclasses.dataclass(frozen=True)
class Style:
    """How one layer type is sharded. Subclasses are frozen, keyword-only value objects.

    ``_apply`` patches ``module`` and returns an :class:`Applied` record (how to undo it, and which child
    modules the style took over so the plan does not patch them a second time).
    """

    def _apply(self, module: nn.Module, path: str, state: RowState) -> "Applied":  # pragma: no cover - abstract
        raise NotImplementedError


class Applied:
    """The undo record of one applied style."""

    __slots__ = ("undo", "claims")

    def __init__(self, undo: Optional[Callable[[], None]] = None, claims: Sequence[nn.Module] = ()):
        self.undo = undo
        self.claims = tuple(claims)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowLocal(Style):
    """Marks a layer verified to be row-local (pointwise, channel-only, or a container that only reshapes rows).

    Args:
        refuse: attributes that, when set (not ``None``/``False``), make the layer depend on more than its rows
            (e.g. LTX-2's spatial noise injection): applying then raises ``NotImplementedError`` naming it.
    """

    refuse: Tuple[str, ...] = ()

    def _apply(self, module, path, state):
        for attr in self.refuse:
            if getattr(module, attr, None) not in (None, False):
                name = type(module).__name__
                raise NotImplementedError(f"{path}: {name} with {attr} set is not supported in row mode")
        return Applied()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClaimedOnly(Style):
    """A layer type that is only sharded as part of a parent adapter (e.g. the ``ZeroPad2d`` of a downsampler)."""

    parent: str = "its parent"

    def _apply(self, module, path, state):
        raise NotImplementedError(
            f"row mode supports {type(module).__name__} ({path}) only inside {self.parent}; add an adapter for this use"
        )


def set_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Give ``module`` an instance-level ``forward``; return the undo (restores any instance forward it hid)."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    # object.__setattr__: nn.Module.__setattr__ would treat a Module-bound callable like any attribute anyway,
    # but this makes explicit that nothing is registered (no parameters, buffers or submodules change).
    object.__setattr__(module, "forward", forward)

    def undo():
        if had:
            object.__setattr__(module, "forward", previous)
        else:
            module.__dict__.pop("forward", None)

    return undo


def check_coverage(root: nn.Module, plan: Dict[str, Style], prefix: str = "") -> None:
    """Raise ``NotImplementedError`` naming the first module of ``root`` whose class the plan does not cover."""
    for name, module in root.named_modules():
        cls = type(module).__name__
        if cls not in plan:
            path = ".".join(p for p in (prefix, name) if p) or "<root>"
            raise NotImplementedError(
                f"row mode has no adapter for module {path} ({cls}); add a Style for {cls} to the family's row plan "
                f"(distributed/vae/row.py ROW_PLANS) or use a tiled mode"
            )


def apply_plan(roots: Sequence[Tuple[str, nn.Module]], plan: Dict[str, Style], state: RowState) -> List[Applied]:
    """Apply ``plan`` to every module under ``roots`` (``(prefix, module)`` pairs); return the undo records.

    Coverage is checked for every root before the first module is patched, so a refusal leaves the model as is.
    """
    roots = [(p, m) for p, m in roots if m is not None]
    for prefix, root in roots:
        check_coverage(root, plan, prefix)
    applied: List[Applied] = []
    claimed: set = set()
    try:
        for prefix, root in roots:
            for name, module in root.named_modules():
                if id(module) in claimed:
                    continue
                path = ".".join(p for p in (prefix, name) if p)
                record = plan[type(module).__name__]._apply(module, path, state)
                applied.append(record)
                claimed.update(id(c) for c in record.claims)
    except BaseException:
        undo_all(applied)
        raise
    return applied


def undo_all(applied: List[Applied]) -> None:
    """Undo ``applied`` in reverse order (children before the parents that claimed them)."""
    for record in reversed(applied):
        if record.undo is not None:
            record.undo()
    applied.clear()
