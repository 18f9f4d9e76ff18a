"""The embedded Ray listens on loopback only (the measurement behind the README's security section)."""

import ipaddress

import psutil
import pytest

from patchray.distributed.cluster import ClusterConfig, get_cluster

pytestmark = pytest.mark.usefixtures("ray_session")


def _listeners_of(pids):
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append((conn.pid, conn.laddr.ip, conn.laddr.port))
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_embedded_ray_binds_loopback_only():
    import ray

    get_cluster(ClusterConfig(num_ranks=2, device="cpu"))
    assert ray.is_initialized()
    me = psutil.Process()
    # the embedded Ray's processes (GCS, raylet, agents, workers, rank actors) descend from this process
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    listeners = _listeners_of(pids)
    assert listeners, "expected the embedded Ray to listen somewhere (GCS, raylet)"
    exposed = [(pid, ip, port, psutil.Process(pid).name()) for pid, ip, port in listeners if not _is_loopback(ip)]
    assert not exposed, f"listeners outside loopback: {exposed}"
