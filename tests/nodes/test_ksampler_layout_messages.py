"""The Distributed KSampler's layout refusals: said once, in the widgets' terms, with a value that works for the
cluster at hand (pure bookkeeping: no ComfyUI, no ranks)."""

import pytest

from patchray.nodes.bridge.dit_layout import plan_layout
from patchray.nodes.bridge.dit_models import refusal

PREFIX = "PatchRay: "
NO_ROW = refusal("OpenAISignatureMMDITWrapper", "comfy.ldm.modules.diffusionmodules.mmdit", family="SD3")


def _refused(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as exc:
        plan_layout(*args, **kwargs)
    text = str(exc.value)
    assert text.startswith(PREFIX) and text.count(PREFIX) == 1, text
    return text


def test_an_uncovered_model_is_named_by_family_and_class():
    assert "SD3's diffusion model OpenAISignatureMMDITWrapper (comfy.ldm.modules.diffusionmodules.mmdit)" in NO_ROW
    assert "parallelism=cfg or batch" in NO_ROW
    # without a family (or one equal to the class) the class alone is named
    assert "the diffusion model Foo (m)" in refusal("Foo", "m") and "the diffusion model Foo (m)" in refusal("Foo", "m", family="Foo")


@pytest.mark.parametrize("cfg, fix", [(4.0, "set num_ranks to 2"), (1.0, "raise batch_size to 3")])
def test_auto_without_any_split_says_why_and_what_works(cfg, fix):
    text = _refused("auto", 3, cfg, 1, sequence_refusal=NO_ROW)
    assert "OpenAISignatureMMDITWrapper" in text and "batch of 1 is smaller than the 3 ranks" in text and fix in text
    if cfg == 1.0:
        assert "cfg = 1 leaves no CFG split" in text and "num_ranks to 2" not in text


def test_cfg_on_an_odd_cluster_suggests_what_fits_it():
    text = _refused("cfg", 3, 5.0, 1)
    assert "set num_ranks to 2" in text and "cfg+sequence" not in text  # cfg+sequence needs an even count from 4
    assert "pick cfg+sequence" in _refused("cfg", 4, 5.0, 1)


def test_cfg_sequence_on_two_ranks_points_at_cfg():
    assert "pick parallelism cfg (2 ranks)" in _refused("cfg+sequence", 2, 5.0, 1)
    assert "pick parallelism sequence" in _refused("cfg+sequence", 3, 5.0, 1)


def test_sequence_refusal_is_prefixed_once():
    assert "SD3's diffusion model" in _refused("sequence", 2, 5.0, 1, sequence_refusal=NO_ROW)


def test_the_node_description_names_every_family_of_the_dit_table():
    from patchray.nodes.bridge.dit_models import ROWS
    from patchray.nodes.ksampler import PatchRayKSampler

    schema = PatchRayKSampler.define_schema()
    for row in ROWS:
        assert row.family.split(" (")[0] in schema.description, row.family
    cluster = next(i for i in schema.inputs if i.id == "cluster")
    assert "parallelism" in cluster.tooltip and "rows are split" not in cluster.tooltip  # cfg and batch split no rows


def test_the_node_summary_says_how_the_ranks_shared_the_work():
    from patchray.nodes.bridge.parallel_model import layout_summary

    assert layout_summary(plan_layout("cfg", 2, 5.0, 1), 6) == "parallelism cfg on 2 rank(s): cond and uncond on different ranks; 6 model calls"
    lay = plan_layout("cfg", 2, 1.0, 1)  # cfg = 1: sequence instead, and the layout says why
    assert layout_summary(lay, 3).startswith("parallelism sequence on 2 rank(s): each of the 2 ranks a band")
    assert "cfg = 1" in lay.note


def test_the_node_summary_names_the_sequence_attention_that_ran():
    """The user picks sequence_attention (auto, or a mode); the node says which mode the attention calls ran, and
    why where a call ran another mode than the one picked (a mask or a stale preset's K/V: gathered) or none ran."""
    from patchray.nodes.bridge.parallel_model import attention_note, layout_summary

    seq = plan_layout("sequence", 3, 5.0, 1)
    assert layout_summary(seq, 4, {"ring": 8}) == (
        "parallelism sequence on 3 rank(s): each of the 3 ranks a band of the latent's rows; 4 model calls; "
        "sequence attention ring (8 attention calls)")
    assert layout_summary(seq, 4, {"ring": 2, "gathered": 6}).endswith("; sequence attention gathered (6 attention calls), ring (2 attention calls)")
    assert layout_summary(seq, 4, {}) == layout_summary(seq, 4) == layout_summary(seq, 4, None)
    assert attention_note("ring", "dit", seq, {"ring": 8}) is None
    assert attention_note("auto", "dit", seq, {"gathered": 8}) is None  # auto: the summary names what it chose
    note = attention_note("overlapped", "dit", seq, {"gathered": 2, "overlapped": 6})
    assert "sequence_attention=overlapped ran gathered in 2 of 8 attention calls" in note and "mask" in note, note
    # nothing to split by tokens: the widget had no effect, and the node says so
    for layout, kind in ((plan_layout("batch", 2, 5.0, 2), "dit"), (plan_layout("cfg", 2, 5.0, 1), "dit"),
                         (seq, "unet")):
        note = attention_note("ring", kind, layout, {})
        assert note is not None and "sequence_attention=ring was not used" in note, (layout, kind, note)
    assert attention_note("auto", "dit", plan_layout("batch", 2, 5.0, 2), {}) is None
    # where the split could use it, the note says how; a model without a sequence split is not sent there
    assert "parallelism sequence or cfg+sequence uses it" in attention_note("ring", "dit", plan_layout("cfg", 2, 5.0, 1), {})
    note = attention_note("ring", "dit", plan_layout("cfg", 2, 5.0, 1, sequence_refusal=NO_ROW), {}, sequence_ok=False)
    assert "without a sequence split" in note and "uses it" not in note, note


def test_area_conditioning_under_unet_row_bands_points_at_the_splits_that_run_it():
    import torch

    from patchray.nodes.bridge.model import check_conditioning

    cond = [[torch.zeros(1, 77, 8), {"area": (8, 8, 0, 0), "strength": 1.0}]]
    with pytest.raises(NotImplementedError) as exc:
        check_conditioning("positive", cond, "sequence")
    text = str(exc.value)
    assert "area conditioning" in text and "positive" in text and "parallelism=cfg or batch run it whole" in text
    check_conditioning("positive", cond, "cfg")  # cfg and batch evaluate the whole latent: area conditioning runs
    check_conditioning("positive", cond, "batch")
    # a DiT's sequence split cuts each call's own (cropped) tokens: area and mask run under sequence too
    check_conditioning("positive", cond, "sequence", "dit")
    check_conditioning("positive", [[torch.zeros(1, 77, 8), {"mask": torch.ones(1, 8, 8)}]], "cfg+sequence", "dit")
    with pytest.raises(NotImplementedError, match="ControlNet conditioning"):  # whatever the model kind
        check_conditioning("positive", [[torch.zeros(1, 77, 8), {"control": object()}]], "sequence", "dit")
    with pytest.raises(NotImplementedError, match="ControlNet conditioning"):  # refused under every parallelism
        check_conditioning("positive", [[torch.zeros(1, 77, 8), {"control": object()}]], "cfg")


def test_the_rows_of_an_area_crop_follow_comfyuis_three_area_forms():
    import torch

    from patchray.nodes.bridge.model import area_rows

    shape = (1, 16, 64, 48)  # latent rows 64
    assert area_rows({}, shape) is None
    assert area_rows({"area": (24, 16, 8, 4)}, shape) == 24  # (h, w, y, x) in latent units
    assert area_rows({"area": (24, 16, 50, 4)}, shape) == 14  # clipped at the latent's bottom edge (64 - 50)
    assert area_rows({"area": ("percentage", 0.25, 0.5, 0.0, 0.0)}, shape) == 16  # a quarter of 64 rows
    mask = torch.zeros(1, 512, 384)
    mask[:, 128:256] = 1.0  # pixel rows 128..255: latent rows 16..31 once resized to 64 rows
    assert area_rows({"mask": mask, "set_area_to_bounds": True}, shape) in (16, 17, 18)  # bilinear edges
    assert area_rows({"mask": mask}, shape) is None  # a mask without bounds weights the whole latent
