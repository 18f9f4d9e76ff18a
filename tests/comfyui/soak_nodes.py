"""Test-only ComfyUI nodes the soak harness (``soak.py``) installs beside PatchRay in its private server.

Copied as ``custom_nodes/patchray_soak_nodes/__init__.py`` of the soak server's base directory; never part of the pack.

* ``PatchRaySoakNaNLatent``: a LATENT with NaNs written into it (all of it, or one element), to check that a NaN
  latent is refused or carried as the stock nodes carry it, never a hang.
* ``PatchRaySoakCappedCluster``: a PatchRay cluster handle whose ranks have a per-rank memory cap
  (``ClusterConfig.rank_memory_mb``), which the Cluster node does not offer: a rank out of memory on demand.
* ``PatchRaySoakRankCensus``: what each rank of the running cluster holds (``soak_census.py``), for the memory report.
"""


class PatchRaySoakNaNLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "where": (["all", "one"],)}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "poison"
    CATEGORY = "testing"

    def poison(self, samples, where):
        z = samples["samples"].clone()
        if where == "all":
            z.fill_(float("nan"))
        else:
            z.view(-1)[z.numel() // 2] = float("nan")
        return (dict(samples, samples=z),)


class PatchRaySoakCappedCluster:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"num_ranks": ("INT", {"default": 2, "min": 1, "max": 8}),
                             "rank_memory_mb": ("FLOAT", {"default": 64.0, "min": 1.0, "max": 1e6})}}

    RETURN_TYPES = ("PATCHRAY_CLUSTER",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, num_ranks, rank_memory_mb):
        from patchray.distributed.cluster import ClusterConfig

        return (ClusterConfig(num_ranks=int(num_ranks), device="cpu", rank_memory_mb=float(rank_memory_mb)),)


class PatchRaySoakRankCensus:
    """What each rank of the running PatchRay cluster holds (``soak_census.census``; nothing when no cluster runs), and
    ComfyUI's own process."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "census"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")  # never equal to itself: runs every time

    def census(self, tag):
        from patchray.distributed.cluster import registry

        from patchray.tests.comfyui.soak_census import census

        cluster = registry._current
        ranks = None
        if cluster is not None and not cluster.broken:
            ranks = cluster.run("patchray.tests.comfyui.soak_census:census", timeout_s=180)
        driver = census(type("Driver", (), {"rank": "ComfyUI"})())  # the same census of ComfyUI's own process
        return {"ui": {"census": [{"tag": tag, "ranks": ranks, "driver": driver}]}}


NODE_CLASS_MAPPINGS = {
    "PatchRaySoakRankCensus": PatchRaySoakRankCensus,
    "PatchRaySoakNaNLatent": PatchRaySoakNaNLatent,
    "PatchRaySoakCappedCluster": PatchRaySoakCappedCluster,
}
