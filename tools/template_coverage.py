#!/usr/bin/env python3
"""Which of ComfyUI's own templates run with PatchRay Parallel Model + Parallel VAE inserted, in which modes, and if
not, why: writes docs/template-coverage.md.

How the table is obtained: ``template_facts.py`` reads every template of the ``comfyui-workflow-templates`` package
(the nodes of each graph and subgraph, active or bypassed, the loaders' file names); this script maps each template's
model (from its file names, and from the Wan*ToVideo node that selects a Wan variant's class) to the diffusion-model
class ComfyUI builds for it, and applies the rules PatchRay's own tables and checks implement:

* sequence parallelism: the classes with a row in PatchRay's DiT table (read from ``nodes/bridge/dit_models.py``)
  and ComfyUI's plain ``UNetModel``; refused where a conditioning the row cannot split is present (the rows'
  ``cond_refusals``: reference latents; area and mask conditions on a UNet (a DiT's split follows each call's crop);
  model patches that see one rank's tokens);
* CFG parallelism: every model, when the template's guidance evaluates more than one conditioning per step (cfg != 1,
  or a multi-conditioning guider); batch parallelism: every model, when the latent batch is at least the rank count;
* refused in every mode: ControlNet and GLIGEN conditioning, latents that are neither images nor videos (3-D models,
  audio).

The rules are static: they read the templates' nodes, not a run. The families marked "run" in the table's notes were
sampled in the opt-in real-ComfyUI suite (random-weight models of the same classes, tests/comfyui).

Usage::

    python tools/template_coverage.py [--facts FACTS.json] [--out docs/template-coverage.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: template family (template_facts.FAMILY_TABLE) -> ComfyUI's diffusion-model class, VAE, latent kind
FAMILY_CLASS = {
    "SD1.5": ("UNetModel", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "SD2.x": ("UNetModel", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "SDXL": ("UNetModel", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "Lotus depth": ("UNetModel", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "Stable Zero123": ("UNetModel", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "SVD": ("VideoUNet", "SD 1.x / 2.x / SDXL (kl)", "image"),
    "FLUX.1": ("Flux", "FLUX.1 (kl, 16 channels)", "image"),
    "FLUX.1 Kontext": ("Flux", "FLUX.1 (kl, 16 channels)", "image"),
    "Chroma": ("Chroma", "FLUX.1 (kl, 16 channels)", "image"),
    "SD3.5": ("OpenAISignatureMMDITWrapper", "SD3 (kl, 16 channels)", "image"),
    "HiDream": ("HiDreamImageTransformer2DModel", "FLUX.1 (kl, 16 channels)", "image"),
    "OmniGen2": ("OmniGen2Transformer2DModel", "FLUX.1 (kl, 16 channels)", "image"),
    "Lumina 2": ("NextDiT", "FLUX.1 (kl, 16 channels)", "image"),
    "Qwen-Image": ("QwenImageTransformer2DModel", "Qwen-Image", "image"),
    "Wan 2.1 14B": ("WanModel", "Wan 2.1", "video"),
    "Wan 2.1 1.3B": ("WanModel", "Wan 2.1", "video"),
    "Wan 2.2 14B": ("WanModel", "Wan 2.1", "video"),
    "Wan 2.2 5B": ("WanModel", "Wan 2.2", "video"),
    "HuMo (Wan 2.1-based)": ("HumoWanModel", "Wan 2.1", "video"),
    "HunyuanVideo": ("HunyuanVideo", "HunyuanVideo", "video"),
    "LTX-Video": ("LTXVModel", "LTX-Video", "video"),
    "Mochi": ("AsymmDiT", "Mochi", "video"),
    "Hunyuan3D 2.x": ("HunYuan3Dv2", None, "3d"),
    "ACE-Step": ("ACEStepTransformer", None, "audio4d"),  # [B, 8, 16, L]: a 4-D latent, CFG and batch apply
    "Stable Audio": ("AudioDiffusionTransformer", None, "audio"),
}

#: a Wan*ToVideo node picks the Wan variant's class (the checkpoint of that variant loads as it)
WAN_NODE_CLASS = {
    "WanVaceToVideo": "VaceWanModel",
    "WanSoundImageToVideo": "WanModel_S2V",
    "WanSoundImageToVideoExtend": "WanModel_S2V",
    "WanAnimateToVideo": "AnimateWanModel",
    "WanCameraImageToVideo": "CameraWanModel",
    "WanHuMoImageToVideo": "HumoWanModel",
}

#: families whose class was sampled in the opt-in real-ComfyUI suite against the stock nodes
RUN_IN_SUITE = {"UNetModel", "Flux", "Chroma", "QwenImageTransformer2DModel", "WanModel", "HunyuanVideo", "LTXVModel",
                "VaceWanModel", "OpenAISignatureMMDITWrapper", "NextDiT"}


def covered_classes() -> set:
    """The diffusion-model classes with a row in PatchRay's DiT table, plus ComfyUI's plain UNetModel."""
    sys.path.insert(0, str(ROOT.parent))
    try:
        from importlib import import_module

        rows = import_module(f"{ROOT.name}.nodes.bridge.dit_models").ROWS
    except Exception:  # the checkout imported as "patchray" (an installed pack)
        from patchray.nodes.bridge.dit_models import ROWS as rows
    classes = {"UNetModel"}
    for row in rows:
        classes.update(row.classes)
    return classes


def classify(t: dict, seq_classes: set) -> dict:
    """One template's verdict: model class, runs or not, modes at two ranks, VAE decode, reasons."""
    fam = next((f for f in t["families"] if f in FAMILY_CLASS), t["families"][0] if t["families"] else "unknown")
    cls, vae, kind = FAMILY_CLASS.get(fam, ("?", None, "image"))
    patches = t.get("patch_nodes_active", {})
    for node in patches.get("wan_to_video", []):
        cls = WAN_NODE_CLASS.get(node, cls)
    if any("radiance" in (m.get("file") or "").lower() for m in t.get("model_loaders", [])):
        cls, vae = "ChromaRadiance", None  # pixel space: no VAE
    notes, why_not = [], []
    if kind in ("3d", "audio"):
        why_not.append(f"{'3-D' if kind == '3d' else 'audio'} latents (PatchRay samples image, video and 4-D audio latents)")
    if "cache" in patches:
        why_not.append(f"{', '.join(patches['cache'])} (its wrappers live on ComfyUI's process; refused by name)")
    if "controlnet" in patches:
        why_not.append("ControlNet conditioning (refused in every mode)")
    if "gligen" in patches:
        why_not.append("GLIGEN conditioning (refused in every mode)")
    seq = cls in seq_classes
    seq_why = None if seq else f"{cls} has no sequence split"
    if seq and "reference_latent" in patches or seq and "flux_kontext_local" in patches:
        seq, seq_why = False, "reference latent tokens are not split yet"
    if seq and "area_mask" in patches and cls == "UNetModel":  # a DiT's split follows each call's crop
        seq, seq_why = False, "area / mask conditions crop the latent, which the UNet's row bands cannot follow"
    if seq and "model_patch" in patches:
        seq, seq_why = False, "a model patch (ModelPatchLoader) would see one rank's tokens"
    if seq and "SkipLayerGuidanceDiT" in patches.get("cfg_tweak", []):
        seq, seq_why = False, "SkipLayerGuidanceDiT's block patches would see one rank's tokens"
    if seq and patches.get("inpaint_conditioning") and cls not in ("UNetModel", "Flux"):  # FLUX.1 Fill: in the suite
        notes.append("inpaint concat latent under sequence: not run in the suite")
    settings = [s.get("settings", {}) for s in t.get("samplers", []) if s.get("active")]
    guiders = {g.get("type") for g in t.get("guiders", [])} if isinstance(t.get("guiders"), list) else set()
    multi = "DualCFGGuider" in guiders or "CFGGuider" in guiders or any(
        float(s.get("cfg", 1) or 1) != 1.0 for s in settings) or any(
        s.get("type") == "SamplerCustom" for s in t.get("samplers", []))
    if guiders and guiders <= {"BasicGuider"}:
        multi = False
    modes = []
    if not why_not:
        if seq:
            modes.append("sequence")
        if multi:
            modes.append("cfg")
        modes.append("batch (batch >= ranks)")
        if not seq:
            notes.append(seq_why)
        if cls in RUN_IN_SUITE and seq:
            notes.append("run in the suite")
    if vae:
        decode = vae
    elif cls == "ChromaRadiance":
        decode = "none (pixel space)"
    elif kind in ("3d", "audio", "audio4d"):
        decode = "stock decode (not an image VAE)"
    else:
        decode = "stock decode (not sharded)"
    return {"name": t["name"], "family": fam, "class": cls, "samplers": sorted(set(t.get("active_sampler_types", []))),
            "runs": not why_not, "modes": modes, "vae": decode, "why_not": why_not, "notes": [n for n in notes if n]}


