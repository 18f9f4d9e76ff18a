"""Opt-in: PatchRay Parallel Model in a real ComfyUI server: ComfyUI's own sampler nodes on the patched MODEL equal the
same nodes on the unpatched MODEL, in one prompt.

Covered: the stock KSampler (a UNet with a LoRA, an object patch and a CFG function; DiTs with a LoRA and a
ModelSampling shift) for every parallelism and sharding setting; SamplerCustomAdvanced with CFGGuider, BasicGuider and
DualCFGGuider (KSamplerSelect, BasicScheduler, RandomNoise), its denoised output included; SamplerCustom; a two-expert
KSampler (Advanced) chain; a model patch applied after the Parallel Model node; and what the node refuses before any
rank starts. Models and the server as in ``test_comfyui_server.py`` (random weights its stock loaders detect).

    COMFYUI_DIR=/path/to/ComfyUI [COMFYUI_PYTHON=/path/to/its/python] pytest tests/comfyui/test_parallel_model_server.py
"""

import pytest

from .test_comfyui_server import COMFYUI_DIR, _DIT, _available_gib, _latent, _post, _run, server  # noqa: F401

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to run the real-server test"),
]

WAN = "wan2.1_t2v_1.3B_fp16.safetensors"
FLUX = "flux1-dev.safetensors"


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _dit_graph(model_file, ranks, batch=1, *, parallelism="auto", sharding="none", attention="auto", preset="full_sync"):
    """Loader -> LoRA -> ModelSampling (the MODEL "2"), test conditionings "3"/"4", latent "5", cluster "7", and
    PatchRay Parallel Model "20" on MODEL "2"."""
    weight_dtype, sampling, latent, pooled = _DIT[model_file]
    latent = {"class_type": latent["class_type"], "inputs": dict(latent["inputs"], batch_size=batch)}
    lora = "patchray_test_" + model_file.split("_")[0].split("-")[0].replace(".", "") + "_lora.safetensors"
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": weight_dtype}},
        "12": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "strength_model": 1.0, "lora_name": lora}},
        "2": {"class_type": sampling["class_type"], "inputs": dict(sampling["inputs"], model=["12", 0])},
        "3": {"class_type": "PatchRayTestConditioning", "inputs": {"seed": 1, "tokens": 9, "width": 4096, "pooled": pooled}},
        "4": {"class_type": "PatchRayTestConditioning", "inputs": {"seed": 2, "tokens": 6, "width": 4096, "pooled": pooled}},
        "5": latent,
        "7": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": ranks, "device": "cpu", "address": "", "gpu_ids": ""}},
        "20": {"class_type": "PatchRayParallelModel", "inputs": {
            "model": ["2", 0], "cluster": ["7", 0], "preset": preset, "warmup_steps": -1, "refresh_every": -1,
            "k_ratio": 0.25, "block_size": 8, "parallelism": parallelism, "sequence_attention": attention,
            "balance": "equal", "sharding": sharding}},
    }


def _ksampler_pair(api, steps, cfg=3.5, sampler="euler"):
    """The stock KSampler on MODEL "2" (node "6", saved by "9") and on the patched MODEL "20" (node "8", saved by "10")."""
    common = {"seed": 5, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": "simple", "positive": ["3", 0],
              "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}
    api["6"] = {"class_type": "KSampler", "inputs": dict(common, model=["2", 0])}
    api["8"] = {"class_type": "KSampler", "inputs": dict(common, model=["20", 0])}
    api["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "stock"}}
    api["10"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "parallel"}}
    return api


def _custom_advanced(api, model, tag, guider, steps, sampler="euler"):
    """SamplerCustomAdvanced on ``model`` with ``guider`` ("cfg", "basic", "dual"); saves output and denoised output."""
    p = f"{tag}_"
    if guider == "cfg":
        g = {"class_type": "CFGGuider", "inputs": {"model": model, "positive": ["3", 0], "negative": ["4", 0], "cfg": 3.5}}
    elif guider == "basic":
        g = {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["3", 0]}}
    else:
        g = {"class_type": "DualCFGGuider", "inputs": {"model": model, "cond1": ["3", 0], "cond2": ["40", 0],
                                                      "negative": ["4", 0], "cfg_conds": 3.0, "cfg_cond2_negative": 1.5,
                                                      "style": "regular"}}
    api.update({
        p + "g": g,
        p + "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 17}},
        p + "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}},
        p + "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": "simple", "steps": steps, "denoise": 1.0}},
        p + "run": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": [p + "noise", 0], "guider": [p + "g", 0], "sampler": [p + "sampler", 0], "sigmas": [p + "sigmas", 0],
            "latent_image": ["5", 0]}},
        p + "out": {"class_type": "SaveLatent", "inputs": {"samples": [p + "run", 0], "filename_prefix": p + "out"}},
        p + "x0": {"class_type": "SaveLatent", "inputs": {"samples": [p + "run", 1], "filename_prefix": p + "x0"}},
    })
    if guider == "dual":
        api["40"] = {"class_type": "PatchRayTestConditioning", "inputs": {"seed": 3, "tokens": 7, "width": 4096,
                                                                          "pooled": api["3"]["inputs"]["pooled"]}}
    return api


