"""``parallelism=auto`` from measured figures: the driver side of :mod:`patchray.distributed.bench.auto_plan`.

Design decisions:

* **Measured once, on the user's rig, on the run's own input.** The first ``auto`` run of a (model class and size,
  latent shape, ranks, cluster) samples two steps with the whole model on every rank (the ``replicated`` layout, one
  rank's worth of work) and times each model call (:func:`.ksampler_rank.probe_calls`); the figure and the call's
  self-attention shapes are kept on disk (:class:`~patchray.distributed.bench.auto_plan.ProbeCache`). Later runs with
  the same key reuse them and start at once.
* **The link** is the cached topology probe's nearest named profile (:func:`.sampling_options.link_profile`); without
  one, the profile the cluster configuration implies, named as an assumption in the plan line.
* **Only where the rules were exact and free to choose**: parallelism ``auto``, an exact preset (a stale preset makes
  ``auto`` pick sequence, as before), ``sharding=none``, more than one rank, and one whole call fitting a rank. Anything
  else keeps the rules' layout. Each candidate layout must pass the same refusals and the same memory check as a layout
  the user picks; the fastest that does is the plan.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

__all__ = ["PlanResult", "words_bytes", "plan_link", "probe_key_for", "measured_from_info", "after_line", "measured_layout", "check_layout",
           "ranks_memory", "probe_run"]

log = logging.getLogger(__name__)

#: the profile a cluster implies when no topology probe names its link: ranks on several machines (an existing Ray
#: cluster) meet over Ethernet; ranks on one machine over PCIe, without peer-to-peer (the common consumer case)
_IMPLIED_REMOTE = "10gbe"
_IMPLIED_LOCAL = "pcie4_x16_no_p2p"


class PlanResult(NamedTuple):
    """The layout to run, the plan line for the node (``None``: the rules decided) and the candidate's figures."""

    layout: object
    line: Optional[str]
    expected_s: Optional[float] = None


def plan_link(cluster_config, probed: Optional[Callable] = None) -> tuple:
    """``(profile name, words)``: the topology probe's link, else the one the cluster configuration implies."""
    from .sampling_options import link_profile

    name = (probed or link_profile)(cluster_config)
    if name:
        return name, f"the topology probe's link ({name})"
    if getattr(cluster_config, "address", None):
        return _IMPLIED_REMOTE, f"an assumed link ({_IMPLIED_REMOTE}: ranks of a Ray cluster, no link probed)"
    return _IMPLIED_LOCAL, f"an assumed link ({_IMPLIED_LOCAL}: no GPU link probed)"


def _cluster_words(cluster_config) -> str:
    return (f"{getattr(cluster_config, 'device', 'auto')}@{getattr(cluster_config, 'address', None) or 'embedded'}"
            f"/{','.join(str(g) for g in getattr(cluster_config, 'gpu_ids', ()) or ()) or 'any'}")


def probe_key_for(mp, latent_shape, cluster_config, sharding: str) -> str:
    """The measurement's cache key for ComfyUI MODEL ``mp`` (its class, parameter count and weight dtype)."""
    from ...distributed.bench.auto_plan import probe_key
    from .runtime_check import comfy_version, patchray_version

    dm = mp.model.diffusion_model
    params = sum(p.numel() for p in dm.parameters())
    dtype = str(getattr(mp.model, "manual_cast_dtype", None) or next(dm.parameters()).dtype)
    return probe_key(type(dm).__name__, params, dtype, latent_shape, int(cluster_config.num_ranks),
                     _cluster_words(cluster_config), sharding, comfy_version(), patchray_version())


