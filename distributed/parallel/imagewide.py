"""The image-wide statistics mode of :class:`~.groupnorm.ShardedGroupNorm`, for tiled decodes.

Plain tiles normalize with each tile's own statistics, so tiles drift in tone. In this mode every GroupNorm call
of a tile's decode is normalized with *image-wide* statistics instead. :class:`TileStatistics` is the state the
adapted GroupNorms share (one per tiled decode, owned by the caller): statistics passes record, at each call,
the per-group count, mean and M2 over the tile's *core* (so every image pixel counts once), merged with Chan's
parallel formula in fp64; the final pass applies the merged statistics. Which passes run (one per resolution
level, one in all, or one per call) and how statistics travel between ranks is the tiled decode's business
(``vae/tiled_gn.py``); this module is the per-call math.

GroupNorm calls are keyed by (module path, call index within one tile's decode), so a module called several times
per decode (framewise video loops) gets one statistic per call. A call whose activation cannot be mapped onto the
tile's core (an unexpected shape) keeps per-tile statistics, in every tile alike.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import torch

from .groupnorm import GroupNormStats, group_chunks

__all__ = ["ImageWideStats", "TileStatistics", "CoreStats", "StopTile"]

Rect = Tuple[int, int, int, int]

#: groups per fp32 temporary of a core's statistics and of the normalization: an eighth of the layer
_PIECES = 8


class CoreStats:
    """Per-(sample, group) count, mean and M2 in fp64 (and a count of calls not mappable onto cores)."""

    __slots__ = ("n", "mean", "m2", "invalid")

    def __init__(self, n, mean, m2, invalid):
        self.n, self.mean, self.m2, self.invalid = n, mean, m2, invalid

    def merge(self, other: "CoreStats") -> "CoreStats":
        """Chan's parallel update of two parts."""
        n = self.n + other.n
        safe = torch.where(n > 0, n, torch.ones_like(n))
        delta = other.mean - self.mean
        mean = self.mean + delta * other.n / safe
        m2 = self.m2 + other.m2 + delta * delta * self.n * other.n / safe
        return CoreStats(n, mean, m2, self.invalid + other.invalid)

    def pack(self) -> torch.Tensor:
        return torch.stack([self.n, self.mean, self.m2, self.invalid])

    @classmethod
    def unpack(cls, t: torch.Tensor) -> "CoreStats":
        return cls(t[0], t[1], t[2], t[3])


def merge_all(parts: Sequence[CoreStats]) -> CoreStats:
    """Merge ``parts`` left to right (the order fixes the rounding: keep it the same wherever results must agree)."""
    total = parts[0]
    for p in parts[1:]:
        total = total.merge(p)
    return total


class StopTile(Exception):
    """Raised inside a statistics pass once the collected level is done: the tile's decode stops there."""


class TileStatistics:
    """What the image-wide GroupNorms of one tiled decode share: the pass being run and the statistics."""

    def __init__(self):
        self.collecting = False  # a statistics pass (else: the final pass, image-wide statistics everywhere)
        self.collect_level: Optional[int] = None  # the resolution level collected (None: every level at once)
        self.level = -1  # resolution level of the current call within this tile's decode
        self.last_scale: Optional[int] = None
        self.beyond = False  # a statistics pass reached a level after the collected one
        self.per_call = False  # every GroupNorm call is its own level (exact lockstep; one pass per call)
        self.tile_hw: Tuple[int, int] = (0, 0)
        self.core: Rect = (0, 0, 0, 0)
        self.calls: Dict[str, int] = {}
        self.current: Dict[tuple, CoreStats] = {}  # merged over the tiles of the run being collected
        self.image: Dict[tuple, CoreStats] = {}  # image-wide statistics applied in the apply pass
        self.call_count: Optional[int] = None

    # ---- per tile
    def begin_tile(self, tile: Rect, core: Rect) -> None:
        """A tile's decode starts: ``tile`` and ``core`` are its latent rectangles ``(y0, y1, x0, x1)``."""
        y0, y1, x0, x1 = tile
        cy0, cy1, cx0, cx1 = core
        self.tile_hw = (y1 - y0, x1 - x0)
        self.core = (cy0 - y0, cy1 - y0, cx0 - x0, cx1 - x0)
        self.calls = {}
        self.level, self.last_scale = -1, None

    def end_tile(self) -> None:
        count = sum(self.calls.values())
        if self.call_count is None:
            self.call_count = count
        elif count != self.call_count:
            # backstop, not the guard: a decoder's GroupNorm calls depend on its structure and frames only
            raise RuntimeError(f"a tile made {count} GroupNorm calls, another {self.call_count}; cannot sync them")

    # ---- statistics transport
    def take_run(self) -> Dict[tuple, CoreStats]:
        run, self.current = self.current, {}
        return run

    def set_image(self, parts: Sequence[Dict[tuple, CoreStats]]) -> None:
        """Merge per-run statistics (in run order) into the image-wide ones."""
        keys = list(parts[0])
        self.image.update({k: merge_all([p[k] for p in parts]) for k in keys})

    # ---- geometry
    def core_view(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[int]]:
        """This tile's core inside activation ``x`` and the activation's spatial scale over the latent tile."""
        th, tw = self.tile_hw
        if x.dim() == 3:  # attention's group_norm on [B, C, h*w]
            length = x.shape[-1]
            scale = next((s for s in (1, 2, 4, 8, 16, 32, 64) if th * s * tw * s == length), None)
            if scale is None:
                return None, None
            x = x.reshape(x.shape[0], x.shape[1], th * scale, tw * scale)
        if x.dim() < 4:
            return None, None
        h, w = x.shape[-2:]
        if h % th or w % tw or h // th != w // tw:
            return None, None
        s = h // th
        cy0, cy1, cx0, cx1 = self.core
        return x[..., cy0 * s : cy1 * s, cx0 * s : cx1 * s], s


