"""Node tests run without ComfyUI: put the schema stand-in on the path unless a real ``comfy_api`` is importable."""

import importlib.util
import os
import sys

_STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")

if importlib.util.find_spec("comfy_api") is None:
    sys.path.insert(0, _STANDIN)