def render(rows: list, facts: dict) -> str:
    runs = sum(r["runs"] for r in rows)
    seq = sum("sequence" in r["modes"] for r in rows)
    cfg_only = sum(r["runs"] and "sequence" not in r["modes"] for r in rows)
    why = Counter(w.split(" (")[0] for r in rows for w in r["why_not"])
    lines = [
        "# ComfyUI's templates with PatchRay",
        "",
        f"Every template of ComfyUI's template library (`comfyui-workflow-templates` {facts.get('package_version', '?')}, "
        "the version ComfyUI 0.3.64 pins) that has a sampler node, and what happens when **PatchRay Parallel Model** is "
        "put in front of its sampler(s) and **PatchRay Parallel VAE** in front of its VAE Decode, on 2 ranks.",
        "",
        f"- {len(rows)} templates sample locally; **{runs} run** with the two nodes, **{seq} of them with sequence "
        f"parallelism** (the split that makes one image or video faster), {cfg_only} with CFG or batch parallelism only.",
        "- Refused: " + ", ".join(f"{k} ({v})" for k, v in why.most_common()) + ".",
        "- modes: what `parallelism` can be at 2 ranks (`auto` picks among them). cfg needs a guidance that evaluates more "
        "than one conditioning per step (cfg != 1); batch needs a latent batch of at least the rank count.",
        "- VAE: the layout PatchRay shards the template's VAE with (row mode, exact), or the stock decode it falls back to.",
        "",
        "How this table is made: `python tools/template_facts.py --out facts.json && python tools/template_coverage.py "
        "--facts facts.json` reads every template's nodes and file names and applies the rules PatchRay's own tables "
        "implement (the module docstring of `tools/template_coverage.py` lists them). It is a static reading, not a run "
        "of each template: \"run in the suite\" marks the model classes sampled with the two nodes against the stock nodes "
        "in the opt-in real-ComfyUI tests (`tests/comfyui/`).",
        "",
        "| template | model (class) | sampler | runs | modes at 2 ranks | VAE decode | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['family']} ({r['class']}) | {', '.join(r['samplers'])} | "
            f"{'yes' if r['runs'] else 'no'} | {', '.join(r['modes']) or '-'} | {r['vae']} | "
            f"{'; '.join(r['why_not'] + r['notes'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--facts", help="template_facts.py's JSON (default: run it on the installed templates)")
    p.add_argument("--out", default=str(ROOT / "docs" / "template-coverage.md"))
    args = p.parse_args(argv)
    if args.facts:
        facts = json.loads(Path(args.facts).read_text())
    else:
        import tempfile

        sys.path.insert(0, str(Path(__file__).parent))
        import template_facts

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "facts.json"
            template_facts.main(["--out", str(out), "--quiet", "--index-only"])
            facts = json.loads(out.read_text())
    seq_classes = covered_classes()
    templates = [t for t in facts["templates"] if t.get("in_index", True) and t.get("active_sampler_types")]
    rows = sorted((classify(t, seq_classes) for t in templates), key=lambda r: (r["family"], r["name"]))
    Path(args.out).write_text(render(rows, facts))
    print(f"{len(rows)} templates -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
