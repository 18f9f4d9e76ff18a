"""PatchRay Parallel VAE: ComfyUI's VAE whose decode and encode run on the cluster's ranks, for every node that calls
them (the stock VAE Decode / Encode, their tiled versions, and the many nodes that encode a reference image).

Design decisions:

* **A new object; ComfyUI and the user's VAE stay untouched.** :func:`parallel_vae` returns a shallow copy of the
  user's VAE whose class is a subclass of that VAE's own class, made here on first use (once per class, from the
  object's ``type``, so this module never imports ComfyUI and CI builds it over a stand-in). The copy holds the same
  attribute values: the same ``first_stage_model`` (the weights are shared, never copied), the same ``patcher``
  (ComfyUI's memory management sees one model), the same ratios and formulas other nodes read
  (``downscale_ratio``, ``spacial_compression_decode()``, ``latent_dim``...), and ``isinstance(copy, comfy.sd.VAE)``
  holds. Only ``decode``, ``encode``, ``decode_tiled`` and ``encode_tiled`` differ. The input VAE is not changed: wired
  to a stock node as well, it decodes there as before. The alternatives each break something: patching the methods
  on the user's object or on ComfyUI's class changes every other use of that VAE; a wrapper that forwards attributes
  (``__getattr__``) fails ``isinstance`` checks and must forward whatever a later ComfyUI adds.
* **The methods return exactly what ComfyUI's do, through the one decode.** They call
  :func:`.vae.decode_latent` / :func:`.vae.encode_pixels`, as the Distributed VAE Decode / Encode nodes do, which
  return ``VAE.decode``'s ``[B, (T,) H, W, C]`` and ``VAE.encode``'s latent, float32 on ``output_device``; the
  stock nodes' own steps (the video reshape of VAE Decode, the channel slice of VAE Encode) then work unchanged.
  The weights reach the ranks from the VAE the copy was made from, whose spec is cached: once per VAE, not per copy.
* **Tiled calls decode whole.** ``decode_tiled`` / ``encode_tiled`` take the stock tiled nodes' arguments and run
  the same distributed decode / encode as the untiled methods. Tiling buys bounded memory on one GPU; the ranks
  already give that (each holds a band of rows, and a rank out of memory retries in row tiles), and row mode
  returns the exact untiled image instead of blended tile seams. ``encode_tiled`` encodes the frames the stock one
  does (a video clip trimmed to whole temporal steps).
* **Whatever PatchRay cannot run decodes as stock, and says so.** A VAE PatchRay cannot shard, a decode given
  ``vae_options`` (options of 3-D shape VAEs, forwarded to the model), pixels that are not an IMAGE batch: the call
  goes to the VAE class's own method (``super()``), with a warning in the log; the Parallel VAE node shows the
  reason on its panel when it patches such a VAE.
* **ComfyUI's hooks come from the node layer.** The cancel check and the progress bar are reached through
  ``nodes/_comfy.py``, above the bridge: the node hands in :class:`Hooks`, factories called at each decode (a
  progress bar belongs to the node running the decode, which only exists then).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import vae as bridge_vae
from .vae import Result, plain_vae

__all__ = ["NODE", "Hooks", "ParallelSettings", "ParallelVAE", "parallel_vae"]

log = logging.getLogger(__name__)

#: the node the settings were made on, named in refusals, notes and log lines
NODE = "PatchRay Parallel VAE"


def _no_hook():
    return None


class Hooks(NamedTuple):
    """ComfyUI's hooks for a decode, as factories the node layer hands in (outside ComfyUI both give ``None``).

    Args:
        cancel_check: returns ComfyUI's cancel check (raises when the user pressed Cancel), or ``None``.
        progress: returns a ``fn(done, total)`` driving the progress bar of the node now running, or ``None``.
    """

    cancel_check: Callable[[], Optional[Callable[[], None]]] = _no_hook
    progress: Callable[[], Optional[Callable[[int, int], None]]] = _no_hook


class ParallelSettings(NamedTuple):
    """What a Parallel VAE decodes with: the Parallel VAE node's inputs, checked.

    Args:
        source: the VAE the copy was made from (its spec is cached; its own methods are ComfyUI's).
        cluster: the PatchRay Cluster node's ``ClusterConfig``.
        mode, precision, gn_sync, plan, balance: as the Distributed VAE Decode's inputs (``plan`` None when unused).
        hooks: ComfyUI's cancel check and progress bar (:class:`Hooks`).
        fallback: why this VAE decodes and encodes as stock (None when PatchRay shards it).
    """

    source: Any
    cluster: Any
    mode: str
    precision: str
    gn_sync: bool
    plan: Optional[dict]
    balance: str
    hooks: Hooks
    fallback: Optional[str]


class ParallelVAE:
    """The methods a Parallel VAE overrides; its class is ``(ParallelVAE, <the VAE's own class>)`` (see
    :func:`_parallel_class`), so ``super()`` is ComfyUI's method and every other attribute is the VAE's."""

    _patchray: ParallelSettings

    def decode(self, samples_in, vae_options=None):
        """As ``VAE.decode``: a latent ``[B, C, (T,) h, w]`` -> ``[B, (T,) H, W, C]`` in 0..1, decoded on the ranks."""
        if vae_options:
            why = "ComfyUI's own single-device decode ran: the caller passed vae_options, which PatchRay's ranks do not take"
            return self._stock(why, self._comfy("decode", vae_options=vae_options), samples_in)
        return self._decode(samples_in, self._comfy("decode"))

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """As ``VAE.decode_tiled``, decoded whole on the ranks: the tile sizes are not used (see the module docstring)."""
        tiles = dict(tile_x=tile_x, tile_y=tile_y, overlap=overlap, tile_t=tile_t, overlap_t=overlap_t)
        return self._decode(samples, self._comfy("decode_tiled", **tiles))

    def encode(self, pixel_samples):
        """As ``VAE.encode``: IMAGE ``[B, H, W, C]`` in 0..1 -> the latent mean, encoded on the ranks."""
        return self._encode(pixel_samples, self._comfy("encode"))

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        """As ``VAE.encode_tiled``, encoded whole on the ranks (the tile sizes are not used), of the frames it encodes."""
        tiles = dict(tile_x=tile_x, tile_y=tile_y, overlap=overlap, tile_t=tile_t, overlap_t=overlap_t)
        stock = self._comfy("encode_tiled", **tiles)
        if self._patchray.fallback is None and torch.is_tensor(pixel_samples) and pixel_samples.ndim == 4:
            pixel_samples = pixel_samples[: _tiled_frames(self, int(pixel_samples.shape[0]))]
        return self._encode(pixel_samples, stock)

    def _comfy(self, name: str, **kwargs) -> Callable:
        """``fn(x)``: the VAE class's own method ``name`` (ComfyUI's, not the override) with ``kwargs``, looked up when
        a call falls back, so a VAE class without a tiled method still decodes on the ranks."""

        def call(x):
            return getattr(super(ParallelVAE, self), name)(x, **kwargs)

        return call

    # ------------------------------------------------------------------------------------------ one call each

    def _decode(self, samples, stock: Callable):
        s = self._patchray
        if s.fallback is not None:
            return self._stock(s.fallback, stock, samples)
        progress = s.hooks.progress()
        result = bridge_vae.decode_latent(
            samples, s.source, s.cluster, s.mode, s.precision, s.gn_sync, s.plan, cancel_check=s.hooks.cancel_check(),
            progress=progress, balance=s.balance, node=NODE, stock=stock,
        )
        _finish(progress)
        return result.value

    def _encode(self, pixels, stock: Callable):
        s = self._patchray
        if s.fallback is not None:
            return self._stock(s.fallback, stock, pixels)
        if not torch.is_tensor(pixels) or pixels.ndim != 4:
            why = f"ComfyUI's own single-device encode ran: the pixels are {_shape(pixels)}, not an IMAGE batch [B, H, W, C]"
            return self._stock(why, stock, pixels)
        progress = s.hooks.progress()
        result = bridge_vae.encode_pixels(
            pixels, s.source, s.cluster, s.precision, cancel_check=s.hooks.cancel_check(), progress=progress,
            balance=s.balance, node=NODE, stock=stock,
        )
        _finish(progress)
        return result.value

    @staticmethod
    def _stock(why: str, method: Callable, x):
        """ComfyUI's own method, with the reason in the log: PatchRay does not run this call."""
        log.warning("%s: %s", NODE, why)
        return method(x)


