"""The ComfyUI bridge: ComfyUI's objects <-> what ``distributed/`` takes, and the code the ranks run inside ComfyUI.

The layer between the node modules (``nodes/*.py``: schema + one call) and the library (``distributed/``, which
neither imports ComfyUI nor knows its layouts). Dependencies point one way: nodes -> bridge -> distributed.

* :mod:`.shim` -- the one import shim: the library runs as ``patchray.distributed`` however ComfyUI loaded the pack.
* :mod:`.vae`, :mod:`.convert`, :mod:`.vae_layouts` -- VAE Decode/Encode: ComfyUI's VAE, LATENT and IMAGE <-> the
  library's diffusers-format spec and tensors; the fallback to ComfyUI's own VAE.
* :mod:`.ksampler`, :mod:`.model` -- the Distributed KSampler, driver side: MODEL -> a portable model, the stock
  KSampler's latent and noise, refusals before anything is shipped.
* :mod:`.ksampler_rank` -- ComfyUI's sampler inside each rank process.
* :mod:`.errors` -- what the user reads when a rank fails: the message alone, with the rank.

Nothing is imported here: ``nodes/__init__.py`` installs the shim before any module reaches ``distributed/``, and
the rank processes import :mod:`.ksampler_rank` alone.
"""
