"""A minimal stand-in for ``comfy_api.latest`` (ComfyUI 0.3.64's V3 schema API), for tests without ComfyUI.

It covers ONLY the schema classes PatchRay's nodes use, with the same constructor signatures as ComfyUI's
``comfy_api/latest/_io.py`` and ``_ui.py`` (so a wrong keyword fails here as it would there) and the same
``Schema.validate`` rule (unique input/output ids). Nothing else is imitated: execution goes straight to the
node's real ``execute``, which runs on real Ray ranks. The opt-in test in ``tests/comfyui`` checks the same
nodes against a real ComfyUI server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import Any

__all__ = ["ComfyExtension", "io", "ui"]

STANDIN = True


class _Input:
    def __init__(self, id: str, display_name: str = None, optional=False, tooltip: str = None, lazy: bool = None, extra_dict=None):
        self.id, self.display_name, self.optional, self.tooltip, self.lazy = id, display_name, optional, tooltip, lazy

    @property
    def io_type(self):
        return self.Parent.io_type


class _WidgetInput(_Input):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, socketless=None,
                 widget_type=None, force_input=None, extra_dict=None):
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
        self.default = default


class _Output:
    def __init__(self, id: str = None, display_name: str = None, tooltip: str = None, is_output_list=False):
        self.id, self.display_name, self.tooltip, self.is_output_list = id, display_name, tooltip, is_output_list

    @property
    def io_type(self):
        return self.Parent.io_type


def _comfytype(io_type, input_cls=_Input, output=True):
    ns = {"io_type": io_type}
    t = type(f"T_{io_type}", (), ns)
    t.Input = type("Input", (input_cls,), {"Parent": t})
    if output:
        t.Output = type("Output", (_Output,), {"Parent": t})
    return t


class _IntInput(_WidgetInput):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, min=None, max=None,
                 step=None, control_after_generate=None, display_mode=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input)
        self.min, self.max, self.step = min, max, step
        self.control_after_generate = control_after_generate


class _FloatInput(_WidgetInput):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, min=None, max=None,
                 step=None, round=None, display_mode=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input)
        self.min, self.max, self.step = min, max, step


class _StringInput(_WidgetInput):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, multiline=False, placeholder=None,
                 default=None, dynamic_prompts=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input)
        self.multiline = multiline


class _BooleanInput(_WidgetInput):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, label_on=None,
                 label_off=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input)


class _ComboInput(_WidgetInput):
    def __init__(self, id, options=None, display_name=None, optional=False, tooltip=None, lazy=None, default=None,
                 control_after_generate=None, upload=None, image_folder=None, remote=None, socketless=None):
        if isinstance(options, type) and issubclass(options, Enum):
            options = [v.value for v in options]
        super().__init__(id, display_name, optional, tooltip, lazy, default, socketless)
        self.options = options


class _Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"


@dataclass
class _Schema:
    node_id: str
    display_name: str = None
    category: str = "sd"
    inputs: list = None
    outputs: list = None
    hidden: list = None
    description: str = ""
    is_input_list: bool = False
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    is_api_node: bool = False
    not_idempotent: bool = False
    enable_expand: bool = False

    def validate(self):
        # the rule of comfy_api/latest/_io.py Schema.validate
        input_ids = [i.id for i in self.inputs or []]
        output_ids = [o.id for o in self.outputs or []]
        issues = []
        if len(set(input_ids)) != len(input_ids):
            issues.append(f"Input ids must be unique, but {[k for k, c in Counter(input_ids).items() if c > 1]} are not.")
        if len(set(output_ids)) != len(output_ids):
            issues.append(f"Output ids must be unique, but {[k for k, c in Counter(output_ids).items() if c > 1]} are not.")
        if set(input_ids) & set(output_ids):
            issues.append(f"Ids must be unique between inputs and outputs, but {set(input_ids) & set(output_ids)} are not.")
        if issues:
            raise ValueError("\n".join(issues))

    def finalize(self):
        for i, output in enumerate(self.outputs or []):
            if output.id is None:
                output.id = f"_{i}_{output.io_type}_"


class _NodeOutput:
    def __init__(self, *args: Any, ui=None, expand=None, block_execution=None):
        self.args, self.ui, self.expand, self.block_execution = args, ui, expand, block_execution

    @property
    def result(self):
        return self.args if self.args else None

    def __getitem__(self, index):
        return self.args[index]


class _ComfyNode:
    hidden = None

    @classmethod
    def define_schema(cls):
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs):
        raise NotImplementedError


def _custom(io_type: str):
    return _comfytype(io_type)


io = SimpleNamespace(
    ComfyNode=_ComfyNode,
    Schema=_Schema,
    NodeOutput=_NodeOutput,
    Hidden=_Hidden,
    Custom=_custom,
    Int=_comfytype("INT", _IntInput),
    Float=_comfytype("FLOAT", _FloatInput),
    String=_comfytype("STRING", _StringInput),
    Boolean=_comfytype("BOOLEAN", _BooleanInput),
    Combo=_comfytype("COMBO", _ComboInput),
    Image=_comfytype("IMAGE"),
    Mask=_comfytype("MASK"),
    Latent=_comfytype("LATENT"),
    Vae=_comfytype("VAE"),
    Model=_comfytype("MODEL"),
    Clip=_comfytype("CLIP"),
    Conditioning=_comfytype("CONDITIONING"),
    Sampler=_comfytype("SAMPLER"),
    Sigmas=_comfytype("SIGMAS"),
    Noise=_comfytype("NOISE"),
)


class _PreviewText:
    def __init__(self, value: str, **kwargs):
        self.value = value

    def as_dict(self):
        return {"text": (self.value,)}


class _PreviewImage:
    def __init__(self, image, animated: bool = False, cls=None, **kwargs):
        self.image = image

    def as_dict(self):
        return {"images": [], "animated": (False,)}


ui = SimpleNamespace(PreviewText=_PreviewText, PreviewImage=_PreviewImage)


class ComfyExtension(ABC):
    async def on_load(self) -> None:
        pass

    @abstractmethod
    async def get_node_list(self):
        ...
