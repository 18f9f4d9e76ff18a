"""Opt-in: a MODEL that went through ComfyUI's TorchCompileModel is refused by name, before any rank starts.

ComfyUI's ``set_torch_compile_wrapper`` (what the TorchCompileModel node calls) files an APPLY_MODEL wrapper under
the key ``torch.compile`` on the driver's ModelPatcher. The Distributed KSampler's ranks run their own copies of the
model, so the wrapper would silently not apply there; the node says so in the user's terms instead of listing an
internal wrapper key. Run with ComfyUI's Python:

    COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/python -m pytest -q tests/comfyui/test_compile_wrapper_refusal.py
"""

import os
import sys
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout (and run with its Python)"),
]

ROOT = Path(__file__).resolve().parents[2]


def _patcher(tmp_path):
    if not (tmp_path / "patchray").exists():
        os.symlink(ROOT, tmp_path / "patchray")
    for p in (str(tmp_path), COMFYUI_DIR):
        if p not in sys.path:
            sys.path.insert(0, p)
    saved = sys.argv
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management  # noqa: F401  (parses the arguments once)

    sys.argv = saved
    import torch
    from comfy.model_patcher import ModelPatcher

    class Base(torch.nn.Module):  # what the bridge reads of a BaseModel: its diffusion model
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(4, 4)

    return ModelPatcher(Base(), load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def test_a_model_through_torch_compile_model_is_refused_naming_the_node(tmp_path):
    mp = _patcher(tmp_path)
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from patchray.nodes.bridge import model as bridge_model

    bridge_model._check_model(mp, "cfg")  # the plain MODEL passes this check
    compiled = mp.clone()
    set_torch_compile_wrapper(compiled, backend="inductor")
    with pytest.raises(NotImplementedError) as err:
        bridge_model._check_model(compiled, "cfg")
    msg = str(err.value)
    assert "TorchCompileModel" in msg and "before the TorchCompileModel node" in msg, msg
    # another extension's wrapper keeps the generic refusal, naming its key
    other = mp.clone()
    other.add_wrapper_with_key("apply_model", "some.extension", lambda executor, *a, **k: executor(*a, **k))
    with pytest.raises(NotImplementedError, match="some.extension"):
        bridge_model._check_model(other, "cfg")
