"""What a first-hour user of the VAE side meets, checked without ComfyUI (the same cases run in a real ComfyUI in
tests/comfyui/test_vae_qa_server.py): refusals worded in the nodes' widgets, never the command line's flags, with
sizes as ComfyUI orders them (width x height), raised before any rank starts."""

import re

import pytest
import torch

from .test_vae_nodes import _kl_vae

_FLAG = re.compile(r"--[a-z]")


def _untouched_cluster(n=2):
    from patchray.distributed.cluster import ClusterConfig

    return ClusterConfig(num_ranks=n, device="cpu", init_timeout_s=117.0)  # a config no test starts


@pytest.mark.parametrize(
    "family, width, height, ranks, expect",
    [
        # 200x136 px is 25x17 latent at 8x: one tile window only; the planner suggests 256x176
        ("kl", 200, 136, 2, ["200x136 px cannot be tiled for 2 rank(s)", "set width to 256 and height to 176"]),
        ("kl", 120, 64, 2, ["120x64 px", "at least 128 px on the image's shorter side", "set width to"]),
        ("kl", 256, 176, 64, ["for 64 rank(s)", "set ranks to 4", "width to 928 and height to 640"]),
        # the widgets step by 8 px; a 16x family needs multiples of 16
        ("wan22", 1008, 1000, 2, ["family wan22 decodes in steps of 16 px", "set height to 992 or 1008"]),
    ],
)
def test_tile_planner_refusals_name_its_widgets_not_command_line_flags(family, width, height, ranks, expect):
    from patchray.nodes.planner import PatchRayTilePlanner

    with pytest.raises(ValueError) as info:
        PatchRayTilePlanner.execute(family=family, width=width, height=height, frames=1, ranks=ranks, choice="balanced")
    msg = str(info.value)
    assert not _FLAG.search(msg), msg
    for part in expect:
        assert part in msg, msg


def test_the_suggested_request_plans():
    """The size and rank count the Tile Planner suggests are ones it then accepts (the suggestion is not invented)."""
    from patchray.nodes.planner import PatchRayTilePlanner

    with pytest.raises(ValueError) as info:
        PatchRayTilePlanner.execute(family="kl", width=256, height=176, frames=1, ranks=64, choice="balanced")
    msg = str(info.value)
    ranks = int(re.search(r"set ranks to (\d+)", msg).group(1))
    width, height = map(int, re.search(r"width to (\d+) and height to (\d+)", msg).groups())
    PatchRayTilePlanner.execute(family="kl", width=256, height=176, frames=1, ranks=ranks, choice="balanced")
    PatchRayTilePlanner.execute(family="kl", width=width, height=height, frames=1, ranks=64, choice="balanced")


def test_tile_runs_on_a_latent_too_small_for_tiles_is_refused_in_node_terms_before_any_rank_starts():
    from patchray.distributed.cluster import ranks
    from patchray.nodes.vae import PatchRayVAEDecode

    before = ranks._current
    z = torch.randn(1, 4, 17, 25)  # 200x136 px at 8x
    with pytest.raises(ValueError) as info:
        PatchRayVAEDecode.execute(samples={"samples": z}, vae=_kl_vae(4), cluster=_untouched_cluster(2), mode="tile-runs",
                                  precision="fp32", gn_sync=False)
    msg = str(info.value)
    assert msg.startswith("PatchRay Distributed VAE Decode: mode 'tile-runs' cannot tile the 200x136 px image of 'samples'"), msg
    assert "use mode 'row'" in msg and "decode an image of at least 256x176 px" in msg, msg
    assert not _FLAG.search(msg), msg
    assert ranks._current is before, "no cluster was started"
