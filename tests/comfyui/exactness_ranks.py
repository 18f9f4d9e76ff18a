"""The runtime exactness check on ComfyUI's own DiT classes, on N spawned gloo ranks: the table's row passes, a row
with its text block on the wrong side of the image tokens (the silent drift a newer ComfyUI's HunyuanVideo made) is
caught and refused; Wan VACE's row without its hint-stream hook never passes; every rank reaches the same verdict.

Runs ``ksampler_rank.verify_sequence`` (what a rank runs on the first use of a model class under sequence parallelism)
with the run inputs the Parallel Model's driver sends (``rank_harness.rank_run_inputs``), on the small random-weight
models of ``dit_ranks.py`` and ``dit_ranks_qwen_hunyuan_ltxv.py``.

    python tests/comfyui/exactness_ranks.py --comfy /path/to/ComfyUI --ranks 2 --cases flux wan21 ... [--out r.json]
"""

from __future__ import annotations

import sys

import torch

from rank_harness import each_case, rank_main, rank_run_inputs

#: name -> (model kind, which script builds it)
CASES = {"flux": ("flux", "dit_ranks"), "chroma": ("chroma", "dit_ranks"), "wan21": ("wan21", "dit_ranks"),
         "wan21i2v": ("wan21i2v", "dit_ranks"), "qwen": ("qwen", "dit_ranks_qwen_hunyuan_ltxv"), "hunyuan": ("hunyuan", "dit_ranks_qwen_hunyuan_ltxv"),
         "hyimage": ("hyimage", "dit_ranks_qwen_hunyuan_ltxv"), "ltxv": ("ltxv", "dit_ranks_qwen_hunyuan_ltxv"), "vace": ("vace", "dit_ranks"),
         "sd3": ("sd3", "dit_ranks"), "sd35m": ("sd35m", "dit_ranks"), "lumina2": ("lumina2", "dit_ranks")}
#: the same models with bf16 weights (what a GPU user loads): the check must still compute in fp32 and catch the row
BF16 = {"flux_bf16": "flux", "hunyuan_bf16": "hunyuan"}
CASES.update({name: (name, CASES[kind][1]) for name, kind in BF16.items()})


def _build(kind):
    if kind in BF16:
        mp, make_inputs = _build(BF16[kind])
        return _to_bf16(mp), make_inputs
    import dit_ranks
    import dit_ranks_qwen_hunyuan_ltxv

    script = dict(CASES)[next(k for k, v in CASES.items() if v[0] == kind)][1]
    if script == "dit_ranks":
        mp, cond, shape = dit_ranks._model(kind)
        return mp, (lambda g: (dit_ranks._inputs(kind, cond, shape, "euler", 1, "sequence", "gathered", 4.0)))
    mp, cond, shape, mask = dit_ranks_qwen_hunyuan_ltxv._model(kind)
    return mp, (lambda g: dit_ranks_qwen_hunyuan_ltxv._inputs(kind, cond, shape, mask, "euler", 1, "sequence", "gathered", 4.0))


def _to_bf16(mp):
    """``mp`` with its diffusion model's weights in bf16, as ComfyUI loads a bf16 checkpoint (``get_dtype`` follows)."""
    dm = mp.model.diffusion_model
    dm.to(torch.bfloat16)
    dm.dtype = torch.bfloat16
    return mp


def _flipped(row):
    """The row with its text on the other side of the image tokens (``None`` for rows without joint text)."""
    from patchray.nodes.bridge import dit_models

    other = {dit_models.PREFIX: dit_models.SUFFIX, dit_models.SUFFIX: dit_models.PREFIX}.get(row.text)
    return None if other is None else row._replace(text=other)


def _rank(ctx, opts):
    from patchray.distributed.sampling.exactness import ExactnessMismatch
    from patchray.nodes.bridge import ksampler_rank as kr
    from patchray.nodes.bridge.dit_layout import plan_layout
    from patchray.nodes.bridge.dit_models import find_row

    results = {}
    for name, (kind, _), (mp, make_inputs) in each_case(ctx, opts, {k: (v[0], v[1]) for k, v in CASES.items()}, _build):
        inputs = make_inputs(None)
        dm = mp.model.diffusion_model
        row = find_row(type(dm).__name__)
        layout = plan_layout("sequence", ctx.world_size, inputs["cfg"], 1, sequence_refusal=None)
        run = rank_run_inputs(mp, inputs, layout, "dit", "gathered")
        model = mp.clone()
        rec = {"class": type(dm).__name__, "weights": str(next(dm.parameters()).dtype).replace("torch.", "")}
        rec["correct"] = kr.verify_sequence(ctx, ctx, model, row, dm, run)
        wrong = _flipped(row)
        if wrong is not None:
            try:
                kr.verify_sequence(ctx, ctx, model, wrong, dm, run)
                rec["flipped"] = "passed"
            except ExactnessMismatch as exc:
                rec["flipped"] = str(exc)
            except Exception as exc:  # refused loudly by the split itself (e.g. a text mask over image keys)
                rec["flipped"] = f"error: {type(exc).__name__}: {exc}"
        if row.hooks is not None and kind == "vace":  # the row without its hint-stream hook: never a silent pass
            try:
                kr.verify_sequence(ctx, ctx, model, row._replace(hooks=None), dm, run)
                rec["unhooked"] = "passed"
            except ExactnessMismatch as exc:
                rec["unhooked"] = str(exc)
            except Exception as exc:  # refused loudly by the model itself (a whole stream added to a band)
                rec["unhooked"] = f"error: {type(exc).__name__}: {exc}"
        results[name] = rec
    return results


def main(argv=None):
    return rank_main(_rank, __doc__, CASES, argv, lambda results: {"per_rank": results})


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
