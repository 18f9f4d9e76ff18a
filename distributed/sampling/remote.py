"""Patch-parallel sampling driven from one process: the model lives on the ranks, each rank runs the sampler.

This is how a host application (ComfyUI) samples on the cluster without giving up its own samplers:

1. :func:`~.ship.ship_model` puts the model on every rank **once per key** (``rank_cache``; a new key replaces
   the old model, so a rank holds one sampling model at a time): the skeleton, then the weights in parts.
2. :func:`distributed_sample` runs the caller's ``sample(ctx, model, session, inputs)`` on every rank. The
   caller's sampler loop (ComfyUI's KSampler, a diffusers scheduler, anything) calls
   :meth:`RankSession.denoise` where it would call the UNet; the session routes the call through a
   :class:`~.denoiser.PatchParallelDenoiser` bound to that UNet, so each rank computes its row band and the
   output is completed from the peers' bands (gather or OTIL). At the end the session's ``finalize`` gathers each
   rank's own band of the final latent, the exact result, and rank 0's copy returns to the driver.

Design decisions:

* **The sampler runs on every rank, not on the driver.** OTIL leaves each rank's latent approximate outside its
  band (the ranks disagree in remote regions; only the final gather is exact), so the loop must run where
  the band is fresh. Driving the UNet call by call from the driver would turn OTIL into a plain gather.
* **Inputs travel as one object reference, resolved on the ranks after ``prepare``** (see
  :func:`distributed_sample`): a payload that pickles host-application classes (ComfyUI's model, conditioning)
  can only be unpickled once the rank has made that application importable.
* **One denoiser per (model, config), reused across runs**: the adapters are installed on the cached UNet once;
  :meth:`RankSession.begin` resets the stale memories so every run starts with synchronous steps. A changed
  config removes the old adapters first (the UNet is restored exactly, then re-wrapped).
* Nothing here imports a host application: ``sample``/``prepare`` are the caller's functions, sent by reference
  (``cluster.fn_ref``) or pickled by Ray.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.nn as nn

from ..cluster import RankFailure, caused_by, fn_ref, rank_cache, report_progress, resolve_fn
from ..comm import all_gather_padded
from ..context import ParallelContext
from .comm_manager import Traffic
from .config import PatchConfig
from .denoiser import PatchParallelDenoiser
from .ship import SESSION_SLOT as _SESSION
from .ship import rank_model

__all__ = ["distributed_sample", "RankSession", "SamplingDesync"]

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------------------------------- rank side


class SamplingDesync(RuntimeError):
    """A rank failed after the run's collectives began (or the ranks' calls disagreed): the group may be out of step.

    :func:`distributed_sample` stops the cluster on it, so the next call starts from a fresh group.
    """


class RankSession:
    """One rank's patch-parallel state for the cached model: the denoiser, the run's step counts, progress.

    The caller's sampler calls :meth:`denoise` in place of the UNet; :meth:`progress` on rank 0 drives the
    driver's progress bar; :meth:`finalize` returns the exact final latent (a collective: every rank calls it).
    """

    def __init__(self, ctx: ParallelContext, key: Hashable, config: PatchConfig, input_conv: Optional[str] = None):
        self.ctx, self.key, self.config, self.input_conv = ctx, key, config, input_conv
        self.denoiser: Optional[PatchParallelDenoiser] = None
        self._unet: Optional[nn.Module] = None
        self._fn: Optional[Callable[..., Any]] = None
        self.calls = 0  # model calls (UNet or DiT) completed in this run
        self.entered = 0  # model calls begun in this run (collectives may have started)
        self._denoised = 0  # of them, calls through this session's own denoiser (others count sub-sessions' calls)
        #: what this run's sampler leaves for the caller to read (e.g. the attention modes that ran); rank 0's
        #: comes back beside the latent as ``"info"``
        self.info: dict = {}

    def begin(self) -> None:
        """A new sampling run: every stream starts again at logical step 0 (synchronous)."""
        self.calls = self.entered = self._denoised = 0
        self.info = {}
        if self.denoiser is not None:
            self.denoiser.reset()

    def agree_min(self, value: float) -> float:
        """The minimum of ``value`` over the ranks (one tiny all-gather): for host decisions that read local state.

        ComfyUI, for one, decides from the device's free memory whether cond and uncond share a model call; ranks
        that decided differently would make different collective calls. Feed such inputs through here.
        """
        if self.ctx.world_size == 1:
            return float(value)
        t = torch.tensor([[float(value)]], dtype=torch.float64, device=self.ctx.device)
        every = all_gather_padded(t, self.ctx, dim=0, sizes=[1] * self.ctx.world_size)
        return float(every.min().item())

    def _check_same_call(self, stream: Hashable, x: torch.Tensor) -> None:
        """Every rank must be making the same model call (stream and shape); raise instead of mismatching collectives."""
        sig = torch.tensor([zlib.crc32(repr(stream).encode()), *x.shape, self.entered], dtype=torch.int64, device=self.ctx.device)
        every = all_gather_padded(sig.view(1, -1), self.ctx, dim=0, sizes=[1] * self.ctx.world_size).cpu()
        if not bool((every == every[0]).all()):
            raise SamplingDesync(
                f"rank {self.ctx.rank}: the ranks' samplers diverged (stream-hash, shape, call index per rank: "
                f"{every.tolist()}); every rank must make the same sequence of model calls"
            )

    def denoise(self, unet: nn.Module, fn: Callable[..., Any], x: torch.Tensor, t: Any, *, stream: Hashable = None, **cond) -> torch.Tensor:
        """One UNet evaluation, patch-parallel: ``fn(x, t, **cond)`` must run ``unet`` (e.g. a wrapper's executor).

        ``stream`` keys the stale memories of calls that are not the same logical evaluation (ComfyUI evaluates
        cond and uncond separately when memory is short). Returns the full output (approximate outside this
        rank's band in OTIL mode).
        """
        if self._unet is not None and unet is not self._unet:
            raise RuntimeError("RankSession.denoise got a different model than before; one session serves one model")
        if self.denoiser is None:
            self._unet = unet
            self.denoiser = PatchParallelDenoiser(
                self._call, self.ctx, self.config, unet=unet, cfg_in_batch=False, input_conv=self.input_conv
            )
        self.entered += 1
        if self.ctx.world_size > 1:
            self._check_same_call(stream, x)
        self._fn = fn
        try:
            out = self.denoiser(x, t, patch_stream=stream, **cond)
        finally:
            self._fn = None
        self.calls += 1
        self._denoised += 1
        return out

    def _call(self, x, t, **cond):
        return self._fn(x, t, **cond)

    def progress(self, done: int, total: int) -> None:
        if self.ctx.rank == 0:
            report_progress(done, total)

    def finalize(self, latent: torch.Tensor) -> torch.Tensor:
        """The exact final latent (each rank's own band, gathered); the latent itself if this session's denoiser did
        not run in this run (its state may be an earlier run's, of another size, while a CFG or batch group's own
        session sampled this one)."""
        if self.denoiser is None or self._denoised == 0:
            return latent
        with torch.no_grad():  # host samplers may hand back inference-mode tensors on the host's device
            return self.denoiser.finalize(latent.to(self.ctx.device))

    @property
    def traffic(self):
        return None if self.denoiser is None else self.denoiser.traffic

    def close(self) -> None:
        """Remove the adapters: the UNet is exactly as it was before the first :meth:`denoise`."""
        if self.denoiser is not None:
            self.denoiser.remove()
            self.denoiser = None
            self._unet = None


def _session(ctx: ParallelContext, key: Hashable, config: PatchConfig, input_conv: Optional[str]) -> RankSession:
    cache = rank_cache()
    session = cache.get(_SESSION)
    if session is not None and (session.key, session.config, session.input_conv) == (key, config, input_conv) \
            and session.ctx.band_weights == ctx.band_weights:  # other weights: other band tables, a fresh denoiser
        session.ctx = ctx
        return session
    if session is not None:
        session.close()
    session = cache[_SESSION] = RankSession(ctx, key, config, input_conv)
    return session


def _sample_on_rank(ctx: ParallelContext, key, sample, inputs_ref, config: dict, input_conv, prepare, prepare_args, return_traffic: bool,
                    band_weights=None):
    import ray

    ctx = ctx.with_band_weights(band_weights)  # the same figures on every rank: the same band tables
    if prepare is not None:
        resolve_fn(prepare)(ctx, *prepare_args)
    try:
        inputs = ray.get(inputs_ref)
    except Exception as exc:
        raise RuntimeError(
            f"rank {ctx.rank} cannot load this run's inputs ({type(exc).__name__}: {exc}); objects from code that is "
            "not importable on the ranks (e.g. functions of other custom nodes in the model options) cannot travel"
        ) from exc
    model = rank_model(key)
    session = _session(ctx, key, PatchConfig(**config), input_conv)
    session.begin()
    before = session.traffic.snapshot() if session.traffic is not None else None
    try:
        latent = resolve_fn(sample)(ctx, model, session, inputs)
        if not isinstance(latent, torch.Tensor):
            raise TypeError(f"the sample function returned {type(latent).__name__}; it must return the final latent tensor")
        out = session.finalize(latent)
    except BaseException as exc:
        started = session.entered > 0
        # a failed run leaves half-filled memories behind: the next run starts from a fresh session
        rank_cache().pop(_SESSION, None)
        session.close()
        if started and not isinstance(exc, (SamplingDesync, KeyboardInterrupt)):
            raise SamplingDesync(
                f"rank {ctx.rank} failed after {session.entered} model call(s) began: {type(exc).__name__}: {exc}"
            ) from exc
        raise
    if ctx.rank != 0:
        return None
    result = {"latent": out.detach().to("cpu"), "calls": session.calls}
    if session.info:
        result["info"] = dict(session.info)
    if return_traffic and session.traffic is not None:
        after = session.traffic.snapshot()
        result["traffic"] = Traffic.diff(after, before) if before is not None else after
    return result


_sample_on_rank.patchray_task = "sampling"


# ------------------------------------------------------------------------------------------------- driver side


def distributed_sample(
    cluster,
    key: Hashable,
    sample: Any,
    inputs: Any,
    config: PatchConfig,
    *,
    input_conv: Optional[str] = None,
    prepare: Any = None,
    prepare_args: Sequence[Any] = (),
    timeout_s: Optional[float] = None,
    cancel_check: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    return_traffic: bool = False,
    band_weights: Optional[Sequence[float]] = None,
) -> dict:
    """Run ``sample(ctx, model, session, inputs)`` on every rank with the model shipped under ``key``.

    ``sample`` runs the caller's sampler loop, calling ``session.denoise(unet, fn, x, t, stream=..., **cond)`` in
    place of the UNet and ``session.progress(done, total)`` per step, and returns its final latent. Every rank
    must make the same sequence of ``denoise`` calls (same shapes): the sampler must be deterministic given the
    inputs (seeded noise included). Returns ``{"latent": exact final latent (CPU), "calls": model calls}`` from
    rank 0, plus ``"traffic"`` when asked and ``"info"`` when rank 0's sampler left anything in ``session.info``.

    ``band_weights`` (one positive figure per rank, e.g. ``topology.cluster_band_weights(cluster, "speed")``) make
    every band table of the run (UNet row bands, DiT token shards) proportional to them; ``None``: equal bands.
    The final latent is assembled from every rank's own band either way.

    Raises:
        TypeError: ``config`` is not a PatchConfig.
        RankFailure / the ranks' own ValueError etc.: see :meth:`RankCluster.run`.
    """
    import ray

    if not isinstance(config, PatchConfig):
        raise TypeError(f"config must be a PatchConfig (got {type(config).__name__}); use sampling.config.preset(name)")
    ref = ray.put(inputs)
    try:
        results = cluster.run(
            _sample_on_rank, key, fn_ref(sample), ref, config.to_dict(), input_conv,
            fn_ref(prepare) if prepare is not None else None, tuple(prepare_args), return_traffic,
            tuple(band_weights) if band_weights is not None else None, timeout_s=timeout_s, cancel_check=cancel_check, progress=progress,
        )
    except RankFailure as exc:
        if caused_by(exc, SamplingDesync) and not cluster.broken:
            # the ranks all returned, but their collectives may be out of step: never reuse this group
            raise cluster._failure(str(exc), exc.ranks, exc) from exc
        raise
    finally:
        del ref
    return results[0]
