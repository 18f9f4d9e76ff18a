"""How the rank cluster is built: one frozen, validated configuration.

Design decision: every bound (connecting, placing, forming the group, one call) is a field here, so a user
who waits too long or not long enough changes one value, and a configuration is compared by value to decide
whether the process-wide cluster can be reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ClusterConfig"]


@dataclass(frozen=True)
class ClusterConfig:
    """How to build the rank cluster.

    Args:
        num_ranks: number of ranks (one process each). Default 2.
        device: ``"auto"`` (GPU ranks when the Ray cluster has GPUs, else CPU ranks), ``"cuda"`` or ``"cpu"``.
        address: an existing Ray cluster's address (``"auto"``, ``"host:6379"``, ``"ray://host:10001"``);
            ``None`` starts an embedded local Ray bound to 127.0.0.1.
        strategy: placement-group strategy, ``"PACK"`` (default: ranks on as few nodes as possible) or ``"SPREAD"``.
        init_timeout_s: bound on starting the rank actors and forming the process group.
        connect_timeout_s: bound on reaching an existing Ray cluster (``address=``) and on placing the ranks
            on its nodes; past it PatchRay reports what is missing instead of waiting. Default 30 s.
        call_timeout_s: default bound on one :meth:`RankCluster.run` call.
        extra_pythonpath: extra import paths for the rank processes (e.g. the checkout of an application whose code the ranks run).
        object_store_mb: embedded Ray's object store size; ``None`` sizes it from this machine's memory.
        dashboard: start Ray's dashboard (embedded mode only; off by default, bound to 127.0.0.1 when on).
        gpu_ids: embedded mode only: the physical GPUs the ranks may use (one per rank, e.g. ``(1, 2)``);
            empty lets Ray pick. The embedded Ray is started seeing only these GPUs.
        rank_memory_mb: a cap on what one call may allocate on each rank beyond what the rank already held
            (``None``: no cap). Past it the rank raises ``torch.OutOfMemoryError``, as a full GPU does; see
            ``memory.py``. For sharing a GPU with other work, and for exercising out-of-memory recovery on CPU ranks.
        ranks_per_gpu: GPU ranks only: how many ranks share one GPU (default 1: each rank its own GPU). Above 1 the
            ranks split the card's memory and compute and meet through gloo (NCCL refuses two ranks on one GPU): for
            trying a multi-rank setup, its faults and its memory on one card, not for speed.
        rank_threads: CPU ranks only: the compute threads of each rank (one count per rank, e.g. ``(2, 1)``);
            empty gives each rank this machine's cores divided by the rank count. Unequal counts make ranks of
            unequal speed on one machine (what speed-weighted bands are for, shown on CPU).

    Example:
        >>> cfg = ClusterConfig(num_ranks=2, device="cpu")
    """

    num_ranks: int = 2
    device: str = "auto"
    address: Optional[str] = None
    strategy: str = "PACK"
    init_timeout_s: float = 120.0
    call_timeout_s: float = 1800.0
    extra_pythonpath: tuple = ()
    object_store_mb: Optional[int] = None
    dashboard: bool = False
    gpu_ids: tuple = ()
    connect_timeout_s: float = 30.0
    rank_memory_mb: Optional[float] = None
    rank_threads: tuple = ()
    ranks_per_gpu: int = 1

    def __post_init__(self):
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1 (got {self.num_ranks!r})")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu' (got {self.device!r})")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (got {self.strategy!r})")
        for name in ("init_timeout_s", "call_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds (got {value!r})")
        if self.rank_memory_mb is not None and (not isinstance(self.rank_memory_mb, (int, float)) or self.rank_memory_mb <= 0):
            raise ValueError(f"rank_memory_mb must be a positive number of MiB or None (got {self.rank_memory_mb!r})")
        if not isinstance(self.ranks_per_gpu, int) or isinstance(self.ranks_per_gpu, bool) or self.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu must be an integer >= 1 (got {self.ranks_per_gpu!r})")
        if self.ranks_per_gpu > 1 and self.device == "cpu":
            raise ValueError("ranks_per_gpu shares GPUs, but device is 'cpu': drop ranks_per_gpu or use device='cuda'")
        if self.ranks_per_gpu > 1 and self.gpu_ids:
            raise ValueError("gpu_ids pins one GPU per rank; ranks_per_gpu shares them: use one of the two")
        object.__setattr__(self, "extra_pythonpath", tuple(self.extra_pythonpath))
        object.__setattr__(self, "gpu_ids", tuple(self.gpu_ids))
        object.__setattr__(self, "rank_threads", tuple(self.rank_threads))
        if self.rank_threads:
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.rank_threads):
                raise ValueError(f"rank_threads must be thread counts >= 1, one per rank (got {self.rank_threads!r})")
            if len(self.rank_threads) != self.num_ranks:
                raise ValueError(f"rank_threads lists {len(self.rank_threads)} count(s) for {self.num_ranks} ranks: list one per rank")
            if self.device == "cuda":
                raise ValueError("rank_threads sets CPU ranks' threads, but device is 'cuda': drop rank_threads or use device='cpu'")
        if self.gpu_ids:
            if any(not isinstance(g, int) or g < 0 for g in self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids):
                raise ValueError(f"gpu_ids must be distinct GPU indices >= 0 (got {self.gpu_ids!r})")
            if len(self.gpu_ids) != self.num_ranks:
                raise ValueError(f"gpu_ids lists {len(self.gpu_ids)} GPU(s) for {self.num_ranks} ranks: list one GPU per rank")
            if self.device == "cpu":
                raise ValueError("gpu_ids pins GPUs, but device is 'cpu': drop gpu_ids or use device='cuda'")
            if self.address is not None:
                raise ValueError(
                    "gpu_ids applies to the embedded cluster only; on an existing Ray cluster choose GPUs with "
                    "Ray's own resources (CUDA_VISIBLE_DEVICES when starting its nodes)"
                )
