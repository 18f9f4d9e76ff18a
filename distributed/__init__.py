"""PatchRay's library: everything that runs on the ranks. Never imports ComfyUI (a test enforces it)."""
