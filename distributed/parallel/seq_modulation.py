"""A DiT's per-call modulation, computed once across the sequence ranks instead of in full on every rank.

DiT blocks modulate their tokens (adaLN: shift, scale and gate) with a projection of one vector per model call, the
timestep (and pooled text) embedding: FLUX.1's ``img_mod``/``txt_mod``/``modulation``, Qwen-Image's ``img_mod``/
``txt_mod``, HunyuanVideo's, each a ``Linear(D, 3D or 6D)`` per block. That vector is the same on every sequence
rank, so without help every rank computes every one of those layers in full. At batch 1 they are matrix-vector
products bound by reading the weights: FLUX.1 has 57 of them, 6.4 GB of bf16 weights read per call, 2.2 ms on an
H200, the same at any rank count (1.7% of a rank's kernels at N = 2, 6% at N = 4).

:class:`ShareModulation` (a plan style for those layers) makes the ranks split that work. On the first call of a
model call, each rank computes its ``1/N`` of the output features of *every* layer of the group (a row slice of each
weight: a view, nothing copied), and one all-gather (FLUX.1 at batch 1, bf16: 2.1 MB in all) gives every rank every
layer's whole output; each layer's call then returns its part. One collective per model call, of a size that does
not depend on the image.

Design decisions:

* **Exact.** Each output feature is the same dot product of the same weight row with the same input, computed on one
  rank instead of all: the result equals the layer's own up to the GEMM kernel's summation order (fp32: ~1e-7).
* **The group's layers take one input per model call.** That is what the host's family table declares by naming
  them (every block's modulation reads the same embedding). The first call's input stands for all; a later call
  whose input differs in shape, dtype or device, a call after the host said the blocks may be patched
  (:attr:`ModulationGroup.enabled`), and a layer with forward pre-hooks (which could change its input) run the layer
  themselves, locally: exact, just not shared.
* **No rank can wait for another.** The gathered layout (every layer's slot, ``ceil(out / N)`` features per rank)
  depends only on the layers' shapes, the same on every rank, and every rank always fills every slot: from a row
  slice of the weight, cast to the input's dtype and device, when the layer is a linear map of its weight
  (``rows``: a weight stored in fp8 or offloaded to the host is sliced first, then cast), else from its own forward
  (a LoRA applied on the fly, a quantised weight: the full cost on that rank, the right values). So ranks that
  disagree on how a layer holds its weight still exchange the same bytes.
* **Under ``torch.compile``** the layer's call is one opaque operation (the collective runs eagerly, in graph
  order) that finds its layer by the weight alone, so the blocks of one class keep sharing one compiled graph, and
  a later run's new group reuses it.
* **Weight sharding** (a block's weights gathered just before it runs) leaves the other blocks' modulation weights
  as shards when the first layer is called: such a call runs every layer in its own block, as before.
* The host starts each model call with :meth:`ModulationGroup.begin_call` (``SequenceState.begin_call``): the
  previous call's outputs are dropped there.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather_start, is_sharded_tensor
from .plan import Applied, Style, replace_forward

__all__ = ["ShareModulation", "ModulationGroup", "linear_rows", "weight_rows"]

#: instance attribute of a shared layer: the number of its group (the same for every layer of one model)
_GROUP_ATTR = "_patchray_modulation_group"
_GROUP_IDS = itertools.count()
#: live groups by number (how the compiled graphs' opaque operation finds its group)
_GROUPS: Dict[int, "ModulationGroup"] = {}


#: ``rows(module, x, lo, hi) -> (weight rows, bias rows) | None``: what ``module`` multiplies ``x`` by for its output
#: features ``lo:hi``, in ``x``'s dtype and on its device; ``None`` when the layer is not such a map
RowsFn = Callable[[nn.Module, torch.Tensor, int, int], Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]]


def linear_rows(module: nn.Module, x: torch.Tensor, lo: int, hi: int):
    """Rows ``lo:hi`` of a ``torch.nn.Linear``'s weight and bias, cast to ``x``'s dtype and device (a weight stored
    in another dtype, as diffusers' layerwise casting keeps it, is cast as its hooks would cast it), or ``None`` for
    any other layer (a subclass with its own forward, a weight that is not a plain tensor)."""
    w = getattr(module, "weight", None)
    if type(module).forward is not nn.Linear.forward or type(w) not in (nn.Parameter, torch.Tensor) \
            or not w.dtype.is_floating_point or w.is_meta:  # meta: offloaded by a hook that loads it in the forward
        return None
    return weight_rows(w, module.bias, x, lo, hi)


def weight_rows(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor, lo: int, hi: int):
    """Rows ``lo:hi`` of ``weight`` and ``bias``, sliced first (a view), then cast to ``x``'s dtype and device."""
    return (weight[lo:hi].to(device=x.device, dtype=x.dtype),
            None if bias is None else bias[lo:hi].to(device=x.device, dtype=x.dtype))


class ModulationGroup:
    """The modulation layers of one model on one rank, and the outputs of the current model call.

    Args:
        ctx: the sequence group (a ``ParallelContext``).
        traffic: byte accounting with ``add(kind, nbytes, collectives=)``, or ``None``.
        rows: ``rows(module, x, lo, hi)``: the weight and bias rows a layer multiplies ``x`` by for its output
            features ``lo:hi`` (:func:`linear_rows` by default; a host with its own linear layers, e.g. weights cast
            per call, passes its own), or ``None``: the layer's own forward fills its share.
    """

    def __init__(self, ctx, traffic=None, rows: Optional[RowsFn] = None):
        self.ctx = ctx
        self.traffic = traffic
        self.rows = rows or linear_rows
        self.ident = next(_GROUP_IDS)
        #: ``(module, its forward before the adapter)`` in the order they were adapted (the gathered layout's order)
        self.members: List[Tuple[nn.Module, Callable]] = []
        self._index: Dict[int, int] = {}
        #: False while the host's blocks may be patched (ComfyUI's block replacements): every layer runs locally
        self.enabled = True
        self._outputs: Optional[List[torch.Tensor]] = None
        self._key: Optional[tuple] = None
        #: this model call runs every layer locally (its weights are sharded across the ranks)
        self._local = False
        self._layout: Optional[tuple] = None
        #: model calls whose modulation was computed in shares, and layer calls that came through a compiled graph's
        #: operation (for reports and tests)
        self.shared_calls = 0
        self.graph_calls = 0
        _GROUPS[self.ident] = self

    # ------------------------------------------------------------------ membership

    def add(self, module: nn.Module, prior: Callable) -> None:
        self._index[id(module)] = len(self.members)
        self.members.append((module, prior))
        self._layout = None

    def discard(self, module: nn.Module) -> None:
        i = self._index.pop(id(module), None)
        if i is None:
            return
        self.members.pop(i)
        self._index = {id(m): j for j, (m, _) in enumerate(self.members)}
        self._layout = None
        self._outputs = None
        _OWNERS.clear()
        if not self.members:
            _GROUPS.pop(self.ident, None)

    def begin_call(self) -> None:
        """A new model call: the previous call's outputs no longer apply."""
        self._outputs = None
        self._key = None
        self._local = False

    # ------------------------------------------------------------------ the layers' calls

    def output(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What ``module(x)`` returns: its part of the shared computation, or its own forward where that cannot
        stand for it."""
        i = self._index.get(id(module))
        # a layer the group does not know (a copy of a shared one carries this adapter too): its class's forward
        prior = self.members[i][1] if i is not None else types.MethodType(type(module).forward, module)
        if i is None or not self.enabled or self.ctx.world_size == 1 or module._forward_pre_hooks or self._local:
            return prior(x)
        if self._outputs is None:
            if self._weights_sharded():
                # the blocks' weights are sharded across the ranks (weight sharding: a block's weights are gathered
                # just before it runs), so the other blocks' modulation weights are not here yet: every layer runs in
                # its own block, for this whole call (the same on every rank: the shards are laid out alike)
                self._local = True
                return prior(x)
            self._compute(x)
        if self._key != _key_of(x):
            return prior(x)
        return self._outputs[i]

    def _weights_sharded(self) -> bool:
        # weight sharding (FSDP2) keeps a block's weights as DTensors between its forwards
        return any(is_sharded_tensor(m.weight) for m, _ in self.members)


    # ------------------------------------------------------------------ the shared computation

    def _slots(self) -> tuple:
        """Per layer ``(out features, features per rank, offset in a rank's slot row)``, and the row's length."""
        if self._layout is None:
            n = self.ctx.world_size
            slots, offset = [], 0
            for module, _ in self.members:
                # the layer's declared width (a quantised weight's storage shape need not be [out, in])
                out = int(getattr(module, "out_features", None) or module.weight.shape[0])
                per = -(-out // n)
                slots.append((out, per, offset))
                offset += per
            self._layout = (tuple(slots), offset)
        return self._layout

    def _compute(self, x: torch.Tensor) -> None:
        n, r = self.ctx.world_size, self.ctx.rank
        slots, width = self._slots()
        parts = []
        for (module, prior), (out, per, _off) in zip(self.members, slots):
            lo, hi = min(r * per, out), min((r + 1) * per, out)
            wb = self.rows(module, x, lo, hi)
            y = F.linear(x, *wb) if wb is not None else prior(x)[..., lo:hi]
            if hi - lo < per:
                y = F.pad(y, (0, per - (hi - lo)))
            parts.append(y.to(x.dtype))
        send = torch.cat(parts, dim=-1)
        lead = tuple(send.shape[:-1])
        gathered, work = all_gather_start(send, self.ctx)  # [N, *lead, width]
        if self.traffic is not None:
            self.traffic.add("modulation", send.numel() * send.element_size() * (n - 1), collectives=1)
        if work is not None:
            work.wait()
        rows = gathered.reshape(n, -1, width).permute(1, 0, 2).reshape(-1, n * width)  # [L, N * width], rank-major
        flat = rows.index_select(1, self._order(slots, width, n, x.device))
        outputs, at = [], 0
        for out, _per, _off in slots:
            outputs.append(flat[:, at:at + out].reshape(lead + (out,)))
            at += out
        self._outputs, self._key = outputs, _key_of(x)
        self.shared_calls += 1

    def _order(self, slots, width: int, n: int, device) -> torch.Tensor:
        """Where each layer's output feature sits in the rank-major gathered row (cached per layout and device)."""
        key = (slots, width, n, str(device))
        cached = getattr(self, "_order_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        idx = []
        for out, per, off in slots:
            j = torch.arange(out)
            idx.append((j // per) * width + off + j % per)
        order = torch.cat(idx).to(device)
        self._order_cache = (key, order)
        return order


def _key_of(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, x.device


# --------------------------------------------------------------------------------------------------
# the layers' forward, eager and inside a compiled graph

#: one operation name per importing package (the pack may be imported under two names in one process)
_OP_NAME = "shared_modulation_" + re.sub(r"\W", "_", __name__.split(".")[0])


#: ``weight.data_ptr() -> (group, layer)`` of every live group's layers, for the compiled graphs' operation, which
#: knows a layer by its weight only (no group number in the graph: a new run's group reuses the compiled graphs);
#: rebuilt when a pointer is missing (a weight moved, a group came or went)
_OWNERS: Dict[int, Tuple["ModulationGroup", nn.Module]] = {}


def _owner(weight: torch.Tensor) -> Optional[Tuple["ModulationGroup", nn.Module]]:
    ptr = weight.data_ptr()
    found = _OWNERS.get(ptr)
    if found is None or found[1].weight.data_ptr() != ptr:
        _OWNERS.clear()
        for g in list(_GROUPS.values()):
            for m, _ in g.members:
                _OWNERS[m.weight.data_ptr()] = (g, m)
        found = _OWNERS.get(ptr)
    if found is None or found[1].weight.shape != weight.shape:
        return None
    return found


@torch.library.custom_op(f"patchray::{_OP_NAME}", mutates_args=())
def _shared_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A shared modulation layer's call as one operation a compiled graph keeps opaque."""
    found = _owner(weight)
    if found is None:
        return F.linear(x, weight, bias)  # backstop: a layer outside every group computes itself
    group, module = found
    group.graph_calls += 1
    return group.output(module, x).clone()  # an operation's output is a tensor of its own (the group keeps its copy)


@_shared_op.register_fake
def _(x, weight, bias):
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))


def _shared_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return getattr(torch.ops.patchray, _OP_NAME)(x, self.weight, self.bias)
    return _GROUPS[getattr(self, _GROUP_ATTR)].output(self, x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShareModulation(Style):
    """A modulation layer (``Linear`` of the per-call embedding) whose work the sequence ranks split
    (see the module docstring). Every layer the plan names this way joins the state's one group.

    Args:
        rows: ``rows(module, x, lo, hi)`` for the host's linear layers (``None``: :func:`linear_rows`; see
            :class:`ModulationGroup`).
    """

    rows: Optional[RowsFn] = dataclasses.field(default=None, compare=False)

    def _apply(self, module, path, state):
        if not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.dim() != 2:
            raise NotImplementedError(f"{path}: {type(module).__name__} is not a linear layer; a modulation to share "
                                      f"must be one")
        group = state.modulation
        if group is None:
            group = state.modulation = ModulationGroup(state.ctx, getattr(state, "traffic", None), self.rows)

        def build(prior):
            group.add(module, prior)
            return types.MethodType(_shared_forward, module)

        undo_forward = replace_forward(module, path, build)
        object.__setattr__(module, _GROUP_ATTR, group.ident)

        def undo():
            undo_forward()
            module.__dict__.pop(_GROUP_ATTR, None)
            group.discard(module)
            if not group.members and state.modulation is group:
                state.modulation = None

        return Applied(undo)
