"""Where a benchmark figure came from: package versions, PatchRay revision, source digest, the device.

Design decision: two figures compare only when this context is available (``docs/benchmark.md``), so every
record carries it, and it is gathered without side effects (no network, no writes): ``git`` is asked only when the
package sits in a git work tree, and NVML only when ``nvidia-ml-py`` is installed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from typing import Optional

import torch

__all__ = ["package_root", "source_digest", "bench_digest", "git_revision", "versions", "device_info", "collect", "hw_family"]


def package_root() -> str:
    """The PatchRay package folder (the repository root)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _digest(root: str, subdirs) -> str:
    h = hashlib.sha256()
    for sub in subdirs:
        base = os.path.join(root, sub)
        if os.path.isfile(base):
            files = [base]
        else:
            files = []
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "tests"))
                files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
        for path in sorted(files):
            h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
            with open(path, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def source_digest() -> str:
    """sha256 (16 hex digits) over the package's ``.py`` files under ``distributed/`` and the root files.

    Tests and the ComfyUI nodes are left out: they do not change what is measured.
    """
    return _digest(package_root(), ["__init__.py", "distributed"])


def bench_digest() -> str:
    """Digest of the benchmark harness itself (``distributed/bench``): compare runs only when it matches."""
    return _digest(package_root(), [os.path.join("distributed", "bench")])


def git_revision() -> dict:
    """``{"commit": sha|None, "dirty": bool|None}`` of the package's git work tree, if it is one."""
    root = package_root()
    if not os.path.exists(os.path.join(root, ".git")):
        return {"commit": None, "dirty": None, "note": "package is not a git work tree"}
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"commit": None, "dirty": None, "note": f"git unavailable: {exc}"}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None, "note": commit.stderr.strip()[:200]}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def versions() -> dict:
    """Versions of Python and the packages that shape the measurement."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "ray", "numpy"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", None)
        except ImportError:
            out[name] = None
    try:
        from importlib.metadata import version

        out["patchray"] = version("patchray")
    except Exception:  # not installed as a distribution: the revision and digest still identify it
        out["patchray"] = None
    out["cuda"] = torch.version.cuda
    out["hip"] = getattr(torch.version, "hip", None)
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _nvml_details(index: int) -> dict:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            return {
                "driver": pynvml.nvmlSystemGetDriverVersion(),
                "pcie_gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                "pcie_width": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                "pcie_gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                "pcie_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML present but refusing (no driver, MIG): say so, measure anyway
        return {"nvml_error": f"{type(exc).__name__}: {exc}"}


def device_info(device) -> dict:
    """What this rank computes on: accelerator name, memory, capability and link details, or the CPU."""
    device = torch.device(device)
    info = {"type": device.type, "host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(
            name=props.name,
            total_memory_bytes=int(props.total_memory),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            device_count=torch.cuda.device_count(),
        )
        info.update(_nvml_details(index))
    else:
        info["name"] = info["cpu"]
    return info


def hw_family() -> Optional[str]:
    """The ``HW_FAMILY`` label (a fleet or node-type name you choose); ``None`` when unset."""
    value = os.environ.get("HW_FAMILY")
    return value if value else None


def collect(device) -> dict:
    """The provenance block of a record (gathered once per run, on rank 0)."""
    return {
        "versions": versions(),
        "revision": git_revision(),
        "source_digest": source_digest(),
        "bench_digest": bench_digest(),
        "device": device_info(device),
        "argv": list(sys.argv),
    }
