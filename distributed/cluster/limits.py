"""How many ranks this machine can hold, checked before Ray starts or any weight is shipped.

Design decisions:

* **Refuse what cannot help, before paying for it.** Starting a rank costs a process (a Ray worker with torch
  imported, about 0.3 GiB before any model) and seconds; 64 CPU ranks on a 2-core machine took two minutes to
  start and then only waited for each other. The embedded cluster is checked against this machine; an existing
  Ray cluster (``address=``) is checked by Ray's own resources when the ranks are placed.
* **GPU ranks: one per GPU present.** Ranks that share a GPU are the tests' business (``device='cpu'`` is the
  cheap way to try PatchRay), not a user setting.
* **CPU ranks: by cores and by memory.** At most :data:`CPU_RANKS_PER_CORE` ranks per core (CPU ranks compute;
  beyond that they take turns on the cores), and at most as many idle rank processes as the free memory holds at
  :data:`CPU_RANK_BYTES` each (a floor, not an estimate with models: it refuses only what cannot even start, so a
  busy machine's momentary memory use does not refuse a normal request).
* **Native Windows has no NCCL** (PyTorch's Windows builds ship gloo only), so GPU ranks are refused there with
  the supported route (WSL2); CPU ranks (gloo) work.
* **Messages speak the node's widgets** (``num_ranks``, ``device``) and only suggest values that work.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple, Optional

from .errors import ClusterSetupError

__all__ = ["CPU_RANKS_PER_CORE", "CPU_RANK_BYTES", "Machine", "this_machine", "max_cpu_ranks", "check_rank_count"]

#: CPU ranks per core before they only take turns (2: a rank waiting in a collective leaves its core to a peer)
CPU_RANKS_PER_CORE = 2
#: memory one idle CPU rank process holds before any model: a Ray worker with torch and the library imported
#: (measured 0.3-0.4 GiB RSS on Linux with torch 2.13 and Ray 2.60; rounded up for allocator growth)
CPU_RANK_BYTES = 512 << 20


class Machine(NamedTuple):
    """What this machine offers ranks (``None`` where the platform does not say)."""

    cores: int
    available_bytes: Optional[int]
    gpus: int
    platform: str


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on (containers, taskset)
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def _available_bytes() -> Optional[int]:
    try:
        import psutil  # a dependency of Ray; works on Linux, Windows and macOS

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def this_machine() -> Machine:
    """Cores, free memory and GPUs of this machine, as the checks see them."""
    return Machine(_cores(), _available_bytes(), _gpus(), sys.platform)


def max_cpu_ranks(machine: Machine) -> int:
    """The most CPU ranks ``machine`` holds usefully (at least 1)."""
    limit = max(2, CPU_RANKS_PER_CORE * machine.cores)
    if machine.available_bytes is not None:
        limit = min(limit, max(1, machine.available_bytes // CPU_RANK_BYTES))
    return limit


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_rank_count(num_ranks: int, device: str, embedded: bool = True, gpu_ids: tuple = (), machine: Optional[Machine] = None) -> str:
    """Refuse a rank count this machine cannot hold; return the device kind the ranks will use (``cuda``/``cpu``).

    Args:
        num_ranks: the Cluster node's ``num_ranks``.
        device: its ``device`` (``auto``, ``cuda`` or ``cpu``).
        embedded: whether the ranks run on this machine (no ``address``); an existing Ray cluster is checked by
            Ray's resources when the ranks are placed, so only the device kind is decided here (``auto`` -> ``""``).
        gpu_ids: pinned GPUs (each must exist).
        machine: what to check against (default: :func:`this_machine`).

    Raises:
        ClusterSetupError: naming the widget to change and a value that works.
    """
    if not embedded:
        return {"cpu": "cpu", "cuda": "cuda"}.get(device, "")
    m = machine or this_machine()
    n = int(num_ranks)
    if device == "cuda" or (device == "auto" and m.gpus > 0):
        if m.platform == "win32":
            raise ClusterSetupError(
                "GPU ranks need NCCL, which PyTorch does not ship for native Windows: run ComfyUI under WSL2 "
                "(see the README's Windows section), or set device to cpu to try PatchRay with CPU ranks"
            )
        if m.gpus == 0:
            raise ClusterSetupError(
                "device is cuda but PyTorch sees no GPU on this machine (torch.cuda.is_available() is False): set device "
                "to cpu for CPU ranks, or install a CUDA build of PyTorch"
            )
        if gpu_ids:
            missing = [g for g in gpu_ids if g >= m.gpus]
            if missing:
                raise ClusterSetupError(
                    f"gpu_ids lists GPU(s) {missing}, but this machine has {m.gpus} GPU(s), numbered 0 to {m.gpus - 1}: "
                    "list GPUs from that range, or leave gpu_ids empty"
                )
        if n > m.gpus:
            if device == "auto":
                # auto falls back to CPU ranks only when there is no GPU; with some GPUs, too many ranks is a mistake
                hint = f"set num_ranks to at most {m.gpus} (one rank per GPU), or device to cpu for CPU ranks"
            else:
                hint = f"set num_ranks to at most {m.gpus} (one rank per GPU)"
            raise ClusterSetupError(f"num_ranks is {n}, but this machine has {m.gpus} GPU(s) and each GPU rank needs its own: {hint}")
        return "cuda"
    limit = max_cpu_ranks(m)
    if n > limit:
        why = [f"{m.cores} CPU core(s) (at most {CPU_RANKS_PER_CORE} CPU ranks per core: more only take turns)"]
        if m.available_bytes is not None:
            why.append(f"{_gib(m.available_bytes)} free memory (each CPU rank process holds about {_gib(CPU_RANK_BYTES)} "
                       "before any model)")
        raise ClusterSetupError(
            f"num_ranks is {n} CPU ranks, but this machine holds at most {limit}: it has " + " and ".join(why)
            + f"; set num_ranks to {limit} or fewer"
        )
    return "cpu"
