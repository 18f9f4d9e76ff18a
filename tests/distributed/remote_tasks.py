"""Rank-side functions for tests/distributed/test_remote_sampling.py (they travel by name to the rank actors).

A host application in miniature: the "model" is the tiny SDXL UNet (diffusers) rebuilt from a shipped state dict,
the "sampler" is the caller's own Euler/CFG loop (``sdxl.sample_euler_cfg``), calling ``session.denoise`` where it
would call the UNet.
"""

import torch

from patchray.distributed.cluster import rank_cache

STEPS = 6
H = W = 32


def make_payload(seed: int = 0) -> dict:
    from patchray.distributed.sampling import sdxl

    unet = sdxl.build_unet(True, seed=seed)
    return {"config": sdxl.tiny_sdxl_unet_config(), "state_dict": unet.state_dict()}


def prepare(ctx, tag):
    """Stands for 'make the host application importable'; records that it ran before the payload was read."""
    rank_cache().setdefault("test.prepared", []).append(tag)


def begin(ctx, payload):
    """``ship_model``'s ``begin``: the tiny UNet arrives whole with the skeleton (no parts)."""
    unet = build(ctx, payload)
    return unet, unet


def build(ctx, payload):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**payload["config"])
    unet.load_state_dict(payload["state_dict"], assign=True)
    rank_cache()["test.builds"] = rank_cache().get("test.builds", 0) + 1
    return unet.to(ctx.device).eval()


def inputs(seed: int = 5, steps: int = STEPS) -> dict:
    from patchray.distributed.sampling import sdxl

    unet_cfg = type("C", (), {})()
    cfg = sdxl.tiny_sdxl_unet_config()
    for k, v in cfg.items():
        setattr(unet_cfg, k, v)
    fake = type("U", (), {"config": unet_cfg})()
    return {
        "latent": torch.randn(1, 4, H, W, generator=torch.Generator().manual_seed(seed)),
        "cond": sdxl.synthetic_cond(fake, 1),
        "steps": steps,
    }


def reference(payload: dict, inp: dict) -> torch.Tensor:
    """The single-process run of the same loop with the plain UNet."""
    from patchray.distributed.sampling import sdxl

    unet = build(type("Ctx", (), {"device": torch.device("cpu")})(), payload)
    with torch.no_grad():
        return sdxl.sample_euler_cfg(sdxl.unet_denoiser(unet), inp["latent"], inp["cond"], inp["steps"])


def _to(value, device):
    """``value`` (tensors in nested dicts) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def sample(ctx, unet, session, inp):
    from patchray.distributed.sampling import sdxl

    def fn(x, t, **cond):
        return unet(x, t, return_dict=False, **cond)[0]

    def model(x, t, **cond):
        return session.denoise(unet, fn, x, t, stream="cfg", **cond)

    steps = inp["steps"]
    dev = ctx.device  # the inputs travel on the host; a GPU rank samples on its card
    latent = inp["latent"].to(dev)
    cond = _to(inp["cond"], dev)
    with torch.no_grad():
        return sdxl.sample_euler_cfg(model, latent, cond, steps, on_step=lambda i: session.progress(i + 1, steps)).cpu()


def sample_with_info(ctx, unet, session, inp):
    """:func:`sample`, leaving the run's own figures for the caller in ``session.info`` (a different value per rank:
    the caller gets rank 0's)."""
    session.info["seen"] = {"rank": ctx.rank, "steps": inp["steps"]}
    return sample(ctx, unet, session, inp)


def refuse(ctx, unet, session, inp):
    raise ValueError("bad sampler input (raised identically on every rank)")


def state(ctx):
    session = rank_cache().get("patchray.sampling.session")
    rows = tuple(session.denoiser.rows) if session is not None and session.denoiser is not None else None
    return {"builds": rank_cache().get("test.builds", 0), "prepared": list(rank_cache().get("test.prepared", [])),
            "rows": rows}


def _one_call(unet, session, x, cond):
    def fn(x, t, **c):
        return unet(x, t, return_dict=False, **c)[0]

    with torch.no_grad():
        return session.denoise(unet, fn, torch.cat([x, x]), torch.tensor([500.0, 500.0]), stream="cfg", **cond)


def diverge(ctx, unet, session, inp):
    """Rank 1 makes a different UNet call (another latent height): must raise, not mismatch collectives."""
    x = inp["latent"] if ctx.rank == 0 else inp["latent"][..., :16, :]
    return _one_call(unet, session, x, inp["cond"])


def fail_after_a_step(ctx, unet, session, inp):
    _one_call(unet, session, inp["latent"], inp["cond"])
    raise ValueError("the sampler failed after its first step")


def agreed_minimum(ctx, values):
    """``RankSession.agree_min`` of this rank's entry of ``values``: every rank must get the smallest."""
    from patchray.distributed.sampling.config import preset
    from patchray.distributed.sampling.remote import RankSession

    return RankSession(ctx, "agree", preset("full_sync", split_batch=False)).agree_min(values[ctx.rank])
