"""The Distributed KSampler's parallelism bookkeeping without ComfyUI: the DiT table and its refusals, the layout of
the parallelism widget, and the CFG and batch wrappers on real gloo ranks.

The wrappers are ComfyUI extension-point callables (``wrapper(executor, ...)``); here the executor is a plain
function with a diffusion model's call signature, since ComfyUI is not installed in CI. Their use inside ComfyUI's
sampler, against the stock KSampler, is tested in tests/comfyui/test_dit_ranks.py (opt-in).
"""

from types import SimpleNamespace

import pytest
import torch

from patchray.nodes.bridge import dit_layout, dit_models
from patchray.nodes.bridge.dit_layout import plan_layout


# ------------------------------------------------------------------------------------------- the DiT table


@pytest.mark.parametrize("cls, family", [("Flux", "FLUX.1"), ("Chroma", "Chroma"), ("WanModel", "Wan 2.1 / 2.2")])
def test_covered_classes_have_one_row(cls, family):
    row = dit_models.find_row(cls)
    assert row is not None and row.family.startswith(family)
    assert sum(cls in r.classes for r in dit_models.ROWS) == 1
    # every attention kind is one the rank side knows; joint rows say where the text goes
    assert set(row.attends.values()) <= {"self", "joint", "cross"}
    assert ("joint" in row.attends.values()) == (row.text != dit_models.NONE)


@pytest.mark.parametrize("cls", ["CameraWanModel", "WanModel_S2V", "ChromaRadiance", "MMDiT"])
def test_uncovered_classes_are_refused_by_name_with_what_is_needed(cls):
    assert dit_models.find_row(cls) is None
    msg = dit_models.refusal(cls, "comfy.ldm.x.model")
    assert cls in msg and "comfy.ldm.x.model" in msg
    assert "parallelism=cfg or batch" in msg
    if cls in dit_models.KNOWN_UNCOVERED:
        assert dit_models.KNOWN_UNCOVERED[cls] in msg
    else:
        assert "where its image tokens are made" in msg


def test_token_grid_pads_to_the_patch_like_the_models():
    flux = dit_models.find_row("Flux")
    wan = dit_models.find_row("WanModel")
    assert dit_models.token_grid(flux, SimpleNamespace(patch_size=2), (1, 16, 13, 10)) == (1, 7, 5)
    assert dit_models.token_grid(wan, SimpleNamespace(patch_size=(1, 2, 2)), (1, 16, 5, 9, 6)) == (5, 5, 3)
    with pytest.raises(ValueError, match="expected"):
        dit_models.token_grid(flux, SimpleNamespace(patch_size=2), (16, 13, 10))


def test_call_and_conditioning_refusals_name_the_input():
    flux = dit_models.find_row("Flux")
    assert dit_models.call_refusal(flux, {"x": 1, "ref_latents": None, "kwargs": {}}) is None
    assert "Kontext" in dit_models.call_refusal(flux, {"x": 1, "ref_latents": [torch.zeros(1)]})
    assert "attention mask" in dit_models.call_refusal(flux, {"x": 1, "kwargs": {"attention_mask": torch.zeros(1)}})
    cond = [[torch.zeros(1, 4, 8), {"pooled_output": torch.zeros(1, 8)}]]
    assert dit_models.cond_refusal(flux, "positive", cond) is None
    cond[0][1]["reference_latents"] = [torch.zeros(1)]
    assert "in positive" in dit_models.cond_refusal(flux, "positive", cond)


