"""Structure rules from the design, enforced on the source (STYLE.md rules 1 and 18)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTED = ROOT / "distributed"

COMFY_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "nodes", "server", "folder_paths", "execution", "latent_preview"}
#: third-party imports distributed/ may use (the rest is the standard library)
#: (triton: PyTorch's kernel language, shipped with its CUDA wheels; the compressed exchange's fused codec)
ALLOWED_THIRD_PARTY = {"torch", "diffusers", "ray", "numpy", "matplotlib", "safetensors", "pynvml", "psutil", "PIL", "tqdm",
                       "triton"}


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


# --------------------------------------------------------------------------------------------------
# layering: one torch.distributed caller, a runtime that never needs the benchmark, no import circles

COMM = DISTRIBUTED / "comm.py"
#: the comm modules, each with one job: collectives and process groups (the door every other module imports),
#: point-to-point exchanges, the interception layer, and weight sharding's FSDP2 wrappers. Only these use torch.distributed, and only
#: comm.py imports the two siblings, so the rest of the pack still has one place to go through.
COMM_MODULES = {COMM, DISTRIBUTED / "comm_p2p.py", DISTRIBUTED / "comm_intercept.py", DISTRIBUTED / "comm_fsdp.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(path: Path, module: str, level: int) -> str:
    """The absolute module name (``distributed.x.y``, the pack's root being ``patchray``) of an import in ``path``."""
    if level == 0:
        return module[len("patchray."):] if module.startswith("patchray.") else module
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _dist_offences(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" or alias.name.startswith("torch.distributed."):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch.distributed" or node.module.startswith("torch.distributed."):
                yield node.lineno, f"from {node.module} import ..."
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                yield node.lineno, "from torch import distributed"
        elif isinstance(node, ast.Attribute):
            v = node.value
            if node.attr == "distributed" and isinstance(v, ast.Name) and v.id == "torch":
                yield node.lineno, "torch.distributed"
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "dist":
                yield node.lineno, f"dist.{f.attr}()"


def test_only_comm_talks_to_torch_distributed():
    offenders = []
    for path in sorted(DISTRIBUTED.rglob("*.py")) + sorted((ROOT / "nodes").rglob("*.py")):
        if path in COMM_MODULES:
            continue
        for line, what in _dist_offences(path):
            offenders.append(f"{path.relative_to(ROOT)}:{line} {what}")
    assert not offenders, "only distributed/comm*.py may use torch.distributed (call the helpers in comm):\n" + "\n".join(offenders)


def test_comm_siblings_are_reached_only_through_comm():
    siblings = {_module_name(p) for p in COMM_MODULES - {COMM}}
    assert siblings == {"distributed.comm_p2p", "distributed.comm_intercept", "distributed.comm_fsdp"}  # the checker sees them
    offenders = []
    files = sorted(DISTRIBUTED.rglob("*.py")) + sorted((ROOT / "nodes").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    for path in files:
        if path == COMM or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(path, node.module or "", node.level)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [_resolve(path, a.name, 0) for a in node.names]
            else:
                continue
            if any(t in siblings for t in targets):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "import the comm helpers from distributed.comm, not from its sibling modules:\n" + "\n".join(offenders)


def _runtime_files():
    bench = DISTRIBUTED / "bench"
    return [p for p in sorted(DISTRIBUTED.rglob("*.py")) if bench not in p.parents and p != DISTRIBUTED / "cli.py"]


def test_runtime_never_imports_the_benchmark():
    offenders = []
    for path in _runtime_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # function-level imports too: the runtime must not need bench/ at all
            if isinstance(node, ast.ImportFrom):
                targets = [_resolve(path, node.module or "", node.level)]
                targets += [f"{targets[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [_resolve(path, a.name, 0) for a in node.names]
            else:
                continue
            if any(t == "distributed.bench" or t.startswith("distributed.bench.") for t in targets):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "runtime modules import distributed/bench/:\n" + "\n".join(offenders)


def _module_level_imports(tree):
    """Import statements executed when the module is imported (not inside functions or TYPE_CHECKING blocks)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else (test.attr if isinstance(test, ast.Attribute) else "")
            if name != "TYPE_CHECKING":
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body


def _import_graph():
    files = {_module_name(p): p for p in sorted(DISTRIBUTED.rglob("*.py"))}
    graph = {name: set() for name in files}
    for name, path in files.items():
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [_resolve(path, a.name, 0) for a in node.names]
            else:
                base = _resolve(path, node.module or "", node.level)
                # `from pkg import mod` imports the submodule; `from mod import name` imports mod
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs if subs and len(subs) == len(node.names) else [base] + subs
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_finds_a_known_circle():
    # the checker itself: a two-module circle and a chain without one
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles_in_distributed():
    graph = _import_graph()
    assert "distributed.context" in graph["distributed.comm"]  # the graph sees relative imports
    circles = _cycles(graph)
    assert not circles, "module-level import circles in distributed/:\n" + "\n".join(" -> ".join(c) for c in circles)
