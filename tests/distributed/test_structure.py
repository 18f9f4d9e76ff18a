"""Structure rules from the design, enforced on the source (STYLE.md rules 1 and 18)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTED = ROOT / "distributed"

COMFY_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "nodes", "server", "folder_paths", "execution", "latent_preview"}
#: third-party imports distributed/ may use (the rest is the standard library)
ALLOWED_THIRD_PARTY = {"torch", "diffusers", "ray", "numpy", "matplotlib", "safetensors", "pynvml", "psutil", "PIL", "tqdm"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0], 0
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, (node.module or "").split(".")[0], node.level


def test_distributed_never_imports_comfyui():
    offenders = []
    for path in sorted(DISTRIBUTED.rglob("*.py")):
        for line, top, level in _imports(path):
            if level == 0 and top in COMFY_MODULES:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    assert not offenders, "distributed/ must not import ComfyUI:\n" + "\n".join(offenders)


def test_distributed_imports_only_the_expected_libraries():
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for path in sorted(DISTRIBUTED.rglob("*.py")):
        for line, top, level in _imports(path):
            if level or not top or top in stdlib or top in ALLOWED_THIRD_PARTY or top == "patchray":
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    assert not offenders, "unexpected dependency in distributed/:\n" + "\n".join(offenders)


def test_nodes_use_relative_imports_of_the_pack():
    # ComfyUI loads the pack under its folder path: `import patchray` may not exist there.
    offenders = []
    for path in sorted((ROOT / "nodes").rglob("*.py")):
        for line, top, level in _imports(path):
            if level == 0 and top == "patchray":
                offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, "nodes/ must import the pack relatively:\n" + "\n".join(offenders)


def test_adapters_hold_no_timing_profiling_or_print():
    files = sorted((DISTRIBUTED / "parallel").rglob("*.py"))
    files += [p for p in (DISTRIBUTED / "sampling").rglob("adapters*.py")]
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else "")
                base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                if name == "print" or (base == "time" and name in {"time", "perf_counter", "monotonic"}) or base == "profiler":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {base + '.' if base else ''}{name}()")
    assert not offenders, "adapters must not time, profile or print (that is the benchmark's job):\n" + "\n".join(offenders)


def test_pack_imports_without_comfyui():
    code = (
        "import sys, patchray, patchray.distributed.cli, patchray.distributed.cluster\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in {'comfy', 'comfy_api', 'folder_paths', 'server'}]\n"
        "assert not bad, bad\n"
        "assert patchray.WEB_DIRECTORY == './web'\n"
        "assert not hasattr(patchray, 'NODE_CLASS_MAPPINGS')  # ComfyUI would ignore comfy_entrypoint\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