# ------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "mode, n, cfg, batch, seq_ok, stale, want",
    [
        ("auto", 2, 5.0, 2, True, False, ("batch", 1, 1, True)),
        ("auto", 2, 5.0, 1, True, False, ("cfg", 2, 1, False)),
        ("auto", 4, 5.0, 1, True, False, ("cfg+sequence", 2, 2, False)),
        ("auto", 3, 1.0, 1, True, False, ("sequence", 1, 3, False)),
        ("auto", 3, 5.0, 1, True, False, ("sequence", 1, 3, False)),
        ("auto", 2, 5.0, 2, True, True, ("sequence", 1, 2, False)),  # a UNet's stale preset keeps patch parallelism
        ("auto", 2, 5.0, 1, False, False, ("cfg", 2, 1, False)),
        ("auto", 3, 5.0, 4, False, False, ("batch", 1, 1, True)),
        ("sequence", 3, 5.0, 3, True, False, ("sequence", 1, 3, False)),
        ("cfg", 2, 5.0, 1, False, False, ("cfg", 2, 1, False)),
        ("cfg+sequence", 4, 5.0, 1, True, False, ("cfg+sequence", 2, 2, False)),
        ("cfg+sequence", 6, 5.0, 1, True, False, ("cfg+sequence", 2, 3, False)),
        ("batch", 3, 5.0, 5, False, False, ("batch", 1, 1, True)),
        ("cfg", 1, 5.0, 1, True, False, ("sequence", 1, 1, False)),
    ],
)
def test_layouts(mode, n, cfg, batch, seq_ok, stale, want):
    lay = plan_layout(mode, n, cfg, batch, sequence_refusal=None if seq_ok else "no row", stale_preset=stale)
    assert (lay.mode, lay.cfg_groups, lay.seq_ranks, lay.batch) == want
    assert lay.note == ""
    if not lay.batch:
        assert lay.cfg_groups * lay.seq_ranks == n


def test_cfg_one_is_a_note_not_an_error():
    lay = plan_layout("cfg", 2, 1.0, 1, sequence_refusal=None)
    assert (lay.mode, lay.seq_ranks) == ("sequence", 2) and "cfg = 1" in lay.note
    lay = plan_layout("cfg+sequence", 4, 1.0, 1, sequence_refusal=None)
    assert (lay.mode, lay.seq_ranks) == ("sequence", 4) and "cfg = 1" in lay.note
    lay = plan_layout("cfg", 2, 1.0, 1, sequence_refusal="no row")
    assert (lay.mode, lay.cfg_groups, lay.seq_ranks) == ("replicated", 1, 1) and "every rank" in lay.note


