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


def test_registry_metadata_follows_the_comfy_registry_rules():
    """docs.comfy.org/registry/specifications: the node id (``[project].name``) is < 100 characters of letters,
    digits, ``-_.``, no two special characters in a row, starts with a letter, and should not contain "ComfyUI";
    the version is X.Y.Z; the license is ``{file = ...}`` or ``{text = ...}``."""
    project, comfy = _toml()["project"], _toml()["tool"]["comfy"]
    name = project["name"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", name), name
    assert not re.search(r"[-_.]{2}", name) and "comfyui" not in name.lower(), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    license_file = project["license"]["file"]
    assert "Apache License" in (ROOT / license_file).read_text()[:200] and "Version 2.0" in (ROOT / license_file).read_text()[:200]
    assert comfy["PublisherId"] and comfy["DisplayName"] == "PatchRay"
    # no invented address: a Repository URL, when present, is one the publisher wrote (not a placeholder of ours)
    assert "patchray/comfyui-patchray" not in (ROOT / "pyproject.toml").read_text()
    # web/ is registered once, by WEB_DIRECTORY under the folder name (a `web` key would register it a second time
    # under [project].name and the frontend would load patchray.js twice)
    assert "web" not in comfy
    # the installed distribution's name is what provenance records as PatchRay's version
    assert f'version("{name}")' in (ROOT / "distributed" / "bench" / "provenance.py").read_text()


def test_the_registry_icon_is_a_small_square_png_in_the_repository():
    icon = ROOT / _toml()["tool"]["comfy"]["Icon"]
    data = icon.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # the IHDR chunk
    assert width == height <= 400 and len(data) < 100_000
