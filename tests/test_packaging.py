"""The package's declared runtime dependencies are the ones its code imports, and every package is listed."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = [ROOT / "__init__.py", ROOT / "__main__.py", *sorted((ROOT / "distributed").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]
#: distribution name -> the module it provides, where they differ
_MODULE = {"nvidia-ml-py": "pynvml"}


def _toml():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0]


def _imported() -> set:
    found = set()
    for path in RUNTIME:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_every_runtime_dependency_is_used_by_the_package():
    used = _imported()
    declared = [_name(r) for r in _toml()["project"]["dependencies"]]
    unused = [d for d in declared if _MODULE.get(d, d) not in used]
    assert not unused, f"declared but never imported by the package: {unused}"
    # requirements.txt (ComfyUI-Manager installs) lists the same ones, torch aside (ComfyUI brings it)
    listed = [_name(line) for line in (ROOT / "requirements.txt").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert sorted(listed) == sorted(d for d in declared if d != "torch")


def test_every_package_folder_is_listed_for_setuptools():
    listed = set(_toml()["tool"]["setuptools"]["packages"])
    folders = {"patchray"} | {
        "patchray." + ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.glob("*/**/__init__.py")
        if p.parent.parts[len(ROOT.parts)] in ("distributed", "nodes")
    }
    assert folders == listed, (sorted(folders - listed), sorted(listed - folders))
