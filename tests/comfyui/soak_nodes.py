"""Test-only ComfyUI nodes the soak harness (``soak.py``) installs beside PatchRay in its private server.

Copied as ``custom_nodes/patchray_soak_nodes/__init__.py`` of the soak server's base directory; never part of the pack.

* ``PatchRaySoakNaNLatent``: a LATENT with NaNs written into it (all of it, or one element), to check that a NaN
  latent is refused or carried as the stock nodes carry it, never a hang.
* ``PatchRaySoakCappedCluster``: a PatchRay cluster handle whose ranks have a per-rank memory cap
  (``ClusterConfig.rank_memory_mb``), which the Cluster node does not offer: a rank out of memory on demand.
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


NODE_CLASS_MAPPINGS = {
    "PatchRaySoakNaNLatent": PatchRaySoakNaNLatent,
    "PatchRaySoakCappedCluster": PatchRaySoakCappedCluster,
}
