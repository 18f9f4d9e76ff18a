"""Small GGUF diffusion models for the opt-in tests, written with the ``gguf`` package and loaded by the ComfyUI-GGUF pack.

The ComfyUI-GGUF pack (city96/ComfyUI-GGUF) is never part of PatchRay: the tests find a checkout of it through the
``GGUF_DIR`` environment variable and import it the way ComfyUI loads a custom-node folder (a module named by the
folder's path, ``nodes.load_custom_node``), so its classes are as foreign to the ranks as they are in a server.

The file layout is the pack's own (``tools/convert.py``): 1-D and small tensors in F32, ``.modulation`` kept in F32
(a bare ``nn.Parameter`` no GGML layer dequantizes), tensors of more than 2 dimensions in F16 reshaped to 2-D with a
``comfy.gguf.orig_shape.<name>`` field, every other weight in the requested quantization. ``python gguf_models.py
COMFYUI_DIR MODELS_DIR`` writes the server test's files. The ``gguf`` package
quantizes Q8_0 but not the K-quants (llama.cpp's C tool does): :func:`quantize_q4_k` writes Q4_K blocks (ggml's
``block_q4_K``: fp16 ``d`` and ``dmin``, twelve bytes of packed 6-bit sub-block scales and minimums, 128 bytes of
4-bit quants for 256 values), checked against the ``gguf`` package's own Q4_K dequantizer.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import torch

GGUF_DIR = os.environ.get("GGUF_DIR")

#: weights the pack keeps in F32 (tools/convert.py's ModelWan.keys_hiprec)
_HIPREC = (".modulation",)


def load_pack(gguf_dir: str):
    """The ComfyUI-GGUF pack at ``gguf_dir`` imported as ComfyUI imports a custom-node folder: module name = the folder's
    path (``nodes.load_custom_node``); returns ``(nodes module, ops module)``. ComfyUI must be importable first."""
    path = os.path.realpath(gguf_dir)
    name = path.replace(".", "_x_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name + ".nodes"], sys.modules[name + ".ops"]


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``x`` (rows of a multiple of 256 values) as ggml Q4_K blocks: ``uint8 [rows, cols / 256 * 144]``.

    Per 32-value sub-block ``j``: value = ``d * sc[j] * q - dmin * m[j]``, ``q`` in 0..15, ``sc`` and ``m`` 6-bit. A
    plain min/max fit (llama.cpp searches the scales; any valid block is a Q4_K weight)."""
    rows, cols = x.shape
    assert cols % 256 == 0, cols
    b = x.astype(np.float32).reshape(-1, 8, 32)  # blocks of 8 sub-blocks
    lo = np.minimum(b.min(axis=-1), 0.0)
    hi = b.max(axis=-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63.0
    dmin = np.maximum(mins.max(axis=-1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((b + (dmin[:, None] * m)[..., None]) / step), 0, 15).astype(np.uint8)  # [n, 8, 32]
    scales = np.zeros((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
    blocks = np.concatenate([d16.reshape(-1, 1).view(np.uint8), dmin16.reshape(-1, 1).view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def tensor_type(key: str, shape, qtype: str):
    """The GGML type the pack's converter would give ``key`` (see the module docstring); ``qtype`` "Q8_0" or "Q4_K"
    (Q4_K where the rows hold whole 256-value blocks, else Q8_0)."""
    import gguf

    T = gguf.GGMLQuantizationType
    n = int(np.prod(shape))
    if len(shape) == 1 or n <= 1024 or any(h in key for h in _HIPREC):
        return T.F32
    if len(shape) > 2:
        return T.F16
    if qtype == "Q4_K" and shape[-1] % 256 == 0:
        return T.Q4_K
    if shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16


def write_gguf(path: str, state_dict: dict, arch: str, qtype: str) -> dict:
    """``state_dict`` (float tensors) as a GGUF file of architecture ``arch`` in the pack's layout; returns
    ``{key: GGML type name}``."""
    import gguf

    T = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types = {}
    for key, t in state_dict.items():
        data = t.detach().float().numpy()
        kind = tensor_type(key, data.shape, qtype)
        if data.ndim > 2:  # GGML holds 4 dimensions at most: 2-D rows, the shape in the pack's metadata field
            writer.add_array(f"comfy.gguf.orig_shape.{key}", tuple(int(d) for d in data.shape))
            data = data.reshape(data.shape[0], -1)
        if kind == T.Q4_K:
            raw = quantize_q4_k(data)
        else:
            raw = gguf.quants.quantize(data, kind)
        writer.add_tensor(key, raw, raw_dtype=kind)
        types[key] = kind.name
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def wan_state_dict(seed: int = 7) -> dict:
    """A small Wan 2.1 t2v of ComfyUI's class, weights seeded random (``rank_harness.random_model``): dim 256 (ComfyUI's
    detection reads the heads as dim / 128; the text width is its default, 4096), every Linear's input width a
    multiple of 256 (whole K-quant blocks)."""
    import comfy.supported_models as sm
    from rank_harness import init_random

    cfg = {"image_model": "wan2.1", "model_type": "t2v", "dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 2,
           "patch_size": (1, 2, 2), "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16,
           "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    conf = sm.WAN21_T2V(cfg)
    conf.set_inference_dtype(torch.float32, None)
    dm = conf.get_model({}).diffusion_model
    init_random(dm, seed)
    return {k: v.detach().contiguous() for k, v in dm.state_dict().items()}


def lora_state_dict(sd: dict, seed: int = 11) -> dict:
    """A LoRA of ``sd``'s model in ComfyUI's key format: rank 4 over every Linear weight of the blocks (about 10 % of
    each weight), plus a bias difference (``diff_b``) on one layer (an F32 tensor of the GGUF file)."""
    g = torch.Generator().manual_seed(seed)
    lo = {}
    for name, w in sd.items():
        if not (name.startswith("blocks.") and name.endswith(".weight") and w.dim() == 2):
            continue
        out_f, in_f = w.shape
        key = "diffusion_model." + name[: -len(".weight")]
        lo[key + ".lora_down.weight"] = torch.randn(4, in_f, generator=g) / in_f**0.5
        lo[key + ".lora_up.weight"] = torch.randn(out_f, 4, generator=g) * 0.1 / in_f**0.5 * 4
        lo[key + ".alpha"] = torch.tensor(4.0)
    lo["diffusion_model.blocks.0.ffn.0.diff_b"] = 0.1 * torch.randn(sd["blocks.0.ffn.0.bias"].shape, generator=g)
    return lo


#: what :func:`main` writes under a ComfyUI models folder
FILES = {"Q8_0": "patchray_test_wan_Q8_0.gguf", "Q4_K": "patchray_test_wan_Q4_K.gguf"}
LORA = "patchray_test_wan_gguf_lora.safetensors"


def main(argv=None):
    """``python gguf_models.py COMFYUI_DIR MODELS_DIR``: the Q8_0 and Q4_K files in ``diffusion_models`` and the LoRA in
    ``loras`` (for a server test)."""
    argv = sys.argv[1:] if argv is None else argv
    comfy_dir, models = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(comfy_dir)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    from safetensors.torch import save_file

    sd = wan_state_dict()
    os.makedirs(os.path.join(models, "diffusion_models"), exist_ok=True)
    os.makedirs(os.path.join(models, "loras"), exist_ok=True)
    for qtype, name in FILES.items():
        write_gguf(os.path.join(models, "diffusion_models", name), sd, "wan", qtype)
    save_file({k: v.contiguous() for k, v in lora_state_dict(sd).items()}, os.path.join(models, "loras", LORA))
    return 0


if __name__ == "__main__":
    sys.exit(main())
