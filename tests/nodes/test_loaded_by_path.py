"""The pack loaded the way ComfyUI loads custom nodes (module name = the folder's path) still runs its ranks."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_session")

ROOT = Path(__file__).resolve().parents[2]


def test_nodes_use_the_canonical_library_and_start_ranks(tmp_path):
    link = tmp_path / "custom_nodes" / "PatchRay"
    link.parent.mkdir()
    link.symlink_to(ROOT)
    name = str(link)  # ComfyUI: importlib.util.spec_from_file_location(<full path>, <dir>/__init__.py)
    spec = importlib.util.spec_from_file_location(name, str(link / "__init__.py"), submodule_search_locations=[str(link)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[name] = pack
    try:
        spec.loader.exec_module(pack)
        ext = asyncio.run(pack.comfy_entrypoint())
        nodes = asyncio.run(ext.get_node_list())
        cluster_node = next(n for n in nodes if n.define_schema().node_id == "PatchRayCluster")
        assert cluster_node.__module__ == f"{name}.nodes.cluster"
        config = cluster_node.execute(num_ranks=2, device="cpu", address="", gpu_ids="").args[0]
        # the library is one module object under its canonical name: Ray can pickle it by reference
        import patchray.distributed.cluster as canonical

        assert sys.modules[f"{name}.distributed.cluster"] is canonical
        assert type(config) is canonical.ClusterConfig
        check = canonical.check_cluster(config)  # a real all_reduce and neighbour exchange on the ranks
        assert check["ready_ranks"] == 2 and check["all_reduce_ok"] and check["p2p_ok"]
        # the bridge passes its rank functions themselves: they travel by the name the ranks import
        rank_module = importlib.import_module(f"{name}.nodes.bridge.ksampler_rank")
        assert rank_module.__name__ != "patchray.nodes.bridge.ksampler_rank"
        assert canonical.fn_ref(rank_module.sample) == "patchray.nodes.bridge.ksampler_rank:sample"
        assert canonical.resolve_fn(canonical.fn_ref(rank_module.device_memory)).__module__ == "patchray.nodes.bridge.ksampler_rank"
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_only_the_packaged_folders_travel_by_name():
    from patchray.distributed.cluster import fn_ref
    from patchray.distributed.sampling.ship import ship_model

    from ..distributed import remote_tasks  # a test module: in the checkout, not in the package the ranks import

    assert fn_ref(ship_model) == "patchray.distributed.sampling.ship:ship_model"
    assert fn_ref(remote_tasks.begin) is remote_tasks.begin
    assert fn_ref(print) is print and fn_ref("patchray.x:y") == "patchray.x:y"


def test_the_shim_and_the_cluster_stage_one_folder():
    """The node layer's shim (run before ``patchray`` is importable) and the cluster (the ranks' import path) use one
    staging helper: the same folder, holding only a ``patchray`` link to this pack."""
    import importlib.machinery
    import os

    from patchray.distributed.cluster import imports
    from patchray.nodes.bridge import shim

    root = imports.staging_dir()
    assert shim._STAGING.staging_dir() == root
    assert os.listdir(root) == ["patchray"]
    assert os.path.realpath(os.path.join(root, "patchray")) == os.path.realpath(ROOT)
    assert imports.is_this_pack(importlib.machinery.PathFinder.find_spec("patchray", [root]))
    assert not imports.is_this_pack(None)
