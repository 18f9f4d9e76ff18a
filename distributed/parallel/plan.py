"""Plan-is-data machinery: styles, the shared row-band state, applying a plan and undoing it.

Design decisions:

* **A plan is data.** ``plan: dict[str, Style]`` maps ``fnmatch`` globs to frozen, keyword-only :class:`Style`
  values whose only side effect is ``_apply(module, path, state)``. A key names a layer *type* by class name
  (``"Conv2d"``, ``"WanCausalConv3d"``, ``"*Attention"``) or one module by its path (``"conv_in"``); path keys
  win. The VAE family plans use class names because diffusers' VAE FQNs differ from family to family while the
  layer types decide the math, so one plan covers every depth and width of a family; the UNet plan adds its
  input convolution by path. :func:`apply_plan` is the one function that applies any plan.
* **Coverage is checked before anything is patched** for the VAE plans (``strict``): every module of the
  sharded half must be named (:class:`RowLocal` marks layers verified to be row-local). Anything else raises
  ``NotImplementedError`` naming the module path and class, identically on every rank (it depends only on the
  model). A host application's UNet is applied non-strictly: unnamed layers are row-local there by
  construction (pointwise, per-token), and classes match through their bases (host subclasses of torch layers).
* **One undo path.** Every adapter that changes a forward goes through :func:`replace_forward`: it refuses a
  module that already carries an adapter, hands the style the forward that ran before (another extension's
  instance forward, or the class's), and its undo restores exactly the object it replaced. Attributes a
  wrapping style must change for a call are changed for that call only (:func:`swapped`). Hooks are removed by
  their handles. No ``.data`` is copied, nothing is registered as a submodule, so ``state_dict()`` never changes.
* **Band boundaries are derived, never exchanged.** :class:`RowState` holds the latent band table; a layer
  whose input holds ``r`` rows on this rank while this rank's latent band holds ``l`` rows runs at scale
  ``r / l``, and every rank's boundaries at that layer are the latent boundaries times that scale. All ranks
  compute the same table from the same shared data, so no metadata collective is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
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
    "style_for",
    "replace_forward",
    "is_adapted",
    "swapped",
]

logger = logging.getLogger(__name__)

#: instance attribute marking a module that carries a PatchRay adapter (the value is the module's path)
_ADAPTER_ATTR = "_patchray_adapter"


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


def replace_forward(module: nn.Module, path: str, build: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Give ``module`` the instance-level forward ``build(prior)``; return the undo. The one undo path of ``parallel``.

    ``prior`` is the forward that ran until now: another extension's instance-level forward if one was set, else
    the class's forward bound to ``module``. Wrapping styles call it (so the other extension keeps working);
    styles that recompute the layer ignore it. The undo puts back exactly the object that was in the instance
    dict (or removes ours when there was none), so a forward set by someone else survives apply + remove.

    Raises:
        RuntimeError: ``module`` already carries a PatchRay adapter (applying twice would wrap the adapter in
            itself and lose the original on undo); remove the first one.
    """
    if _ADAPTER_ATTR in module.__dict__:
        raise RuntimeError(
            f"{path or type(module).__name__} ({type(module).__name__}) already carries a PatchRay adapter; "
            f"remove it (handle.remove()) before applying another"
        )
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    forward = build(module.forward)
    # object.__setattr__: nn.Module.__setattr__ would treat a callable like any attribute anyway, but this makes
    # explicit that nothing is registered (no parameters, buffers or submodules change, state_dict() is the same)
    object.__setattr__(module, "forward", forward)
    object.__setattr__(module, _ADAPTER_ATTR, path or type(module).__name__)

    def undo():
        module.__dict__.pop(_ADAPTER_ATTR, None)
        if module.__dict__.get("forward") is not forward:
            # someone replaced our forward after us: putting ours (or the original) back would drop theirs
            logger.warning("%s: its forward was replaced after the PatchRay adapter; left as it is", path)
            return
        if had:
            object.__setattr__(module, "forward", previous)
        else:
            module.__dict__.pop("forward", None)

    return undo


def is_adapted(module: nn.Module) -> bool:
    """Whether ``module`` carries a PatchRay adapter (an instance forward set by :func:`replace_forward`)."""
    return _ADAPTER_ATTR in module.__dict__


@contextlib.contextmanager
def swapped(module: nn.Module, **attrs):
    """Set ``module``'s attributes to ``attrs`` for the duration of the block; restore the previous values after.

    For wrapping styles that must run the module's own forward under another configuration (a conv whose row
    padding the halo replaces): the module is never left changed, even when the forward raises.
    """
    saved = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield module
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _class_names(module: nn.Module, bases: bool) -> List[str]:
    if not bases:
        return [type(module).__name__]
    return [c.__name__ for c in type(module).__mro__ if c not in (nn.Module, object)]


def style_for(plan: Dict[str, Style], path: str, module: nn.Module, bases: bool = False) -> Optional[Style]:
    """The style ``plan`` gives ``module``: the first key matching its path, else the first matching its class name.

    Keys are ``fnmatch`` globs (case-sensitive). A key names one module by its path (``"conv_in"``,
    ``"input_blocks.0.0"``) or a layer type by its class name (``"Conv2d"``, ``"*Attention"``); path matches win,
    so a plan can single out one module of a type. With ``bases`` a class matches through its base classes too
    (most-derived first), so a host application's subclasses of torch layers are covered by ``"Conv2d"``.
    """
    for key, style in plan.items():
        if path and (fnmatch.fnmatchcase(path, key) if _is_glob(key) else path == key):
            return style
    for name in _class_names(module, bases):
        for key, style in plan.items():
            if fnmatch.fnmatchcase(name, key) if _is_glob(key) else name == key:
                return style
    return None


@functools.lru_cache(maxsize=4096)
def _is_glob(key: str) -> bool:
    """Whether a plan key has glob characters (others match by equality: a row plan is applied on every decode,
    and ``fnmatch`` on every key for every module was most of that cost)."""
    return any(c in key for c in "*?[")


def check_coverage(root: nn.Module, plan: Dict[str, Style], prefix: str = "") -> None:
    """Raise ``NotImplementedError`` naming the first module of ``root`` that the plan does not cover."""
    for name, module in root.named_modules():
        path = ".".join(p for p in (prefix, name) if p)
        if style_for(plan, path, module) is None:
            cls = type(module).__name__
            raise NotImplementedError(
                f"row mode has no adapter for module {path or '<root>'} ({cls}); add a Style for {cls} to the family's "
                f"row plan (distributed/vae/row.py ROW_PLANS) or use a tiled mode"
            )


def apply_plan(
    roots: Sequence[Tuple[str, nn.Module]], plan: Dict[str, Style], state, *, strict: bool = True
) -> List[Applied]:
    """Apply ``plan`` to every module under ``roots`` (``(prefix, module)`` pairs); return the undo records.

    Args:
        roots: ``(path prefix, module)`` pairs; ``None`` modules are skipped.
        plan: ``glob -> Style`` (see :func:`style_for`).
        state: the shared state the styles' adapters read (a :class:`RowState` or a subclass).
        strict: every module must be covered (checked for every root before the first module is patched, so a
            refusal leaves the model as is): the VAE row plans, which list every layer type of a family. With
            ``strict=False`` (a host application's model, whose other layers are row- or token-local), modules the
            plan does not name run unchanged and classes also match through their bases.

    On any error every style applied so far is undone before the error propagates.
    """
    roots = [(p, m) for p, m in roots if m is not None]
    if strict:
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
                style = style_for(plan, path, module, bases=not strict)
                if style is None:
                    continue
                record = style._apply(module, path, state)
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
