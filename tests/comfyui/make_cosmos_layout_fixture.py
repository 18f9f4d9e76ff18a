"""Record the state-dict layouts (key -> shape) of the Cosmos tokenizer VAE as ComfyUI's own class builds it.

Run once with the Python that runs ComfyUI; the CI conversion tests read the JSON without ComfyUI:

    python tests/comfyui/make_cosmos_layout_fixture.py /path/to/ComfyUI tests/fixtures/comfy_cosmos_vae_layouts.json

Layouts: ``full``, ``CausalContinuousVideoTokenizer`` with the ddconfig ``comfy.sd.VAE`` uses (the released shapes),
and ``narrow``, the same class as tests/comfyui/test_cosmos_vae.py builds it. Shapes only.
"""

import json
import sys


def main(comfy_dir, out):
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    from comfy.ldm.cosmos.vae import CausalContinuousVideoTokenizer
    from test_cosmos_vae import DDCONFIG, NARROW

    fixture = {name: {k: list(v.shape) for k, v in CausalContinuousVideoTokenizer(**cfg).state_dict().items()}
               for name, cfg in (("full", DDCONFIG), ("narrow", NARROW))}
    with open(out, "w") as f:
        json.dump(fixture, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
