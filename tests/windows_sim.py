"""Run as a script: import every PatchRay module and call the probe and the machine checks as on native Windows.

What native Windows lacks, taken away before anything is imported (honestly: the names are gone, so code that
uses them unguarded fails the way it would there):

* POSIX-only modules (``fcntl``, ``termios``, ``pwd``, ``grp``, ``resource``): importing them raises ImportError;
* POSIX-only ``os`` functions (``fork``, ``setsid``, ``getuid``, ``sched_getaffinity``, ``killpg``, ``getpgid``,
  ``sysconf``) and signals (``SIGKILL``, ``SIGHUP``...): deleted;
* Linux files (``/proc``, ``/sys``, ``/dev/shm``): opening or listing them raises FileNotFoundError;
* Linux tools (``ss``, ``nvidia-smi``, ``lspci``): ``shutil.which`` finds none and running them fails.

Prints one JSON line with what was imported and what the calls returned. Used by tests/test_windows_imports.py.
"""

import builtins
import importlib
import importlib.abc
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED_MODULES = {"fcntl", "termios", "pwd", "grp", "resource"}
LINUX_PATHS = ("/proc", "/sys", "/dev/shm")
LINUX_TOOLS = {"ss", "nvidia-smi", "lspci", "numactl"}


class _NoPosix(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED_MODULES:
            raise ImportError(f"No module named {name!r} (simulated Windows)")
        return None


def _simulate_windows():
    for name in BLOCKED_MODULES:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, _NoPosix())
    for name in ("fork", "setsid", "getuid", "geteuid", "sched_getaffinity", "killpg", "getpgid", "sysconf", "getloadavg"):
        if hasattr(os, name):
            delattr(os, name)
    for name in ("SIGKILL", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD"):
        if hasattr(signal, name):
            delattr(signal, name)
    real_open, real_listdir, real_scandir, real_exists = builtins.open, os.listdir, os.scandir, os.path.exists

    def linux_path(p):
        try:
            p = os.fspath(p)
        except TypeError:
            return False
        return isinstance(p, str) and any(p == lp or p.startswith(lp + "/") for lp in LINUX_PATHS)

    def _open(file, *a, **k):
        if linux_path(file):
            raise FileNotFoundError(2, "No such file or directory (simulated Windows)", file)
        return real_open(file, *a, **k)

    def _listdir(p="."):
        if linux_path(p):
            raise FileNotFoundError(2, "No such file or directory (simulated Windows)", p)
        return real_listdir(p)

    def _scandir(p="."):
        if linux_path(p):
            raise FileNotFoundError(2, "No such file or directory (simulated Windows)", p)
        return real_scandir(p)

    builtins.open, os.listdir, os.scandir = _open, _listdir, _scandir
    os.path.exists = lambda p: False if linux_path(p) else real_exists(p)
    real_which = shutil.which
    shutil.which = lambda cmd, *a, **k: None if os.path.basename(str(cmd)) in LINUX_TOOLS else real_which(cmd, *a, **k)
    real_popen_init = subprocess.Popen.__init__

    def _popen_init(self, args, *a, **k):
        first = args if isinstance(args, str) else (args[0] if args else "")
        if os.path.basename(str(first).split()[0] if first else "") in LINUX_TOOLS:
            raise FileNotFoundError(2, "The system cannot find the file specified (simulated Windows)", first)
        return real_popen_init(self, args, *a, **k)

    subprocess.Popen.__init__ = _popen_init


def main():
    _simulate_windows()
    sys.path.insert(0, str(ROOT / "tests" / "nodes" / "standin"))  # the V3 schema stand-in: ComfyUI is absent
    out = {"imported": [], "failed": {}}
    modules = ["patchray"] + [
        "patchray." + ".".join(p.relative_to(ROOT).with_suffix("").parts).replace(".__init__", "")
        for folder in ("distributed", "nodes")
        for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    for name in modules:
        try:
            importlib.import_module(name)
            out["imported"].append(name)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["failed"][name] = f"{type(exc).__name__}: {exc}"
    from patchray.distributed.cluster.limits import max_cpu_ranks, this_machine
    from patchray.distributed.topology import probe_topology, summary_text

    machine = this_machine()
    report = probe_topology(measure=False)
    out["machine"] = machine._asdict()
    out["max_cpu_ranks"] = max_cpu_ranks(machine)
    out["probe_text"] = summary_text(report)
    from patchray.nodes.bridge import lifecycle

    lifecycle.install()
    out["lifecycle"] = lifecycle.installed()
    lifecycle.uninstall()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
