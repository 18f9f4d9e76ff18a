"""A per-rank memory cap (``ClusterConfig.rank_memory_mb``), enforced on each rank while a call runs.

Why: a rank that runs out of memory must be recoverable (the VAE decode retries with smaller pieces), and that
path must be testable on CPU ranks, where nothing runs out by itself. The cap bounds what one call may allocate
on a rank *beyond what the rank held when the call started* (so a cached model does not count once it is loaded;
on the call that loads it, it does).

Design decisions:

* **The same error as a full card.** Passing the cap raises ``torch.OutOfMemoryError``, the class
  ``torch.cuda.OutOfMemoryError`` is an alias of, so every caller handles a capped rank and a full GPU alike.
* **On a GPU the cap is torch's own allocator limit**: ``torch.cuda.set_per_process_memory_fraction`` set to
  (allocated at the call's start + cap) / card size for the call, restored after it. The caching allocator then
  refuses exactly as it does on a full card.
* **On CPU torch has no allocator limit**, so the rank counts: a ``TorchDispatchMode`` sees every operator's
  outputs, counts each new storage's bytes once (views and in-place results share a storage) and uncounts it
  when the storage is freed (a weak reference on the storage, which torch keeps alive exactly as long as the
  memory). An operator whose outputs push the live total past the cap raises. This is the accounting
  ``torch.distributed._tools.MemTracker`` uses, reduced to one counter; it costs a Python call per operator,
  which is why it is only active when a cap is set.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["memory_cap"]

_MB = 1 << 20


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created under it; raises ``torch.OutOfMemoryError`` past ``cap`` bytes."""

    def __init__(self, cap: int, rank: int):
        super().__init__()
        self.cap, self.rank = int(cap), rank
        self.live = 0
        self.peak = 0
        self._sizes = {}  # id of a live storage -> its bytes
        self._lock = threading.Lock()  # storages may be freed from another thread (gloo's work objects)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            with self._lock:
                if key in self._sizes:
                    continue
                nbytes = int(storage.nbytes())
                self._sizes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                over = self.live > self.cap
            weakref.finalize(storage, self._freed, key)
            if over:
                raise torch.OutOfMemoryError(
                    f"rank {self.rank} ran out of memory: {func} needed {nbytes / _MB:.1f} MiB more with "
                    f"{(self.live - nbytes) / _MB:.1f} MiB in use, past the cluster's rank_memory_mb cap of "
                    f"{self.cap / _MB:g} MiB: raise rank_memory_mb, or give each rank less to hold (a smaller latent or "
                    f"batch, more ranks)"
                )
        return out


@contextlib.contextmanager
def memory_cap(rank_memory_mb: Optional[float], device: torch.device, rank: int = 0) -> Iterator[None]:
    """Enforce ``rank_memory_mb`` (``None``: no cap) on ``device`` for the duration of the block.

    Raises:
        torch.OutOfMemoryError: from inside the block, when its allocations pass the cap.
    """
    if rank_memory_mb is None:
        yield
        return
    cap = int(float(rank_memory_mb) * _MB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, (torch.cuda.memory_allocated(device) + cap) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    with _LiveBytes(cap, rank):
        yield
