"""Record the state-dict layouts (key -> shape) of Mochi's VAE as ComfyUI's own classes build it.

Run once with the Python that runs ComfyUI; the CI conversion tests read the JSON without ComfyUI:

    python tests/comfyui/make_mochi_layout_fixture.py /path/to/ComfyUI tests/fixtures/comfy_mochi_vae_layouts.json

Layouts: ``full``, genmo's ``VideoVAE`` exactly as ``comfy.sd.VAE`` builds it (the released shapes; shapes only, built
on the meta device), and ``narrow``, its ``Encoder`` / ``Decoder`` at base 32 channels with fewer resnets, as
tests/comfyui/test_mochi_vae.py builds it.
"""

import json
import sys


def main(comfy_dir, out):
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import torch

    from comfy.ldm.genmo.vae.model import VideoVAE
    from test_mochi_vae import _narrow

    fixture = {}
    with torch.device("meta"):
        fixture["full"] = {k: list(v.shape) for k, v in VideoVAE().state_dict().items()}
    fixture["narrow"] = {k: list(v.shape) for k, v in _narrow().state_dict().items()}
    with open(out, "w") as f:
        json.dump(fixture, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
