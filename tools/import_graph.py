#!/usr/bin/env python3
"""The pack's import graph, read from the source (AST, standard library only): cycles, arrows from a lower layer up,
and the largest modules.

Every ``import`` and ``from ... import`` in the package counts, at module level or inside a function: a lazy import
still ties the two modules together, and a cycle hidden in a function body is still a cycle to read. The layers follow
the design's direction (nodes -> bridge -> distributed; inside distributed, bench -> runtime, never back) and, inside
the runtime, the order its folders already keep: the cluster is rank actors and a process group, and knows nothing of
models; topology measures the cluster's links; the adapters consult link profiles for their cost model; the VAE and
sampling engines apply the adapters on the cluster. A module may import its own layer or any layer below it, never
one above::

    0  core               distributed/__init__, comm*, context, bands, accounting, spawn
    1  cluster            distributed/cluster
    2  topology           distributed/topology
    3  parallel           distributed/parallel (the adapters)
    4  vae, sampling      distributed/vae, distributed/sampling
    5  bench              distributed/bench
    6  cli                distributed/cli
    7  bridge             nodes/bridge
    8  nodes              nodes/
    9  entry points       __init__, __main__

The exit status is 1 when there is a cycle or an upward arrow, so CI can run it as it is.

    python tools/import_graph.py            # the report
    python tools/import_graph.py --top 20   # more of the largest modules
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
#: the folders (relative to the repository root) whose modules make the package; the root's own files join them
PACKAGE_DIRS = ("distributed", "nodes")
ROOT_FILES = ("__init__.py", "__main__.py")
#: the name the package is installed under (pyproject.toml maps the repository root to it)
DIST_NAME = "patchray"

#: (layer, name, module prefixes); the longest matching prefix decides
LAYERS: Tuple[Tuple[int, str, Tuple[str, ...]], ...] = (
    (0, "core", ("distributed", "distributed.comm", "distributed.comm_fsdp", "distributed.comm_intercept",
                 "distributed.comm_p2p", "distributed.context", "distributed.bands", "distributed.accounting",
                 "distributed.spawn")),
    (1, "cluster", ("distributed.cluster",)),
    (2, "topology", ("distributed.topology",)),
    (3, "parallel", ("distributed.parallel",)),
    (4, "vae/sampling", ("distributed.vae", "distributed.sampling")),
    (5, "bench", ("distributed.bench",)),
    (6, "cli", ("distributed.cli",)),
    (7, "bridge", ("nodes.bridge",)),
    (8, "nodes", ("nodes",)),
    (9, "entry", ("__init__", "__main__")),
)


class Arrow(NamedTuple):
    source: str
    target: str
    line: int


class Graph(NamedTuple):
    modules: Dict[str, Path]
    arrows: List[Arrow]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_files(root: Path) -> Iterable[Path]:
    for name in ROOT_FILES:
        if (root / name).is_file():
            yield root / name
    for folder in PACKAGE_DIRS:
        yield from sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _resolve(importer: str, is_package: bool, module: str, level: int) -> str:
    """The absolute in-pack name of ``from <level dots><module>``, or '' when it leaves the pack."""
    if level == 0:
        if module == DIST_NAME or module.startswith(DIST_NAME + "."):
            return module[len(DIST_NAME) + 1:]
        return ""
    base = importer.split(".") if importer not in ROOT_FILES_NAMES else []
    if not is_package:
        base = base[:-1]
    drop = level - 1
    if drop > len(base):
        return ""
    base = base[:len(base) - drop] if drop else base
    name = ".".join(base + ([module] if module else []))
    return name


ROOT_FILES_NAMES = {Path(n).stem for n in ROOT_FILES}


def _target(name: str, modules: Dict[str, Path]) -> str:
    """The module a dotted name lands on: itself if it is one, else its nearest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def build(root: Path = ROOT) -> Graph:
    modules = {_module_name(p, root): p for p in _package_files(root)}
    arrows: List[Arrow] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py" and path.parent != root
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: List[Tuple[str, int]] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    resolved = _resolve(name, is_package, alias.name, 0)
                    if resolved:
                        targets.append((resolved, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.module or "", node.level)
                if not base and not (node.level and not node.module):
                    continue
                for alias in node.names:
                    # `from .pkg import sub` imports the submodule when there is one
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append((sub if sub in modules else base, node.lineno))
            for target, line in targets:
                target = _target(target, modules)
                if target and target != name:
                    arrows.append(Arrow(name, target, line))
    # one arrow per import statement and target (`from ..x import a, b` is one arrow)
    return Graph(modules, sorted(set(arrows)))


def layer_of(module: str) -> Tuple[int, str]:
    best: Tuple[int, int, str] = (-1, -1, "?")
    for level, label, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if len(prefix) > best[0]:
                    best = (len(prefix), level, label)
    return best[1], best[2]


def cycles(graph: Graph) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    edges: Dict[str, Set[str]] = {m: set() for m in graph.modules}
    for a in graph.arrows:
        edges[a.source].add(a.target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # iterative Tarjan: a deep import chain must not hit the recursion limit
        work = [(v, iter(sorted(edges[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda c: (-len(c), c))


def upward_arrows(graph: Graph) -> List[Tuple[Arrow, str, str]]:
    """Arrows whose target sits in a higher layer than their source: ``(arrow, source layer, target layer)``."""
    out = []
    for a in graph.arrows:
        (ls, ns), (lt, nt) = layer_of(a.source), layer_of(a.target)
        if lt > ls:
            out.append((a, ns, nt))
    return sorted(out, key=lambda t: (t[0].source, t[0].line))


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the largest modules to list (default 10)")
    args = parser.parse_args(argv)
    graph = build()
    found = cycles(graph)
    up = upward_arrows(graph)
    print(f"{len(graph.modules)} modules, {len(set((a.source, a.target) for a in graph.arrows))} arrows")
    print(f"\ncycles: {len(found)}")
    inner = {(a.source, a.target) for a in graph.arrows}
    for component in found:
        members = set(component)
        print(f"  {len(component)} modules: " + ", ".join(component))
        for s, t in sorted(inner):
            if s in members and t in members:
                print(f"      {s} -> {t}")
    print(f"\nupward arrows: {len(up)}")
    for a, ls, lt in up:
        print(f"  {a.source}:{a.line} ({ls}) -> {a.target} ({lt})")
    sizes = {}
    for folder in ("distributed", "distributed/bench", "nodes"):
        files = [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
        sizes[folder] = (len(files), sum(line_count(p) for p in files))
    print("\nlines:")
    for folder, (n, lines) in sizes.items():
        print(f"  {folder + '/':<20} {lines:>6} in {n} files")
    print(f"\nlargest modules:")
    ranked = sorted(graph.modules.items(), key=lambda kv: -line_count(kv[1]))[:args.top]
    for name, path in ranked:
        print(f"  {line_count(path):>5}  {path.relative_to(ROOT)}")
    return 1 if found or up else 0


if __name__ == "__main__":
    raise SystemExit(main())