# fp32 compute on CPU ranks: the splits reorder sums only (attention over gathered keys in rank-major order, GEMMs
# over fewer rows, a CFG or batch share computed on another rank); 1e-5 relative L2 is the bound the stock-equality
# tests use; a wrong band, RoPE slice or CFG share gives > 1e-2.
BOUND = 1e-5


@pytest.mark.parametrize("model_file, parallelism, ranks, batch, sharding", [
    (WAN, "sequence", 2, 1, "none"),
    (WAN, "cfg", 2, 1, "none"),
    (WAN, "batch", 2, 2, "none"),
    (WAN, "sequence", 2, 1, "blocks"),
    (WAN, "sequence", 3, 1, "none"),
    (WAN, "cfg+sequence", 4, 1, "none"),
    (FLUX, "sequence", 2, 1, "none"),
    (FLUX, "cfg", 2, 1, "blocks"),
])
def test_the_stock_ksampler_on_the_parallel_model_equals_it_on_the_model(server, model_file, parallelism, ranks, batch,
                                                                        sharding):
    url, base = server
    if model_file == FLUX and _available_gib() < 8:
        pytest.skip("the full-width FLUX case needs about 8 GiB of free memory")
    api = _ksampler_pair(_dit_graph(model_file, ranks, batch, parallelism=parallelism, sharding=sharding), steps=3)
    entry = _run(url, api)
    stock, ours = _latent(base, entry, "9"), _latent(base, entry, "10")
    assert stock.shape == ours.shape and stock.shape[0] == batch
    rel = _rel(ours, stock)
    print(f"{model_file} {parallelism} x{ranks} sharding={sharding}: KSampler on the Parallel Model vs stock {rel:.2e}")
    assert rel <= BOUND, rel


@pytest.mark.parametrize("guider, parallelism, ranks", [
    ("cfg", "sequence", 2), ("cfg", "cfg", 2), ("basic", "sequence", 2), ("dual", "cfg", 2), ("dual", "sequence", 3),
])
def test_sampler_custom_advanced_with_each_guider_equals_the_stock_run(server, guider, parallelism, ranks):
    url, base = server
    api = _dit_graph(WAN, ranks, parallelism=parallelism)
    _custom_advanced(api, ["2", 0], "stock", guider, steps=3)
    _custom_advanced(api, ["20", 0], "ours", guider, steps=3)
    entry = _run(url, api)
    for what in ("out", "x0"):  # the sampled latent and the last denoised estimate (the node's second output)
        stock, ours = _latent(base, entry, f"stock_{what}"), _latent(base, entry, f"ours_{what}")
        rel = _rel(ours, stock)
        print(f"SamplerCustomAdvanced {guider} {parallelism} x{ranks} {what}: {rel:.2e}")
        assert stock.shape == ours.shape and rel <= BOUND, (what, rel)


def test_sampler_custom_and_a_basic_guider_on_flux(server):
    url, base = server
    if _available_gib() < 8:
        pytest.skip("the full-width FLUX case needs about 8 GiB of free memory")
    api = _dit_graph(FLUX, 2, parallelism="sequence")
    _custom_advanced(api, ["2", 0], "stock", "basic", steps=2)
    _custom_advanced(api, ["20", 0], "ours", "basic", steps=2)
    for tag, model in (("scstock", ["2", 0]), ("scours", ["20", 0])):
        api[tag] = {"class_type": "SamplerCustom", "inputs": {
            "model": model, "add_noise": True, "noise_seed": 23, "cfg": 2.5, "positive": ["3", 0], "negative": ["4", 0],
            "sampler": ["stock_sampler", 0], "sigmas": ["stock_sigmas", 0], "latent_image": ["5", 0]}}
        api[tag + "_save"] = {"class_type": "SaveLatent", "inputs": {"samples": [tag, 0], "filename_prefix": tag}}
    entry = _run(url, api)
    assert _rel(_latent(base, entry, "ours_out"), _latent(base, entry, "stock_out")) <= BOUND
    assert _rel(_latent(base, entry, "scours_save"), _latent(base, entry, "scstock_save")) <= BOUND


