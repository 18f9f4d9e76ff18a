"""A multi-node Ray cluster on this machine, every node on loopback, for the multi-node tests.

Run as a script: ``python ray_nodes.py '<json spec>'``. It starts a head and the worker nodes the spec lists
(each its own raylet with its own CPUs, resources and environment), prints one JSON line
``{"address": "127.0.0.1:<port>", "pids": [...]}`` and then obeys one command per line on stdin:

* ``ray_version <v>``: rewrite the cluster's recorded Ray version (the metadata Ray checks when a driver
  connects), so a driver sees a cluster "started with Ray <v>"; ``ray_version restore`` puts the real one back;
* end of input: stop every node and exit.

Why not ``ray start`` twice: a head started with ``ray start --node-ip-address 127.0.0.1`` stays on loopback only
with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and ``ray start --address ...`` refuses to add a node under that
setting. Ray's own test utility (``ray.cluster_utils.Cluster``) starts the same head and raylet processes without
that refusal, so every node keeps 127.0.0.1 and nothing listens on another interface.
"""

import json
import os
import sys

# before Ray is imported: Ray keeps 127.0.0.1 as the node address only with this setting
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _descendants():
    import psutil

    return sorted(p.pid for p in psutil.Process().children(recursive=True))


def main(spec_json: str) -> None:
    import ray._private.ray_constants as ray_constants
    import ray._common.usage.usage_constants as usage_constant
    from ray._common.usage import usage_lib
    from ray.cluster_utils import Cluster

    spec = json.loads(spec_json)
    nodes = spec["nodes"]
    common = dict(node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=80 << 20)

    def node_args(node):
        return dict(common, num_cpus=node.get("num_cpus", 1), resources=node.get("resources", {}))

    cluster = Cluster(initialize_head=True, head_node_args=node_args(nodes[0]))
    base_env = dict(os.environ)
    for node in nodes[1:]:
        # a raylet passes its environment on to the workers it starts: this is how a node differs
        os.environ.update(node.get("env", {}))
        try:
            cluster.add_node(**node_args(node))
        finally:
            os.environ.clear()
            os.environ.update(base_env)
    cluster.wait_for_nodes()
    gcs = cluster.head_node.get_gcs_client()
    real_metadata = usage_lib.get_cluster_metadata(gcs)

    def put_metadata(meta):
        gcs.internal_kv_put(
            usage_constant.CLUSTER_METADATA_KEY, json.dumps(meta).encode(), overwrite=True, namespace=ray_constants.KV_NAMESPACE_CLUSTER
        )

    print(json.dumps({"address": cluster.address, "pids": _descendants()}), flush=True)
    try:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "ray_version":
                put_metadata(real_metadata if arg == "restore" else dict(real_metadata, ray_version=arg))
            print(json.dumps({"done": cmd, "pids": _descendants()}), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
