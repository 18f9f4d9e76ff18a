"""Schema hygiene of every PatchRay node (STYLE rules 2-4), the entry point, and the ComfyUI import boundary."""

import ast
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[2]

# Node ids are public: workflows reference them. Never rename one (deprecate with is_deprecated instead).
NODE_IDS = {
    "PatchRayCluster",
    "PatchRayParallelModel",
    "PatchRayVAEDecode",
    "PatchRayVAEEncode",
    "PatchRayParallelVAE",
    "PatchRayKSampler",
    "PatchRayKSamplerAdvanced",
    "PatchRayTilePlanner",
    "PatchRayTopologyProbe",
    "PatchRayBenchmark",
    "PatchRaySamplerBenchmark",
}


@pytest.fixture(scope="module")
def nodes():
    from patchray import nodes

    return nodes


def _schemas(nodes):
    return [(cls, cls.define_schema()) for cls in nodes.NODES]


def test_extension_lists_every_node_once(nodes):
    listed = asyncio.run(nodes.PatchRayExtension().get_node_list())
    assert listed == list(nodes.NODES)
    assert {cls.define_schema().node_id for cls in listed} == NODE_IDS


def test_every_schema_is_valid_and_documented(nodes):
    for cls, schema in _schemas(nodes):
        schema.finalize()  # as ComfyUI GET_SCHEMA does: default output ids first, then validate
        schema.validate()  # unique input/output ids, the rule ComfyUI enforces
        where = schema.node_id
        assert schema.node_id.startswith("PatchRay"), where
        assert schema.category.startswith("PatchRay/"), where
        assert schema.display_name and schema.display_name.startswith("PatchRay "), where
        assert len(schema.description) > 40, where
        assert schema.outputs, where
        for item in list(schema.inputs) + list(schema.outputs):
            assert item.tooltip and len(item.tooltip) > 10, f"{where}: {getattr(item, 'id', None) or item.display_name} lacks a tooltip"
        for inp in schema.inputs:
            default = getattr(inp, "default", None)
            if getattr(inp, "options", None) is not None and default is not None:
                assert default in inp.options, f"{where}.{inp.id}: default {default!r} not among the options"
            if getattr(inp, "min", None) is not None and default is not None:
                assert inp.min <= default <= inp.max, f"{where}.{inp.id}"
        # execute takes exactly the declared inputs (ComfyUI passes them as keyword arguments)
        import inspect

        params = set(inspect.signature(cls.execute).parameters) - {"cls"}
        assert params == {i.id for i in schema.inputs}, where


def test_custom_wire_types_are_declared_once(nodes):
    from patchray.nodes import types

    declared = {types.CLUSTER.io_type, types.TILE_PLAN.io_type}
    used = {
        item.io_type
        for _, s in _schemas(nodes)
        for item in list(s.inputs) + list(s.outputs)
        if str(item.io_type).startswith("PATCHRAY_")
    }
    assert used == declared == {"PATCHRAY_CLUSTER", "PATCHRAY_TILE_PLAN"}
    # nobody builds the custom types again outside nodes/types.py
    for path in (PACK / "nodes").rglob("*.py"):
        if path.name != "types.py":
            assert "io.Custom(" not in path.read_text(), path.name


COMFY_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "nodes", "server", "folder_paths", "execution"}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


# The only node-pack modules that import ComfyUI, and why: the node modules' shim (schema API, progress bar, cancel,
# folders), and in the bridge the MODEL conversion (reads ComfyUI's ModelPatcher, applies its weight patches) and
# the rank-side sampler (runs ComfyUI's own sampler inside the rank processes), what travels to the ranks by value
# (reads ComfyUI's custom-node folders), and the lifecycle hooks (wrap
# ComfyUI's unload_all_models so "Free model" frees the ranks too).
COMFY_TOUCHING = {
    "bridge/lifecycle.py": {"comfy"},
    "_comfy.py": {"comfy_api", "comfy", "folder_paths", "server"},
    "bridge/model.py": {"comfy"},
    "bridge/parallel_model.py": {"comfy"},
    "bridge/travel.py": {"folder_paths"},
    "bridge/ksampler.py": {"nodes"},
    "bridge/sampler_bench.py": {"nodes"},
    "bridge/ksampler_rank.py": {"comfy"},
}


def test_only_the_comfy_shim_imports_comfyui():
    for path in sorted((PACK / "nodes").rglob("*.py")):
        name = path.relative_to(PACK / "nodes").as_posix()
        found = set(_imports(path)) & COMFY_MODULES
        if name in COMFY_TOUCHING:
            assert found == COMFY_TOUCHING[name], (name, found)
        else:
            assert not found, f"nodes/{name} imports {found}: go through nodes/_comfy.py or the bridge"
    root = set(_imports(PACK / "__init__.py")) & COMFY_MODULES
    assert not root, f"the pack's __init__.py imports {root}"


def test_pack_imports_without_comfyui():
    code = (
        "import sys, patchray; "
        "assert 'comfy_api' not in sys.modules and 'comfy' not in sys.modules; "
        "assert patchray.WEB_DIRECTORY == './web' and callable(patchray.comfy_entrypoint); "
        "assert not hasattr(patchray, 'NODE_CLASS_MAPPINGS')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr


def test_entrypoint_returns_the_extension(nodes):
    import patchray

    ext = asyncio.run(patchray.comfy_entrypoint())
    assert type(ext).__name__ == "PatchRayExtension"
    assert asyncio.run(ext.get_node_list()) == list(nodes.NODES)