def test_a_two_expert_advanced_chain_and_a_patch_after_the_node(server):
    """Wan 2.2 14B's schedule shape: expert one adds noise and runs steps 0-2 of 4 with leftover noise, expert two runs
    2-4; each expert a Parallel Model (the second after a ModelSampling patch applied to the patched MODEL)."""
    url, base = server
    api = _dit_graph(WAN, 2, parallelism="sequence")
    api["21"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": ["20", 0], "shift": 3.0}}  # after the node
    api["22"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 3.0}}
    common = {"noise_seed": 9, "steps": 4, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["3", 0], "negative": ["4", 0]}
    for tag, first, second in (("s", ["2", 0], ["22", 0]), ("p", ["20", 0], ["21", 0])):
        api[tag + "1"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
            common, model=first, add_noise="enable", latent_image=["5", 0], start_at_step=0, end_at_step=2,
            return_with_leftover_noise="enable")}
        api[tag + "2"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
            common, model=second, add_noise="disable", latent_image=[tag + "1", 0], start_at_step=2, end_at_step=10000,
            return_with_leftover_noise="disable")}
        api[tag + "save"] = {"class_type": "SaveLatent", "inputs": {"samples": [tag + "2", 0], "filename_prefix": tag}}
    entry = _run(url, api)
    rel = _rel(_latent(base, entry, "psave"), _latent(base, entry, "ssave"))
    print(f"two-expert chain: {rel:.2e}")
    assert rel <= BOUND, rel


def test_a_unet_with_patches_through_the_parallel_model_equals_the_stock_ksampler(server):
    """SDXL's UNet with a LoRA, an object patch and a CFG function (RescaleCFG), row bands on 2 ranks."""
    url, base = server
    common = {"seed": 11, "steps": 3, "cfg": 5.0, "sampler_name": "dpmpp_2m", "scheduler": "karras", "positive": ["4", 0],
              "negative": ["5", 0], "latent_image": ["6", 0], "denoise": 1.0}
    api = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd_xl_base_1.0.safetensors"}},
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "patchray_test_lora.safetensors", "strength_model": 1.0}},
        "3": {"class_type": "ModelSamplingDiscrete", "inputs": {"model": ["2", 0], "sampling": "v_prediction", "zsnr": False}},
        "9": {"class_type": "RescaleCFG", "inputs": {"model": ["3", 0], "multiplier": 0.7}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red boat", "clip": ["1", 1]}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "6": {"class_type": "EmptyLatentImage", "inputs": {"width": 96, "height": 152, "batch_size": 1}},
        "8": {"class_type": "PatchRayCluster", "inputs": {"num_ranks": 2, "device": "cpu", "address": "", "gpu_ids": ""}},
        "20": {"class_type": "PatchRayParallelModel", "inputs": {
            "model": ["9", 0], "cluster": ["8", 0], "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1,
            "k_ratio": 0.25, "block_size": 8, "parallelism": "sequence", "sequence_attention": "auto",
            "balance": "equal", "sharding": "none"}},
        "7": {"class_type": "KSampler", "inputs": dict(common, model=["9", 0])},
        "10": {"class_type": "KSampler", "inputs": dict(common, model=["20", 0])},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "unet_stock"}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": "unet_parallel"}},
    }
    entry = _run(url, api)
    rel = _rel(_latent(base, entry, "12"), _latent(base, entry, "11"))
    print(f"SDXL UNet row bands x2 through the Parallel Model: {rel:.2e}")
    # this random-weight UNet's fp32 noise floor is 1e-5 (test_comfyui_server explains the measurement)
    assert rel < 1e-5, rel


def test_a_wrapper_of_another_extension_is_refused_by_name_before_any_rank_starts(server):
    """TorchCompileModel after the Parallel Model node: the sampler node fails naming it, the next prompt works."""
    url, base = server
    api = _ksampler_pair(_dit_graph(WAN, 2, parallelism="sequence"), steps=2)
    api["21"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["20", 0], "backend": "inductor"}}
    api["8"]["inputs"]["model"] = ["21", 0]
    with pytest.raises(AssertionError, match="TorchCompileModel"):
        _run(url, api)
    entry = _run(url, _ksampler_pair(_dit_graph(WAN, 2, parallelism="sequence"), steps=2))
    assert _rel(_latent(base, entry, "10"), _latent(base, entry, "9")) <= BOUND