def _shape(x) -> str:
    return f"of shape {tuple(x.shape)}" if torch.is_tensor(x) else f"a {type(x).__name__}"


def _finish(progress) -> None:
    if progress is not None:
        progress(1, 1)


def _tiled_frames(vae, frames: int) -> int:
    """How many of a clip's ``frames`` the stock ``VAE.encode_tiled`` encodes: for a video VAE (``latent_dim`` 3, not
    ``not_video``), whole temporal steps, ``upscale_ratio[0](downscale_ratio[0](frames))`` (e.g. 9 of 10 frames for
    Wan, whose steps are 1 + 4k); every frame otherwise. Read from the VAE's own formulas, as ComfyUI does."""
    if getattr(vae, "latent_dim", None) != 3 or getattr(vae, "not_video", False):
        return frames
    down, up = getattr(vae, "downscale_ratio", None), getattr(vae, "upscale_ratio", None)
    if not (isinstance(down, (tuple, list)) and isinstance(up, (tuple, list)) and callable(down[0]) and callable(up[0])):
        return frames
    keep = int(up[0](down[0](frames)))
    return keep if 0 < keep <= frames else frames


@functools.lru_cache(maxsize=None)
def _parallel_class(base: type) -> type:
    """``base`` with :class:`ParallelVAE`'s methods in front: one class per VAE class, made on first use."""
    name = f"PatchRayParallel{base.__name__}"
    return type(name, (ParallelVAE, base), {"__module__": __name__, "__qualname__": name, "__doc__": ParallelVAE.__doc__})


