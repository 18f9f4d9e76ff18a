"""Card profiles for the rig model (``python -m patchray plan-rig``): vendors' datasheet figures, one row per card.

Design decisions:

* **Dense, not sparse.** NVIDIA's datasheets print tensor throughput "with sparsity" (2:4 structured); diffusion
  transformers run dense GEMMs, so every figure here is the dense one (the sparse figure halved where the sheet
  gives only that). GeForce cards run FP16/BF16 GEMMs with FP32 accumulation (what PyTorch's bf16 matmul uses) at
  half their FP16-accumulate rate; the figures below are the FP32-accumulate ones. Workstation and data-centre cards
  run FP32 accumulation at full rate.
* **fp8**: the dense FP8 tensor rate (FP32 accumulation) where the card has FP8 tensor cores (Ada, Hopper,
  Blackwell); ``None`` where it has none (Ampere, Intel Xe2): fp8 weights are then a storage format and the GEMMs run
  at the bf16 rate.
* **Memory** is the datasheet's size read as GiB (GDDR and HBM parts are binary-sized; a card reports 0.5-6 % less
  to the process: ECC, driver reservations); the rig model's fit rule keeps 1 GiB aside for the CUDA context.
* **Host interface** (PCIe generation and lanes) bounds the link a card can use (a PCIe 5.0 link runs at 4.0 on a
  4.0 card) and its host -> device copies (offload). ``nvlink`` names the NVLink profile the card can use (in
  :mod:`.rig_links`); ``pcie_p2p`` is whether NVIDIA's driver enables PCIe peer-to-peer on it (not on GeForce cards:
  NVIDIA/nccl#1309).

Every row names its source. Nothing here is measured by PatchRay.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

__all__ = ["CardProfile", "CARDS", "REFERENCE_CARD", "get_card"]


class CardProfile(NamedTuple):
    """One GPU model.

    Args:
        key: the ``--card`` name.
        title: the product name.
        bf16_tflops: dense BF16 tensor throughput (FP32 accumulation), TFLOP/s.
        fp8_tflops: dense FP8 tensor throughput (FP32 accumulation), TFLOP/s; ``None``: no FP8 tensor cores.
        memory_gib: device memory (datasheet size, read as GiB).
        bandwidth_gbps: device memory bandwidth, GB/s.
        pcie_gen, pcie_lanes: the card's host interface.
        nvlink: the :mod:`.rig_links` profile of its NVLink (``None``: none).
        pcie_p2p: NVIDIA's driver enables PCIe peer-to-peer on it.
        source: the datasheet the row comes from.
    """

    key: str
    title: str
    bf16_tflops: float
    fp8_tflops: Optional[float]
    memory_gib: float
    bandwidth_gbps: float
    pcie_gen: int
    pcie_lanes: int
    nvlink: Optional[str]
    pcie_p2p: bool
    source: str


CARDS: Dict[str, CardProfile] = {
    c.key: c
    for c in (
        # NVIDIA Ampere GA102 whitepaper, Appendix A (GeForce RTX 3090): FP16/BF16 tensor with FP32 accumulate 71 dense
        # (142 sparse); no FP8; 24 GB GDDR6X at 936 GB/s; PCIe 4.0 x16; NVLink 3 bridge (112.5 GB/s both directions)
        CardProfile("rtx3090", "GeForce RTX 3090", 71.0, None, 24, 936, 4, 16, "nvlink_bridge_ampere", False,
                    "NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A"),
        # NVIDIA Ada Lovelace architecture whitepaper, Appendix A (GeForce RTX 4090): FP16/BF16 with FP32 accumulate
        # 165.2 dense (330.4 sparse); FP8 with FP32 accumulate 330.3 dense (660.6 sparse); 24 GB GDDR6X, 1,008 GB/s
        CardProfile("rtx4090", "GeForce RTX 4090", 165.2, 330.3, 24, 1008, 4, 16, None, False,
                    "NVIDIA Ada GPU architecture whitepaper, Appendix A"),
        # NVIDIA RTX Blackwell GPU architecture whitepaper, Appendix A (GeForce RTX 5090): FP16/BF16 with FP32
        # accumulate 209.5 dense (419 sparse); FP8 with FP32 accumulate 419 dense (838 sparse); 32 GB GDDR7, 1,792 GB/s
        CardProfile("rtx5090", "GeForce RTX 5090", 209.5, 419.0, 32, 1792, 5, 16, None, False,
                    "NVIDIA RTX Blackwell GPU architecture whitepaper, Appendix A"),
        # NVIDIA RTX A6000 datasheet: tensor performance 309.7 TFLOPS (sparse) -> 154.8 dense FP16/BF16; no FP8;
        # 48 GB GDDR6, 768 GB/s; PCIe 4.0 x16; NVLink bridge 112.5 GB/s both directions
        CardProfile("rtx_a6000", "RTX A6000", 154.8, None, 48, 768, 4, 16, "nvlink_bridge_ampere", True,
                    "NVIDIA RTX A6000 datasheet"),
        # NVIDIA RTX 6000 Ada Generation datasheet: tensor performance 1,457 TFLOPS (FP8, sparse) -> 728.5 FP8 dense,
        # 364.2 BF16 dense; 48 GB GDDR6, 960 GB/s; PCIe 4.0 x16; no NVLink
        CardProfile("rtx6000_ada", "RTX 6000 Ada Generation", 364.2, 728.5, 48, 960, 4, 16, None, True,
                    "NVIDIA RTX 6000 Ada Generation datasheet"),
        # NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet: 4,000 AI TOPS (FP4, sparse) -> FP4 2,000 dense,
        # FP8 1,000 dense, BF16 500 dense; 96 GB GDDR7, 1,792 GB/s; PCIe 5.0 x16; no NVLink
        CardProfile("rtx_pro6000", "RTX PRO 6000 Blackwell Workstation Edition", 500.0, 1000.0, 96, 1792, 5, 16, None,
                    True, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet"),
        # NVIDIA L40S datasheet: BF16 tensor 362.05 dense (733 sparse); FP8 733 dense (1,466 sparse); 48 GB GDDR6,
        # 864 GB/s; PCIe 4.0 x16; no NVLink
        CardProfile("l40s", "L40S", 362.05, 733.0, 48, 864, 4, 16, None, True, "NVIDIA L40S datasheet"),
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor 312 dense (624 sparse); no FP8; A100 40GB SXM HBM2 1,555
        # GB/s; A100 80GB SXM HBM2e 2,039 GB/s; NVLink 3 600 GB/s both directions; host PCIe 4.0 x16
        CardProfile("a100_40gb", "A100 40GB SXM", 312.0, None, 40, 1555, 4, 16, "nvlink_a100", True,
                    "NVIDIA A100 Tensor Core GPU datasheet"),
        CardProfile("a100_80gb", "A100 80GB SXM", 312.0, None, 80, 2039, 4, 16, "nvlink_a100", True,
                    "NVIDIA A100 Tensor Core GPU datasheet"),
        # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM BF16 1,979 sparse -> 989.5 dense, FP8 3,958 sparse -> 1,979
        # dense, 80 GB HBM3 3.35 TB/s, NVLink 4 900 GB/s both directions; H100 PCIe BF16 1,513 sparse -> 756.5 dense,
        # FP8 3,026 sparse -> 1,513 dense, 80 GB HBM2e 2.0 TB/s, NVLink bridge 600 GB/s both directions; PCIe 5.0 x16
        CardProfile("h100_pcie", "H100 PCIe", 756.5, 1513.0, 80, 2000, 5, 16, "nvlink_bridge_h100", True,
                    "NVIDIA H100 Tensor Core GPU datasheet"),
        CardProfile("h100_sxm", "H100 SXM", 989.5, 1979.0, 80, 3350, 5, 16, "nvlink", True,
                    "NVIDIA H100 Tensor Core GPU datasheet"),
        # NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 sparse -> 989.5 dense, FP8 3,958 sparse -> 1,979 dense;
        # 141 GB HBM3e, 4.8 TB/s; NVLink 4 900 GB/s both directions; PCIe 5.0 x16 (the card PatchRay measured on)
        CardProfile("h200", "H200 SXM", 989.5, 1979.0, 141, 4800, 5, 16, "nvlink", True,
                    "NVIDIA H200 Tensor Core GPU datasheet"),
        # Two cards of published measurements the calibration uses:
        # NVIDIA RTX 2000 Ada Generation datasheet: tensor performance 191.9 TFLOPS (FP8, sparse) -> FP8 96 dense,
        # BF16 48 dense; 16 GB GDDR6, 224 GB/s; PCIe 4.0 x8
        CardProfile("rtx2000_ada", "RTX 2000 Ada Generation", 48.0, 96.0, 16, 224, 4, 8, None, True,
                    "NVIDIA RTX 2000 Ada Generation datasheet"),
        # Intel Arc B580 product specifications: 233 peak INT8 XMX TOPS (dense) -> 116.5 FP16/BF16 XMX TFLOPS; no FP8
        # XMX; 12 GB GDDR6, 456 GB/s; PCIe 4.0 x8. (An Intel card runs through oneAPI/IPEX, not CUDA: the H200's
        # kernel mix is a weaker basis for it.)
        CardProfile("arc_b580", "Intel Arc B580", 116.5, None, 12, 456, 4, 8, None, False,
                    "Intel Arc B580 product specifications"),
    )
}

#: the card the compute basis was measured on (results/h200/dit/): every other card's compute is scaled from it
REFERENCE_CARD = CARDS["h200"]


def get_card(key) -> CardProfile:
    """A card by its key (or the profile itself); ``ValueError`` naming the valid keys otherwise."""
    if isinstance(key, CardProfile):
        return key
    try:
        return CARDS[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown card {key!r}; valid cards: {', '.join(CARDS)}") from None
