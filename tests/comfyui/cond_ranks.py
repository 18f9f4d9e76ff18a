"""Conditionings that change what a DiT call sees, under sequence parallelism on N gloo ranks, each against the stock
KSampler on the same model: an area condition (ComfyUI crops the latent to the area for that call), a mask condition
(the call's output weighted by the mask), both on one prompt beside a plain one, an inpainting concat latent and mask
(InpaintModelConditioning's keys, a model that takes them), and a style model's image tokens appended to the text.

The area and mask values are ComfyUI's own (``ConditioningSetArea`` / ``ConditioningSetMask`` outputs, built by the
nodes themselves); the sequence split sees whatever latent each call gets, so each call is split on its own.

    python tests/comfyui/cond_ranks.py --comfy /path/to/ComfyUI --ranks 2 --cases flux-area ... [--out r.json]
"""

from __future__ import annotations

import sys

import torch

from rank_harness import each_case, rank_main, sample_case

#: name -> (model kind, conditioning)
CASES = {
    "flux-area": ("flux", "area"),
    "flux-mask": ("flux", "mask"),
    "flux-area-mask": ("flux", "area+mask"),
    "flux-style": ("flux", "style"),
    "fluxfill-inpaint": ("fluxfill", "inpaint"),
}


def _build(kind):
    import dit_ranks

    if kind == "fluxfill":  # FLUX.1 Fill: the latent, the masked image and the mask concatenated on the channels
        import comfy.supported_models as sm
        from rank_harness import patcher, random_model

        cfg = {"image_model": "flux", "in_channels": 96, "out_channels": 16, "vec_in_dim": 48, "context_in_dim": 40,
               "hidden_size": 192, "mlp_ratio": 2.0, "num_heads": 6, "depth": 1, "depth_single_blocks": 1,
               "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
        mp = patcher(random_model(sm.FluxInpaint(cfg)))

        def cond(g, b=1):
            return [[torch.randn(b, 7, 40, generator=g), {"pooled_output": torch.randn(b, 48, generator=g)}]]

        return mp, cond, (1, 16, 13, 10)
    return dit_ranks._model(kind)


def _with(cond, what, shape, g):
    """``cond`` (ComfyUI conditioning) with ``what`` set the way the stock nodes set it."""
    import comfy_extras.nodes_mask  # noqa: F401  (ComfyUI's own nodes are what build these values)
    import nodes as comfy_nodes

    lat_h, lat_w = shape[-2], shape[-1]
    out = cond
    if "area" in what:  # ConditioningSetArea takes pixels; the area covers the lower-right part of the image
        (out,) = comfy_nodes.ConditioningSetArea().append(out, width=8 * (lat_w - 2), height=8 * (lat_h - 4),
                                                          x=16, y=32, strength=0.8)
    if "mask" in what:
        mask = (torch.rand(lat_h * 8, lat_w * 8, generator=g) > 0.5).float()
        (out,) = comfy_nodes.ConditioningSetMask().append(out, mask, "default", 0.9)
    if what == "style":  # StyleModelApply's result: the image's tokens appended to the text tokens
        out = [[torch.cat([c[0], torch.randn(c[0].shape[0], 5, c[0].shape[-1], generator=g)], dim=1), dict(c[1])]
               for c in out]
    if what == "inpaint":  # InpaintModelConditioning's keys: the masked image's latent and the mask
        concat = torch.randn((1, 16) + tuple(shape[2:]), generator=g)
        mask = (torch.rand((1, 1, lat_h * 8, lat_w * 8), generator=g) > 0.5).float()
        out = [[c[0], dict(c[1], concat_latent_image=concat, concat_mask=mask)] for c in out]
    return out


def _rank(ctx, opts):
    from patchray.nodes.bridge.dit_layout import plan_layout
    from rank_harness import sampling_inputs

    results = {}
    for name, (kind, what), (mp, cond, shape) in each_case(ctx, opts, CASES, _build):
        g = torch.Generator().manual_seed(3)
        pos = _with(cond(g), what, shape, g)
        neg = cond(g)
        if what in ("area", "mask", "area+mask"):
            pos = pos + cond(g)  # beside a plain prompt: the step combines both, as in ComfyUI's area workflows
        if what == "inpaint":
            neg = _with(neg, what, shape, torch.Generator().manual_seed(3))
        latent = torch.zeros(shape)
        inputs = sampling_inputs(latent, None, pos, neg, "euler", opts["cfg"], parallelism="sequence",
                                 attention="gathered")
        layout = plan_layout("sequence", ctx.world_size, inputs["cfg"], 1, sequence_refusal=None)
        results[name] = sample_case(ctx, ("model", kind), mp, inputs, layout, "dit", "gathered")
        if name == "flux-area":  # the driver's check of a crop too small for the ranks: refused before anything ships
            from patchray.nodes.bridge.model import check_area_sequence

            tiny = [[pos[0][0], dict(pos[0][1], area=(1, 4, 0, 0))]]  # one latent row: no token row per rank
            try:
                check_area_sequence(mp, "positive", tiny, tuple(shape), ctx.world_size)
                results["area-too-small"] = "passed"
            except ValueError as exc:
                results["area-too-small"] = str(exc)
            check_area_sequence(mp, "positive", pos, tuple(shape), ctx.world_size)  # the case's own area fits
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv, lambda results: {"per_rank": results})


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