@pytest.mark.parametrize(
    "mode, n, batch, seq_ok, match",
    [
        ("fast", 2, 1, True, "parallelism must be one of"),
        ("cfg", 3, 1, True, "two ranks"),
        ("cfg+sequence", 2, 1, True, "from four"),
        ("cfg+sequence", 5, 1, True, "from four"),
        ("batch", 3, 2, True, "smaller than"),
        ("sequence", 2, 1, False, "no row for X"),
        ("cfg+sequence", 4, 1, False, "no row for X"),
        ("auto", 3, 1, False, "batch cannot help"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_widget(mode, n, batch, seq_ok, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(mode, n, 5.0, batch, sequence_refusal=None if seq_ok else "PatchRay Distributed KSampler: no row for X")


def test_groups_and_peers():
    lay = plan_layout("cfg+sequence", 6, 5.0, 1, sequence_refusal=None)
    assert [lay.group_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert lay.seq_group(1) == [3, 4, 5]
    assert lay.cfg_peers(2) == [2, 5]
    assert dit_layout.MODES == ["auto", "sequence", "cfg", "cfg+sequence", "batch"]


def test_node_lists_the_modes_the_planner_knows():
    from patchray.nodes.bridge.sampling_options import PARALLELISM_NAMES

    assert PARALLELISM_NAMES == dit_layout.MODES


# ------------------------------------------------------------------------------------------- wrappers on gloo ranks


class _Executor:
    """What ComfyUI hands a wrapper: callable, with ``original`` (the wrapped function, for its signature)."""

    def __init__(self, fn):
        self.original = fn
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.original(*args, **kwargs)


def _model_forward(x, timestep, context, y=None, guidance=None, ref_latents=None, control=None, transformer_options={}, **kwargs):
    """A per-row 'diffusion model' with FLUX's call signature: each output row depends only on its own inputs."""
    out = x * timestep.view(-1, 1, 1, 1) + context.mean(dim=(1, 2)).view(-1, 1, 1, 1) + y.sum(dim=1).view(-1, 1, 1, 1)
    return out + guidance.view(-1, 1, 1, 1) + kwargs["extra"][0].view(-1, 1, 1, 1)


def _batch_rank(ctx, rows_list):
    return [_batch_call(ctx, rows) for rows in rows_list]


def _batch_call(ctx, rows):
    from patchray.nodes.bridge.dit_rank import batch_parallel

    g = torch.Generator().manual_seed(0)  # every rank builds the same call
    x = torch.randn(rows, 3, 5, 4, generator=g)
    args = dict(timestep=torch.rand(rows, generator=g), context=torch.randn(rows, 7, 6, generator=g),
                y=torch.randn(rows, 8, generator=g), guidance=torch.rand(rows, generator=g),
                transformer_options={"cond_or_uncond": [0, 1]}, extra=[torch.randn(rows, generator=g)])
    full = _model_forward(x, **args)
    ex = _Executor(_model_forward)
    out = batch_parallel(ctx)(ex, x, args["timestep"], args["context"], args["y"], args["guidance"], None, None,
                              args["transformer_options"], extra=args["extra"])
    seen = ex.calls[0][0][0].shape[0]
    assert ex.calls[0][0][7] is not None  # transformer_options still reach the model
    return {"max_err": (out - full).abs().max().item(), "rows_seen": seen}


_ROWS = [2, 5]
_CONDS = {2: [[0], [1]], 3: [[0, 1], [2]], 1: [[0], [0]]}  # with one live conditioning (cfg = 1) both evaluate it


def _both_rank(ctx):
    return {"batch": _batch_rank(ctx, _ROWS), "cfg": _cfg_rank(ctx, list(_CONDS))}


@pytest.fixture(scope="module")
def two_ranks():
    """Both wrappers on one pair of gloo ranks (one spawn: CI time)."""
    from patchray.distributed.spawn import run_ranks

    return run_ranks(_both_rank, 2, backend="gloo", device="cpu", timeout_s=120)


def test_batch_wrapper_splits_rows_and_returns_the_whole_call(two_ranks):
    res = [r["batch"] for r in two_ranks]
    for i, rows in enumerate(_ROWS):
        assert [r[i]["rows_seen"] for r in res] == [(rows + 1) // 2, rows // 2]  # contiguous, the first rank one more
        for r in res:
            assert r[i]["max_err"] == 0.0  # the same per-row arithmetic, gathered: bit-identical


def _calc_cond_batch(model, conds, x_in, timestep, model_options):
    """ComfyUI's calc_cond_batch contract: one output per entry of ``conds``, zeros for a ``None`` entry."""
    model.append([i for i, c in enumerate(conds) if c is not None])
    return [torch.zeros_like(x_in) if c is None else x_in * c[0]["scale"] + timestep for c in conds]


def _cfg_rank(ctx, n_list):
    return [_cfg_call(ctx, n) for n in n_list]


def _cfg_call(ctx, n_conds):
    from patchray.distributed.sampling.split import RankGroups
    from patchray.nodes.bridge.dit_rank import cfg_parallel

    place = RankGroups(ctx, 2).layout  # 2 ranks: 2 CFG groups of one
    x = torch.arange(24, dtype=torch.float32).view(1, 2, 3, 4)
    conds = [[{"scale": float(i + 2)}] for i in range(n_conds)] + [None]
    seen = []
    ex = _Executor(_calc_cond_batch)
    out = cfg_parallel(place)(ex, seen, conds, x, torch.tensor(0.5), {})
    want = _calc_cond_batch([], conds, x, torch.tensor(0.5), {})
    return {"evaluated": seen[0], "max_err": max((a - b).abs().max().item() for a, b in zip(out, want)), "len": len(out)}


def test_cfg_wrapper_evaluates_each_conditioning_once_and_every_rank_gets_all(two_ranks):
    res = [r["cfg"] for r in two_ranks]
    for i, (n_conds, shares) in enumerate(_CONDS.items()):
        assert [r[i]["evaluated"] for r in res] == shares
        for r in res:
            assert r[i]["len"] == n_conds + 1
            assert r[i]["max_err"] == 0.0