def test_comfyuis_process_does_not_load_the_diffusion_model_while_the_ranks_sample(server):
    """After ComfyUI's "unload models", a prompt that samples only the patched MODEL leaves no diffusion model loaded by
    ComfyUI's model management in its own process (on a GPU machine that is the copy on GPU 0 the ranks make
    unnecessary); the same prompt on the unpatched MODEL does load it (the check can fail)."""
    url, base = server
    for model, want in ((["20", 0], []), (["2", 0], ["WanModel"])):
        # ComfyUI applies "unload models" after the next queue item: a small prompt carries it out first
        assert _post(url + "/free", {"unload_models": True, "free_memory": True})[0] == 200
        _run(url, {"a": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
                   "b": {"class_type": "PatchRayTestLoadedModels", "inputs": {"latent": ["a", 0]}}})
        api = _dit_graph(WAN, 2, parallelism="sequence")
        api["8"] = {"class_type": "KSampler", "inputs": {
            "seed": 5, "steps": 2, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
            "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0, "model": model}}
        api["30"] = {"class_type": "PatchRayTestLoadedModels", "inputs": {"latent": ["8", 0]}}
        entry = _run(url, api)
        assert entry["outputs"]["30"]["loaded"] == want, (model, entry["outputs"]["30"])


def test_the_exactness_check_runs_once_and_its_verdict_shows_on_the_node(server):
    """The Distributed KSampler (the same path) shows the check's line: run now on first use of a class and mode, cached
    after; a cfg run (which does not depend on the model's internals) runs no check."""
    url, base = server
    common = {"seed": 5, "steps": 2, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
              "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0, "model": ["2", 0], "cluster": ["7", 0],
              "preset": "full_sync", "warmup_steps": -1, "refresh_every": -1, "k_ratio": 0.25, "block_size": 8,
              "sequence_attention": "ring", "balance": "equal", "sharding": "none"}
    texts = []
    for seed, parallelism in ((5, "sequence"), (6, "sequence"), (7, "cfg")):
        api = _dit_graph(WAN, 2)
        api["8"] = {"class_type": "PatchRayKSampler", "inputs": dict(common, seed=seed, parallelism=parallelism)}
        api["10"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": f"check_{seed}"}}
        texts.append("\n".join(_run(url, api)["outputs"]["8"]["text"]))
    assert "exactness check: sequence on WanModel" in texts[0] and "checked now" in texts[0], texts[0]
    assert "verified earlier (cached)" in texts[1], texts[1]
    assert "exactness check" not in texts[2], texts[2]
    assert "WanModel|" in (base / "patchray-cache" / "exactness.json").read_text()


def test_a_bad_widget_is_refused_on_the_parallel_model_node(server):
    """A value no widget offers (an edited API prompt) fails on the Parallel Model node, naming the widget."""
    url, base = server
    api = _ksampler_pair(_dit_graph(WAN, 2, parallelism="sequence"), steps=2)
    api["20"]["inputs"]["parallelism"] = "diagonal"
    with pytest.raises(AssertionError, match="parallelism must be one of"):
        _run(url, api)


def test_the_sampler_benchmark_node_runs_the_stock_path_and_each_mode(server):
    """PatchRay Sampler Benchmark on the Wan model and 2 CPU ranks: the stock row, sequence, cfg and batch runs each
    equal to the stock result (the report's rel_l2), cfg+sequence refused for 2 ranks with the reason, the chart and
    the report saved."""
    import json

    url, base = server
    api = _dit_graph(WAN, 2, batch=2)
    api["30"] = {"class_type": "PatchRaySamplerBenchmark", "inputs": {
        "model": ["2", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "cluster": ["7", 0],
        "steps": 2, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "seed": 3}}
    entry = _run(url, api)
    text = entry["outputs"]["30"]["text"][0]
    print(text)
    files = sorted((base / "output" / "patchray").glob("sampler_bench_*.json"))
    assert files, "no report saved"
    rows = {r["mode"]: r for r in json.loads(files[-1].read_text())["rows"]}
    for mode in ("sequence", "cfg", "batch"):
        assert rows[mode]["rel_l2"] is not None and rows[mode]["rel_l2"] <= BOUND, (mode, rows[mode])
        assert rows[mode]["s_per_step"] > 0 and rows[mode]["calls"] > 0
    assert rows["cfg+sequence"]["s_per_step"] is None and "four" in rows["cfg+sequence"]["note"]
    assert files[-1].with_suffix(".png").exists()
    assert "not a multi-GPU speed-up" in text
