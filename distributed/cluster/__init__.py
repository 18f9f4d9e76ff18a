"""The rank cluster: Ray actors that each host one rank of one ``torch.distributed`` group.

The package is split along its seams; this module re-exports the public names:

* ``config``    :class:`ClusterConfig`, the one validated configuration (every bound is a field);
* ``ray_setup`` starting the embedded Ray (loopback only, no dashboard) or connecting to an existing cluster,
  with bounded, actionable connection errors;
* ``actor``     the rank actor: device, rendezvous (FileStore on one machine, TCPStore across nodes),
  :func:`rank_cache`, :func:`report_progress`;
* ``ranks``     :class:`RankCluster`: placement, version checks, run-on-all, faults, progress;
* ``registry``  :func:`get_cluster` / :func:`running_cluster` / :func:`shutdown_cluster` keep one cluster per process;
* ``errors``    :class:`RankFailure`, :class:`ClusterSetupError`, clean messages from Ray's errors;
* ``imports``   how the ranks import the library and the functions sent to them;
* ``check``     :func:`check_cluster`, the probe's collective and bandwidth check;
* ``limits``    :func:`check_rank_count`: how many GPU or CPU ranks this machine holds, checked before Ray starts;
* ``watchdog``  the embedded Ray's GCS and raylet, watched: a dead one costs the prompt in flight, not the process.

Example:
    >>> from patchray.distributed.cluster import ClusterConfig, get_cluster  # doctest: +SKIP
    >>> cluster = get_cluster(ClusterConfig(num_ranks=2, device="cpu"))  # doctest: +SKIP
    >>> cluster.run(my_module.my_fn, 3)  # my_fn(ctx, 3) on both ranks, results in rank order  # doctest: +SKIP
"""

from .actor import rank_cache, report_progress
from .check import check_cluster
from .config import ClusterConfig
from .errors import ClusterSetupError, RankFailure, caused_by
from .imports import fn_ref, resolve_fn
from .limits import check_rank_count
from .ranks import RankCluster
from .registry import free_rank_caches, get_cluster, running_cluster, shutdown_cluster

__all__ = [
    "ClusterConfig",
    "RankCluster",
    "RankFailure",
    "ClusterSetupError",
    "get_cluster",
    "running_cluster",
    "shutdown_cluster",
    "free_rank_caches",
    "check_rank_count",
    "check_cluster",
    "rank_cache",
    "report_progress",
    "caused_by",
    "fn_ref",
    "resolve_fn",
]