def measured_from_info(info: dict, batch: int):
    """The :class:`~patchray.distributed.bench.auto_plan.Measured` of a probe run's rank-0 ``info``: the slowest rank's
    best time per batch row times the batch, and the self-attentions of the call with the most rows scaled to one
    conditioning's batch."""
    from ...distributed.bench.auto_plan import AttentionSite, Measured

    calls = info.get("probe") or []
    if not calls or not info.get("probe_row_ms"):
        return None
    widest = max(calls, key=lambda c: c["rows"])
    per = max(1, widest["rows"] // max(1, batch))  # cond and uncond in one call: its rows are per conditioning batches
    sites = tuple(AttentionSite(t, h, d, max(1, b // per), n) for t, h, d, b, n in widest["sites"])
    return Measured(float(info["probe_row_ms"]) * batch, sites, int(widest["out_bytes"] // per), int(widest["itemsize"]),
                    int(batch))


def after_line(seconds: float, steps: int, bytes_per_step: Optional[float], comm_s: Optional[float],
               expected_s: Optional[float]) -> str:
    """``measured: X s/step, B exchanged per step, C s in communication (...); the plan expected E s/step`` (B: the
    bytes rank 0 put on its link)."""

    line = f"measured: {seconds / steps:.3g} s/step over {steps} step{'s' if steps != 1 else ''}"
    line += f", {words_bytes(bytes_per_step or 0.0)} exchanged per step"
    if comm_s is not None:
        line += f", {comm_s:.3g} s in communication ({comm_s / steps:.3g} s/step)"
    if expected_s is not None:
        line += f"; the plan expected {expected_s:.3g} s/step (MODELLED)"
    return line


def measured_layout(rule_layout, *, mp, options, cfg_on: bool, batch: int, latent_shape, sequence_ok: bool,
                    check_layout: Callable, probe: Callable, memory: Callable, link=None) -> PlanResult:
    """The fastest exact layout that passes the checks, from the cached or a fresh measurement.

    Args:
        rule_layout: the rules' layout (:func:`.dit_layout.plan_layout`): kept when the plan cannot decide.
        check_layout: ``fn(layout)``: raises ``ValueError`` / ``NotImplementedError`` where the run's refusals reject it.
        probe: ``fn() -> info``: samples the probe run on the ranks (the model shipped); rank 0's info.
        memory: ``fn() -> per-rank memory`` (``ksampler_rank.device_memory``'s figures).
        link: ``(profile, words)``; ``None``: :func:`plan_link`.
    """
    from ...distributed.bench import auto_plan as ap
    from .dit_layout import Layout
    from .rank_call import check_call_memory

    n = int(options.num_ranks)
    mem = memory()
    try:
        check_call_memory(mp, tuple(latent_shape), Layout("replicated", n), mem)
    except ValueError:
        return PlanResult(rule_layout, "plan: the rules' layout (one whole model call does not fit a rank, so none was "
                                       "measured): " + rule_layout.mode)
    cache = ap.ProbeCache()
    key = probe_key_for(mp, latent_shape, options.cluster, options.sharding)
    measured = cache.get(key)
    cached = measured is not None
    if measured is None:
        measured = measured_from_info(probe(), batch)
        if measured is None:
            return PlanResult(rule_layout, None)
        cache.put(key, measured)
    name, words = link or plan_link(options.cluster)
    found = ap.candidates(measured, name, n, cfg_on, sequence_ok=sequence_ok, attention=options.sequence_attention)
    fits = {}
    for c in found:
        layout = _layout_of(c, n)
        try:
            check_layout(layout)
            check_call_memory(mp, tuple(latent_shape), layout, mem)
            fits[c.mode] = True
        except (ValueError, NotImplementedError) as exc:
            log.info("PatchRay: plan: %s left out: %s", c.mode, exc)
            fits[c.mode] = False
    plan = ap.choose(found, fits, name)
    if plan.chosen is None:
        return PlanResult(rule_layout, None)
    return PlanResult(_layout_of(plan.chosen, n), ap.plan_line(plan, measured, words, cached), plan.chosen.s_per_step)


def _layout_of(c, n: int):
    from .dit_layout import Layout

    if c.mode == "batch":
        return Layout("batch", n, batch=True)
    return Layout(c.mode, n, cfg_groups=c.cfg_groups, seq_ranks=c.seq_ranks)


# ------------------------------------------------------------------------------------------- on the ranks


def check_layout(mp, latent, layout, kind: str, attention: str) -> None:
    """The refusals a candidate layout must pass before the plan may pick it (the sampler node's own, by the same
    functions): the MODEL's patches under the mode, the sequence split's rows and heads."""
    import operator

    from . import model as bridge_model
    from . import validate
    from .rank_call import OUTER_KEY

    bridge_model.model_key(mp, layout.mode, ignore=(OUTER_KEY,))
    if layout.seq_ranks > 1:
        if kind == "unet":
            validate.sampling_rows(mp, latent, layout.seq_ranks)
        bridge_model.check_sequence(mp, latent, layout.seq_ranks)
        if kind == "dit" and attention == "ulysses":
            from .dit_models import find_row

            dm = mp.model.diffusion_model
            heads = int(operator.attrgetter(find_row(type(dm).__name__).heads)(dm))
            if heads % layout.seq_ranks:
                raise ValueError(f"sequence_attention=ulysses: {heads} heads over {layout.seq_ranks} ranks")


def ranks_memory(options, hooks) -> list:
    """Per rank ``(free, total, device type)``; the ranks start here on first use."""
    from ...distributed.cluster import get_cluster
    from . import ksampler_rank

    cluster = get_cluster(options.cluster, cancel_check=hooks.cancel_check)
    return cluster.run(ksampler_rank.device_memory, timeout_s=60.0, cancel_check=hooks.cancel_check)


def probe_run(guider, noise, latent, sampler, sigmas, denoise_mask, seed, options, hooks, kind: str, config) -> dict:
    """Two steps of the run with the whole model on every rank (one rank's worth of work), each call timed: rank 0's
    info (:func:`.ksampler_rank.probe_calls`). The model ships as the run itself ships it (``sharding=none``), so the run
    that follows finds it on the ranks."""
    from ...distributed.cluster import get_cluster
    from ...distributed.sampling.remote import distributed_sample
    from ...distributed.sampling.ship import ship_model
    from . import ksampler_rank
    from . import model as bridge_model
    from .dit_layout import Layout
    from .rank_call import OUTER_KEY, rank_inputs

    mp = guider.model_patcher
    n = int(options.num_ranks)
    layout = Layout("replicated", n)
    key, make_skeleton, names, tensor, sizes = bridge_model.portable_parts(mp, "cfg", ignore=(OUTER_KEY,))
    key = key + (("sharding", "none"),)
    inputs = rank_inputs(guider, noise, latent, sampler, sigmas[: min(3, int(sigmas.shape[-1]))], denoise_mask, seed,
                         layout, kind, "auto")
    inputs["probe"] = True
    root = bridge_model.comfy_root()
    cluster = get_cluster(options.cluster, cancel_check=hooks.cancel_check)

    def make_payload(make=make_skeleton):
        return dict(make(), sharding="none")

    ship_model(cluster, key, make_payload, ksampler_rank.begin_parts, names=names, tensor=tensor,
               end=ksampler_rank.end_parts, sizes=sizes, prepare=ksampler_rank.prepare, prepare_args=(root,),
               cancel_check=hooks.cancel_check)
    result = distributed_sample(cluster, key, ksampler_rank.sample, inputs, config, prepare=ksampler_rank.prepare,
                                prepare_args=(root,), cancel_check=hooks.cancel_check,
                                timeout_s=options.cluster.call_timeout_s)
    return result.get("info") or {}


def words_bytes(n: float) -> str:
    """``n`` bytes in words (``"3.2 MB"``), as the node's lines give them."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
