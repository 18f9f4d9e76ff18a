"""Compiled transformer blocks between the sequence-parallel collectives (``torch.compile``, per block).

Design decisions:

* **Why.** A sequence rank of a fast GPU runs short kernels: on an H200 a FLUX.1 rank at N = 2 has ~100 ms of GPU
  work per call in ~3,600 kernels, and eager PyTorch needs more CPU time than that to launch them. Compiling each
  block fuses its elementwise work (norms, modulation, gating, residuals: about half the kernels) into a few Triton
  kernels, which cuts both the GPU time and the launches; the GEMMs and the attention keep their library kernels.
* **Where the compiled graphs stop** (``attention``). The rank's exchange (collectives, bookkeeping, the stale
  strategies' Python) must never be traced. ``"eager"``: each adapted attention module (the one whose attention
  goes to the rank's :class:`~patchray.distributed.parallel.seq_attention.SequenceAttention`) runs under
  ``torch.compiler.disable``, so each block compiles into the parts before and after its attention module (a
  graph break). ``"compiled"`` (the default): only the module's thin forward wrapper (which points the route at
  the module, Python state) is skipped; the compiler descends into the module and its processor (projections,
  norms, RoPE: about half a FLUX.1 block's kernels, and most of the CPU's launch work), and the one attention call
  the processor makes enters each graph as a single opaque operation (``seq_route``'s custom operation), whose
  body, the exchange and the attention, runs eagerly in graph order. Both work with every attention mode
  (gathered, Ulysses, the stale presets) and the same on every rank. The N = 1 reference is compiled the same way,
  so a speed-up compares like with like.
* **Per block, not the whole model**: blocks of one class share one compiled graph (the module's parameters are
  graph inputs), so compiling 57 FLUX.1 blocks costs two graphs' compile time; the model's entry and exit (token
  sharding, RoPE slicing, the output gather) stay eager.
* **Exact up to the kernels' rounding.** Fusion changes the order of floating-point operations within a block, so a
  compiled run agrees with the eager one to rounding (fp32: ~1e-6 relative), not bit for bit; the sequence-parallel
  result is compared with the compiled one-rank result.
* ``remove()`` restores the blocks and the attention modules.

Example:
    >>> handle = parallelize_dit(transformer, ctx)          # doctest: +SKIP
    >>> compiled = compile_blocks(transformer)               # doctest: +SKIP
    >>> out = transformer(**inputs)                          # first call compiles (seconds), later calls reuse
    >>> compiled.remove(); handle.remove()                   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .dit_families import attention_globs, family_of

__all__ = ["COMPILE_MODES", "ATTENTION_SCOPES", "CompiledBlocks", "compile_blocks", "block_attention_paths"]

#: ``torch.compile`` modes offered: ``default`` (fusion, no CUDA graphs) and ``max-autotune-no-cudagraphs``;
#: CUDA-graph modes are not offered: the eager attention between a block's two graphs would re-enter them every call
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: ``compile_blocks(attention=...)``: ``compiled`` (the attention modules' projections compiled with the block, the
#: attention call an opaque operation) or ``eager`` (each attention module runs eagerly)
ATTENTION_SCOPES = ("compiled", "eager")


def block_attention_paths(model: nn.Module) -> List[Tuple[str, str]]:
    """``(block list attribute, attention attribute)`` pairs of the model's family table (``"X.*.Y"`` attention rows)."""
    out = []
    for pattern in attention_globs(family_of(model)):
        if ".*." not in pattern:
            continue
        blocks, attn = pattern.split(".*.", 1)
        out.append((blocks, attn))
    if not out:
        raise NotImplementedError(f"{type(model).__name__}: the family table names no per-block attention to compile around")
    return out


class CompiledBlocks:
    """What :func:`compile_blocks` changed, and how to undo it."""

    def __init__(self, blocks: List[nn.Module], attentions: List[Tuple[nn.Module, Optional[Any]]], mode: str):
        self.blocks = blocks
        self.attentions = attentions
        self.mode = mode

    def remove(self) -> None:
        for block in self.blocks:
            block._compiled_call_impl = None
        for module, prior in self.attentions:
            if prior is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prior
        self.blocks, self.attentions = [], []


def compile_blocks(model: nn.Module, *, mode: str = "default", dynamic: bool = False, backend: str = "inductor",
                   attention: str = "compiled") -> CompiledBlocks:
    """Compile each transformer block of a sequence-parallel DiT family around its attention exchange.

    Args:
        model: a diffusers DiT of :data:`~.dit_families.DIT_FAMILIES` (with or without :func:`~.dit.parallelize_dit`
            installed; install it first).
        mode: one of :data:`COMPILE_MODES`.
        dynamic: ``torch.compile``'s ``dynamic`` (False: one graph per token count, which a sampling run keeps).
        backend: ``torch.compile``'s backend (``inductor``: fused kernels; ``aot_eager``: the same graphs and graph
            breaks without code generation, which the CPU tests use).
        attention: one of :data:`ATTENTION_SCOPES` (see the module docstring).

    Raises:
        ValueError: an unknown ``mode`` or ``attention``.
        NotImplementedError: a model whose family table has no per-block attention rows.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {list(COMPILE_MODES)} (got {mode!r})")
    if attention not in ATTENTION_SCOPES:
        raise ValueError(f"compile attention must be one of {list(ATTENTION_SCOPES)} (got {attention!r})")
    blocks: List[nn.Module] = []
    attentions: List[Tuple[nn.Module, Optional[Any]]] = []
    for blocks_name, attn_name in block_attention_paths(model):
        for block in getattr(model, blocks_name, None) or []:
            attn = block.get_submodule(attn_name)
            prior = attn.__dict__.get("forward")
            if attention == "eager":
                attn.forward = torch.compiler.disable(attn.forward)
                attentions.append((attn, prior))
            elif prior is not None:  # the rank's forward wrapper: skipped, what it calls compiled
                attn.forward = torch.compiler.disable(prior, recursive=False)
                attentions.append((attn, prior))
            if block not in blocks:
                block.compile(mode=None if backend != "inductor" else mode, dynamic=dynamic, backend=backend)
                blocks.append(block)
    return CompiledBlocks(blocks, attentions, mode)
