"""Test-only stand-in for ComfyUI's ``comfy_api`` package (absent in CI). See ``latest/__init__.py``."""
