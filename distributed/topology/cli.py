"""``python -m patchray probe``: this machine's (or a saved) GPU topology, the cluster check and advice.

Design decision: the same command serves two people. The user with the rig runs it bare (live probe, plus the
Ray cluster check with ``--ranks N``); a helper on another machine runs it with ``--topo-file``/``--p2p-file``
on the text the user pasted, and both see the same summary, advice, JSON and heatmap.

Exit status: 0 when the probe (and, with ``--ranks``, the cluster check) succeeded; 1 when the cluster check
failed or gave wrong results; 2 for unusable arguments or files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

__all__ = ["probe_main"]

_EPILOG = """\
to analyse another machine, save there:
  nvidia-smi topo -m > topo.txt
  nvidia-smi topo -p2p r > p2p_read.txt ; nvidia-smi topo -p2p w > p2p_write.txt
  nvidia-smi --query-gpu=index,name,pcie.link.gen.max,pcie.link.width.current --format=csv > gpus.csv
then: python -m patchray probe --topo-file topo.txt --p2p-file p2p_read.txt --p2p-file p2p_write.txt --gpus-file gpus.csv
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m patchray probe",
        description="GPU topology, P2P status, measured bandwidths, the Ray cluster check and PCIe-aware advice.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ranks", type=int, default=None, help="also form the Ray rank cluster with N ranks and check it")
    ap.add_argument("--cpu", action="store_true", help="cluster check on CPU ranks (gloo) even where GPUs exist")
    ap.add_argument("--address", default=None, help="existing Ray cluster address (default: embedded local Ray)")
    ap.add_argument("--json", action="store_true", help="print the JSON report (schema 1) instead of the summary")
    ap.add_argument("--out", default="patchray-report", help="folder for topology.json and topology.png (default: %(default)s)")
    ap.add_argument("--topo-file", default=None, help="saved 'nvidia-smi topo -m' output to analyse instead of this machine")
    ap.add_argument("--p2p-file", action="append", default=[],
                    help="saved 'nvidia-smi topo -p2p r' (then '... w') output; repeatable")
    ap.add_argument("--gpus-file", default=None, help="saved 'nvidia-smi -L' or '--query-gpu=... --format=csv' output")
    ap.add_argument("--no-measure", action="store_true", help="skip copy and NCCL bandwidth measurements")
    return ap


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _saved_label(path: str) -> str:
    """``.../rig-of-alice/topo.txt`` -> ``"rig-of-alice/topo.txt"``: names the machine in the report."""
    path = os.path.abspath(path)
    return f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}"


def _cluster_check(args) -> tuple:
    """Run the lead's cluster check; returns ``(cluster_dict, hosts_by_rank)``."""
    try:
        from ..cluster import ClusterConfig, check_cluster, get_cluster
    except ImportError as exc:  # the cluster module is missing or broken: say so, do not crash the probe
        return {"error": f"the rank cluster is not available: {exc}"}, []
    config = ClusterConfig(num_ranks=args.ranks, device="cpu" if args.cpu else "auto", address=args.address)
    try:
        result = check_cluster(config)
        info = get_cluster(config).describe()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "ranks": args.ranks}, []
    hosts = [r.get("host") for r in info.get("ranks", [])]
    if not args.no_measure and isinstance(result, dict):
        # each rank's throughput on the probe workload: what speed-weighted bands (balance="speed") are made of
        from .throughput import cached_rank_speeds, rank_speeds_task, speed_weights

        try:
            cluster = get_cluster(config)
            speeds = cached_rank_speeds(("rank-speed", repr(config)), lambda: cluster.run(rank_speeds_task, timeout_s=120)[0])
            result = dict(result, rank_speed_gflops=[round(x, 2) for x in speeds], balance_weights=list(speed_weights(speeds)))
        except Exception as exc:
            result = dict(result, rank_speed_error=f"{type(exc).__name__}: {exc}")
    return result, hosts


def _other_nodes(args, hosts: list) -> list:
    """Static topology of every other host in the cluster (one rank per host probes its node)."""
    from ..cluster import ClusterConfig, get_cluster
    from .probe import node_probe_on_rank
    from .report import node_from_dict

    first: dict = {}
    for rank, h in enumerate(hosts):
        first.setdefault(h, rank)
    config = ClusterConfig(num_ranks=args.ranks, device="cpu" if args.cpu else "auto", address=args.address)
    results = get_cluster(config).run(node_probe_on_rank, first, timeout_s=120)
    return [node_from_dict(d) for d in results if d]


def _inter_node_links(cluster: dict, hosts: list) -> list:
    """Neighbour-rank bandwidths of the cluster check that cross hosts are the links between nodes."""
    from .report import InterNodeLink

    out = []
    for key, gbps in (cluster.get("bandwidth_gbps") or {}).items():
        try:
            src, dst = (int(x) for x in key.split("->"))
        except ValueError:
            continue
        if max(src, dst) < len(hosts) and hosts[src] != hosts[dst]:
            out.append(InterNodeLink(hosts[dst], hosts[src], gbps, None, f"cluster check, rank {key} send"))
    return out


def probe_main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m patchray probe``; returns the exit status.

    Example::

        $ python -m patchray probe --topo-file topo.txt --p2p-file p2p.txt
        $ python -m patchray probe --ranks 3 --cpu --json
    """
    args = _parser().parse_args(argv)
    if args.ranks is not None and args.ranks < 1:
        print(f"--ranks must be >= 1 (got {args.ranks})", file=sys.stderr)
        return 2
    from .advice import advise
    from .probe import probe_topology, report_from_saved
    from .render import render_heatmap, summary_text

    status = 0
    if args.topo_file or args.p2p_file or args.gpus_file:
        if args.ranks is not None:
            print("--ranks checks this machine's cluster; it cannot be combined with --topo-file/--p2p-file", file=sys.stderr)
            return 2
        try:
            report = report_from_saved(
                _read(args.topo_file) if args.topo_file else None,
                [_read(p) for p in args.p2p_file],
                _read(args.gpus_file) if args.gpus_file else None,
                host=_saved_label(args.topo_file or (args.p2p_file[0] if args.p2p_file else args.gpus_file)),
            )
        except (OSError, ValueError) as exc:
            print(f"cannot analyse the saved output: {exc}", file=sys.stderr)
            return 2
    else:
        report = probe_topology(measure=not args.no_measure)
        if args.ranks is not None:
            cluster, hosts = _cluster_check(args)
            report.cluster = cluster
            if "error" in cluster or not (cluster.get("all_reduce_ok") and cluster.get("p2p_ok")):
                status = 1
            elif len(set(hosts)) > 1:
                report.inter_node = _inter_node_links(cluster, hosts)
                local = report.local.host if report.local else None
                try:
                    report.nodes.extend(n for n in _other_nodes(args, hosts) if n.host != local)
                except Exception as exc:
                    report.notes.append(f"other nodes not probed: {exc}")

    advice = advise(report)
    data = report.to_dict(advice=advice)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "topology.json")
    png_path = os.path.join(args.out, "topology.png")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=2)
    render_heatmap(report, png_path)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(summary_text(report, advice), end="")
        print(f"\nReport: {json_path}\nHeatmap: {png_path}")
    return status


if __name__ == "__main__":
    raise SystemExit(probe_main())
