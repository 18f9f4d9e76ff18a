"""The family tables agree with themselves, with each other and with the classes they name.

ComfyUI's table (``nodes/bridge/families.py``) is checked here for what holds without ComfyUI: one row per class,
the sequence rows and the sharding blocks agree, a class without a sequence layout is refused naming the modes that
work, the lookups (:mod:`dit_models`, :mod:`shard_models`) are read from it, its plans are Styles, and each row with a
diffusers counterpart agrees with the library's row of that class, which is resolved on a tiny build of the class
(every layer glob and block glob names a module). The ComfyUI rows' own sites are resolved on ComfyUI's classes in
the opt-in suite (``tests/comfyui/test_family_sites.py``).
"""

import fnmatch

import pytest

from patchray.distributed.parallel.plan import Style
from patchray.distributed.parallel.seq_styles import GatherTokens, SequenceAttentionStyle, ShardGridRows, ShardTokens
from patchray.distributed.sampling.dit_families import DIT_FAMILIES, SHARD_FAMILIES, UNET_BLOCKS, shard_blocks_for
from patchray.nodes.bridge import dit_models, families, shard_models
from patchray.nodes.bridge.families import FAMILIES, Attends, Text

from ..distributed.dit_models import FAMILIES as TINY, build


def test_every_class_has_one_row_and_every_row_a_mode_or_a_reason():
    classes = [c for row in FAMILIES for c in row.classes]
    assert len(classes) == len(set(classes))
    for row in FAMILIES:
        if row.sequence:
            assert row.patch is not None and row.gather is not None, row.family
            assert not row.refusal, row.family  # a reason to refuse what the row serves would never be shown
        else:
            assert row.refusal and not row.attends and not row.modulation and row.hooks is None, row.family
        assert isinstance(row.text, Text) and all(isinstance(k, Attends) for k in row.attends.values()), row.family
        assert (Attends.JOINT in row.attends.values()) == (row.text is not Text.NONE) or row.hooks is not None, row.family
        assert (row.text_tokens is not None) <= (row.text is not Text.NONE), row.family  # a text site needs joint text
        assert row.entry in ("DIFFUSION_MODEL", "APPLY_MODEL"), row.family  # ComfyUI's wrapper points the rank uses


def test_every_sequence_row_has_sharding_blocks():
    for row in FAMILIES:
        if row.sequence or row.row_bands:
            assert row.blocks, row.family


@pytest.mark.parametrize("cls", sorted(c for r in FAMILIES if not r.sequence and not r.row_bands for c in r.classes))
def test_a_class_without_a_sequence_layout_is_refused_naming_the_modes_that_work(cls):
    row = families.family_for(cls)
    assert dit_models.find_row(cls) is None
    msg = dit_models.refusal(cls)
    assert row.refusal in msg and "parallelism=cfg or batch" in msg
    # a class with blocks only: the refusal names the sharding that works for it, and sharding takes it
    assert ("sharding=blocks" in msg) == bool(row.blocks), msg
    if row.blocks:
        assert shard_models.COMFY_BLOCKS[cls] == row.blocks


def test_the_lookups_are_read_from_the_table():
    assert dit_models.ROWS == tuple(r for r in FAMILIES if r.sequence)
    assert shard_models.COMFY_BLOCKS == {c: r.blocks for r in FAMILIES if r.blocks for c in r.classes}
    assert set(dit_models.KNOWN_UNCOVERED) == {c for r in FAMILIES if not r.sequence for c in r.classes}


def test_a_rows_plan_is_made_of_the_librarys_styles():
    for row in dit_models.ROWS:
        plan = families.sequence_plan(row)
        assert all(isinstance(style, Style) for style in plan.values()), row.family
        assert isinstance(plan[row.gather.module], GatherTokens), row.family
        if row.tokens.where == "output":
            assert plan[row.tokens.module] == ShardTokens(dim=1), row.family
        if row.rope is not None:
            assert plan[row.rope.module] == ShardTokens(dim=2, text=row.text.side), row.family
        assert len(plan) == len({s.module for s in families.sites_of(row) if s.where == "output"}) + len(row.modulation)
    with pytest.raises(ValueError, match="no sequence layout"):
        families.sequence_plan(families.family_for("CameraWanModel"))


# ------------------------------------------------------------------------------------------- the library's table


