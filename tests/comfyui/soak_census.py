"""What one process holds, for the soak harness's memory report (``soak.py --census-every``).

Run on every rank by the test-only ``PatchRaySoakRankCensus`` node (``soak_nodes.py``) and in ComfyUI's own process:
resident memory, the torch tensors reachable from Python (count and bytes, CPU and GPU apart) and the Python objects
the garbage collector tracks. A rank whose resident memory grows while these stay flat holds memory outside Python's
reach (the allocator's arenas); one whose tensor bytes grow keeps a prompt's tensors.
"""

from __future__ import annotations

import gc
import os


def census(ctx) -> dict:
    """The census of this process; ``ctx`` is the rank's context (only ``ctx.rank`` is read)."""
    import torch

    gc.collect()
    tensors, cpu_bytes, gpu_bytes, objects = 0, 0, 0, 0
    for obj in gc.get_objects():
        objects += 1
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            size = obj.untyped_storage().nbytes() if obj.layout == torch.strided else 0
        except Exception:  # a tensor without storage (meta, a subclass that refuses): counted, no bytes
            size = 0
        tensors += 1
        if obj.device.type == "cpu":
            cpu_bytes += size
        else:
            gpu_bytes += size
    rss = None
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    return {"rank": getattr(ctx, "rank", None), "pid": os.getpid(), "rss_mb": round(rss / 2**20, 1) if rss else None,
            "tensors": tensors, "tensor_cpu_mb": round(cpu_bytes / 2**20, 1), "tensor_gpu_mb": round(gpu_bytes / 2**20, 1),
            "python_objects": objects}