def _core_stats(core: Optional[torch.Tensor], x: torch.Tensor, b: int, g: int) -> CoreStats:
    if core is None:
        zeros = torch.zeros(b, g, dtype=torch.float64, device=x.device)
        return CoreStats(zeros, zeros, zeros, zeros + 1)
    cpg = x.shape[1] // g
    means, m2s = [], []
    for g0, g1 in group_chunks(g, _PIECES):  # fp32 copies of a few groups at a time, not of the whole core
        xs = core[:, g0 * cpg : g1 * cpg].reshape(b, g1 - g0, -1).float()
        var, mean = torch.var_mean(xs, dim=-1, correction=0)
        means.append(mean)
        m2s.append(var * xs.shape[-1])
    mean, m2 = torch.cat(means, 1).double(), torch.cat(m2s, 1).double()
    n = torch.full_like(mean, xs.shape[-1])
    return CoreStats(n, mean, m2, torch.zeros_like(n))


@dataclasses.dataclass(frozen=True)
class ImageWideStats(GroupNormStats):
    """Collect core statistics (statistics passes) or normalize with the image-wide ones (the final pass).

    The adapted modules share a :class:`TileStatistics` as their plan state.
    """

    def normalize(self, x, module, path, state: TileStatistics, prior, memo):
        idx = state.calls.get(path, 0)
        state.calls[path] = idx + 1
        key = (path, idx)
        b, c, g = x.shape[0], x.shape[1], module.num_groups
        core, scale = state.core_view(x)
        if state.per_call:
            state.level += 1
        elif scale is not None and scale != state.last_scale:
            state.level, state.last_scale = state.level + 1, scale
        level = max(state.level, 0)
        if state.collecting:
            if state.collect_level is None or level == state.collect_level:
                now = _core_stats(core, x, b, g)
                state.current[key] = state.current[key].merge(now) if key in state.current else now
                return prior(x)  # collected calls use each tile's own statistics
            if level > state.collect_level:
                state.beyond = True
                raise StopTile  # the rest of this tile's decode cannot change the collected level
        stats = state.image.get(key)
        if stats is None:
            raise RuntimeError(f"no image-wide statistics for GroupNorm call {key}")  # backstop, not the guard
        if bool((stats.invalid > 0).any()):
            return prior(x)  # not mappable onto tile cores: keep per-tile statistics
        # nn.GroupNorm's biased variance, image-wide, folded with the affine into one per-channel scale and shift
        inv = torch.rsqrt(stats.m2 / stats.n + module.eps).to(torch.float32).repeat_interleave(c // g, dim=1)
        mean = stats.mean.to(torch.float32).repeat_interleave(c // g, dim=1)
        scale = inv * module.weight.float() if module.affine else inv
        shift = (module.bias.float() if module.affine else 0.0) - mean * scale
        view = (b, c) + (1,) * (x.dim() - 2)
        scale, shift = scale.view(view), shift.view(view)
        if x.dtype == torch.float32:
            return torch.addcmul(shift, x, scale)
        # fp32 arithmetic like GroupNorm's kernels, a few groups at a time (no whole-activation fp32 copy)
        out = torch.empty_like(x)
        cpg = c // g
        for g0, g1 in group_chunks(g, _PIECES):
            sl = slice(g0 * cpg, g1 * cpg)
            out[:, sl] = torch.addcmul(shift[:, sl], x[:, sl].float(), scale[:, sl]).to(x.dtype)
        return out