def test_the_librarys_rows_are_styles_with_blocks_and_shard_rows_follow_them():
    for fam in DIT_FAMILIES.values():
        assert fam.layers and all(isinstance(s, Style) for s in fam.layers.values()), fam.name
        assert any(isinstance(s, GatherTokens) for s in fam.layers.values()), fam.name
        assert any(isinstance(s, (ShardTokens, ShardGridRows)) for s in fam.layers.values()), fam.name
        assert fam.blocks, fam.name
    assert {f.classes[0]: f.blocks for f in SHARD_FAMILIES} == dict(
        {f.cls: f.blocks for f in DIT_FAMILIES.values()}, **{UNET_BLOCKS.classes[0]: UNET_BLOCKS.blocks})


@pytest.mark.parametrize("family", TINY)
def test_every_glob_of_the_librarys_row_names_a_module_of_its_class(family):
    model, _ = build(family)
    fam = DIT_FAMILIES[type(model).__name__]
    paths = [n for n, _ in model.named_modules() if n]
    for glob in (*fam.layers, *fam.blocks):
        assert any(fnmatch.fnmatchcase(p, glob) for p in paths), (family, glob)
    assert shard_blocks_for(model) == fam.blocks


def test_the_unets_blocks_name_its_modules():
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, cross_attention_dim=8,
                                attention_head_dim=2, sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    paths = [n for n, _ in unet.named_modules() if n]
    for glob in shard_blocks_for(unet):
        assert any(fnmatch.fnmatchcase(p, glob) for p in paths), glob


@pytest.mark.parametrize("row", [r for r in FAMILIES if r.counterpart], ids=lambda r: r.family.split(" (")[0])
def test_a_comfyui_row_agrees_with_the_librarys_row_of_its_counterpart(row):
    if row.row_bands:  # the UNet: sharded by blocks on both sides, sequence by row bands (no token table)
        assert row.counterpart in UNET_BLOCKS.classes and row.counterpart not in DIT_FAMILIES
        return
    lib = DIT_FAMILIES[row.counterpart]
    assert row.sequence and lib.blocks and row.blocks
    joint = {s.text for s in lib.layers.values() if isinstance(s, SequenceAttentionStyle)}
    assert joint == {row.text.side}, (row.family, joint, row.text)  # text before / after / none on both sides
    assert (lib.text is not None) == (row.text_tokens is not None), row.family  # both shard the text, or neither
    has_modulation = any(type(s).__name__ == "ShareModulation" for s in lib.layers.values())
    assert has_modulation == bool(row.modulation), row.family


def test_the_benchmark_presets_and_traffic_shapes_name_rows_of_the_table():
    from patchray.distributed.bench.dit_models import PRESETS
    from patchray.distributed.sampling.dit_traffic import FULL_SIZE_SHAPES

    for preset in PRESETS.values():
        assert preset.cls in DIT_FAMILIES and DIT_FAMILIES[preset.cls].blocks, preset.name
        assert preset.shape_key is None or preset.shape_key in FULL_SIZE_SHAPES, preset.name
    assert set(FULL_SIZE_SHAPES) <= {p.shape_key for p in PRESETS.values()}



def test_the_runtime_check_crops_a_rows_grid_conditionings_with_the_latent():
    import torch

    from patchray.nodes.bridge.ksampler_rank import _crop_grid_conds

    row = families.family_for("VaceWanModel")
    assert row.sequence and row.grid_conds == ("vace_frames", "vace_mask")
    frames, mask, ctx = [torch.randn(1, 32, 5, 10, 6)] * 2, [torch.rand(1, 64, 5, 10, 6)], torch.randn(1, 7, 40)
    state = {"original_conds": {"positive": [{"cross_attn": ctx, "vace_frames": frames, "vace_mask": mask}]}, "cfg": 4.0}
    cls, out = _crop_grid_conds((object, state), row.grid_conds, lambda t: t[..., :4, :2])
    cond = out["original_conds"]["positive"][0]
    assert [t.shape[-2:] for t in cond["vace_frames"] + cond["vace_mask"]] == [(4, 2)] * 3
    assert cond["cross_attn"] is ctx and out["cfg"] == 4.0 and cls is object
    assert state["original_conds"]["positive"][0]["vace_frames"] is frames  # the driver's guider is left as it is
    assert _crop_grid_conds((object, state), (), None) == (object, state)  # a row without grid streams: unchanged
