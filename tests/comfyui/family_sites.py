"""Every site of the family table (``nodes/bridge/families.py``) resolves on ComfyUI's own classes.

For each class with a sequence layout or sharding blocks, a small model of ComfyUI's class (the builders of
``dit_ranks.py`` and ``dit_ranks_qwen_hunyuan_ltxv.py``; Wan Fun Camera from its ``comfy.supported_models`` config) is checked against its row: the token, RoPE, gather and text sites name modules; every attention class the
row routes is found in one of its class's variants, every modulation glob here; the heads attribute and the patch size read; the row's hooks find
their modules; every block glob matches a unit; every extra stream and text-whole keyword is a name the class's source
uses, every refused call keyword one it or ComfyUI's base model uses. The rank side then applies the row and takes it off (one rank).

    python tests/comfyui/family_sites.py --comfy /path/to/ComfyUI --ranks 1 --cases flux wan21 vace ... [--out r.json]
"""

from __future__ import annotations

import fnmatch
import inspect
import operator
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_harness import each_case, patcher, random_model, rank_main  # noqa: E402

# name -> (model kind,)
CASES = {k: (k,) for k in ("flux", "chroma", "wan21", "wan21i2v", "wan22", "unet", "qwen", "hunyuan", "ltxv", "vace",
                           "camera", "sd3", "sd35m", "lumina2")}


def _model(kind):
    """The ModelPatcher of a small model of ComfyUI's class ``kind``."""
    if kind in ("qwen", "hunyuan", "ltxv"):
        import dit_ranks_qwen_hunyuan_ltxv

        return dit_ranks_qwen_hunyuan_ltxv._model(kind)[0]
    if kind == "camera":
        import comfy.supported_models as sm

        cfg = {"image_model": "wan2.1", "dim": 192, "ffn_dim": 256, "num_heads": 6, "num_layers": 2,
               "patch_size": (1, 2, 2), "freq_dim": 64, "text_dim": 40, "in_dim": 16, "out_dim": 16,
               "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
        return patcher(random_model(sm.WAN21_Camera(dict(cfg, model_type="camera", in_dim_control_adapter=24, in_dim=36))))
    import dit_ranks

    return dit_ranks._model(kind)[0]


def _fake_seq(dm):
    """What a row's hooks read of the rank's sequence state, on one rank (they install, and do nothing per call)."""
    return SimpleNamespace(dm=dm, ctx=SimpleNamespace(rank=0, world_size=1), scopes=SimpleNamespace(stack=[]),
                           state=SimpleNamespace(require_shards=lambda: None))


def check(dm) -> dict:
    """The row of ``dm``'s class against ``dm``: what did not resolve (``missing``) and what was found."""
    from patchray.distributed import comm
    from patchray.distributed.parallel.shard import find_units
    from patchray.nodes.bridge.families import family_for, sites_of

    name = type(dm).__name__
    row = family_for(name)
    if row is None:
        return {"class": name, "missing": ["no row"]}
    paths = {p: comm.base_class(m).__name__ for p, m in dm.named_modules() if p}
    classes = set(paths.values())
    source = inspect.getsource(sys.modules[type(dm).__module__])
    missing = []
    rec = {"class": name, "family": row.family, "sequence": row.sequence, "blocks": list(row.blocks)}
    if row.sequence:
        for site in sites_of(row):
            if site.module not in paths:
                missing.append(f"site {site.module}")
        # a row's attention classes may differ per variant (Wan t2v / i2v cross-attention): found in one of them
        rec["attends_found"] = sorted(c for c in row.attends if c in classes)
        for glob in row.modulation:
            if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
                missing.append(f"modulation {glob}")
        try:
            rec["heads"] = int(operator.attrgetter(row.heads)(dm))
        except AttributeError:
            missing.append(f"heads {row.heads}")
        patch = row.patch(dm)
        rec["patch"] = list(patch)
        if len(patch) != 3 or not all(isinstance(p, int) and p >= 1 for p in patch):
            missing.append(f"patch {patch}")
        if row.hooks is not None:
            handles = row.hooks(_fake_seq(dm))
            rec["hook_handles"] = len(handles)
            for h in handles:
                h.remove()
    for glob in row.blocks:
        if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
            missing.append(f"block glob {glob}")
    rec["units"] = len(find_units(dm, row.blocks)) if row.blocks else 0
    for key in (*row.streams, *row.text_whole):
        if key not in source:
            missing.append(f"keyword {key}")
    # a refused call keyword may be one the base model passes on (``extra_conds``) that the class only takes as **kwargs
    import comfy.model_base

    passed_on = inspect.getsource(comfy.model_base)
    for key in (*row.call_refusals, *row.grid_conds):
        if key not in source and key not in passed_on:
            missing.append(f"refused keyword {key}")
    rec["missing"] = missing
    return rec


def _applies(ctx, mp) -> bool:
    """The rank side applies the row on one rank and takes every hook and style off again."""
    from patchray.nodes.bridge import dit_rank
    from patchray.nodes.bridge.dit_models import find_row

    dm = mp.model.diffusion_model
    row = find_row(type(dm).__name__)
    if row is None:
        return False
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), m.forward) for n, m in dm.named_modules()}
    seq = dit_rank.sequence_parallel(ctx, row, dm)
    applied = len(seq._applied) + len(seq._handles)
    seq.remove()
    after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), m.forward) for n, m in dm.named_modules()}
    return applied > 0 and before == after


def _rank(ctx, opts):
    results = {}
    for name, (kind,), mp in each_case(ctx, opts, CASES, _model):
        rec = check(mp.model.diffusion_model)
        if rec.get("sequence"):
            rec["applied_and_removed"] = _applies(ctx, mp)
        results[name] = rec
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv, lambda results: {})


if __name__ == "__main__":
    sys.exit(main())
