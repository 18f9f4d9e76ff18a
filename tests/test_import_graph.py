"""The pack's import graph has no cycle and no arrow from a lower layer up (``tools/import_graph.py`` defines the
layers and reads every import, function-level ones included)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("patchray_import_graph_tool", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-free, but NamedTuple pickling and typing want the module registered
    spec.loader.exec_module(module)
    return module


ig = _load_tool()

@pytest.fixture(scope="module")
def graph():
    return ig.build(ROOT)


def test_no_import_cycle(graph):
    new = [sorted(c) for c in ig.cycles(graph)]
    assert not new, "import cycles (run python tools/import_graph.py):\n" + "\n".join(", ".join(c) for c in new)


def test_no_arrow_from_a_lower_layer_up(graph):
    up = [f"{a.source}:{a.line} ({ls}) -> {a.target} ({lt})" for a, ls, lt in ig.upward_arrows(graph)]
    assert not up, "imports from a lower layer up (run python tools/import_graph.py):\n" + "\n".join(up)


def test_every_module_has_a_layer(graph):
    assert graph.modules, "the checker found no modules"
    unlayered = [m for m in graph.modules if ig.layer_of(m)[0] < 0]
    assert not unlayered, unlayered


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_sees_a_cycle_and_an_upward_arrow(tmp_path):
    """A lazy import counts as much as a module-level one; ``from pkg import sub`` lands on the submodule; an
    absolute ``patchray.`` import is the pack's own."""
    _write(tmp_path, {
        "__init__.py": "from .nodes import x\n",
        "distributed/__init__.py": "",
        "distributed/context.py": "def f():\n    from .parallel import bands\n",  # core -> parallel: up
        "distributed/parallel/__init__.py": "",
        "distributed/parallel/bands.py": "from ..context import f\n",
        "distributed/vae/__init__.py": "",
        "distributed/vae/a.py": "from patchray.distributed.vae import b\n",
        "distributed/vae/b.py": "def g():\n    from . import a\n",
        "nodes/__init__.py": "x = 1\n",
        "nodes/bridge/__init__.py": "",
        "nodes/bridge/model.py": "from ...distributed.vae import a\n",
    })
    g = ig.build(tmp_path)
    cycles = {frozenset(c) for c in ig.cycles(g)}
    assert cycles == {frozenset({"distributed.vae.a", "distributed.vae.b"}),
                      frozenset({"distributed.context", "distributed.parallel.bands"})}
    up = [(a.source, a.target, ls, lt) for a, ls, lt in ig.upward_arrows(g)]
    assert up == [("distributed.context", "distributed.parallel.bands", "core", "parallel")]