def parallel_vae(vae, cluster_config, mode: str = "auto", precision: str = "auto", gn_sync: bool = False, plan=None,
                 balance: str = "equal", hooks: Optional[Hooks] = None) -> Result:
    """A copy of ``vae`` that decodes and encodes on the cluster's ranks (see the module docstring).

    Everything that can be judged without a latent is checked here, before any rank starts; nothing is sent to the
    ranks until the first decode. A Parallel VAE given again is re-made from the VAE it came from, with these settings.

    Args:
        vae: ComfyUI's VAE (``comfy.sd.VAE``).
        cluster_config: the PatchRay Cluster node's output.
        mode, precision, gn_sync, plan, balance: as the Distributed VAE Decode's inputs.
        hooks: ComfyUI's cancel check and progress bar, from the node layer (none outside ComfyUI).

    Returns:
        :class:`Result`: the new VAE object, and a note when it differs from the request (a VAE PatchRay cannot shard,
        which then decodes as stock; a plan that row mode does not use), else ``None``.

    Raises:
        TypeError / ValueError: an input that cannot work, naming the node's inputs.

    Example:
        >>> fast = parallel_vae(vae, cluster, mode="row").value  # doctest: +SKIP
        >>> images = fast.decode(latent)  # what vae.decode(latent) returns, computed on the ranks  # doctest: +SKIP
    """
    source = plain_vae(vae)
    checked = bridge_vae.check_settings(NODE, source, cluster_config, mode, precision, plan, balance)
    settings = ParallelSettings(
        source=source, cluster=checked.config, mode=mode, precision=precision, gn_sync=bool(gn_sync), plan=checked.plan,
        balance=balance, hooks=hooks or Hooks(), fallback=checked.fallback,
    )
    copy = object.__new__(_parallel_class(type(source)))
    copy.__dict__.update(vars(source))  # the attribute values themselves: weights, patcher and formulas are shared
    copy._patchray = settings
    note = "; ".join(n for n in (checked.fallback, checked.unused) if n) or None
    return Result(copy, note)
