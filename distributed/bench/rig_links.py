"""Link profiles for the rig model: the runtime's table (:data:`..topology.links.LINK_PROFILES`) and the same rules
applied to the PCIe generations and widths, NVLink generations and network classes it does not name.

Design decisions:

* **One table.** The five profiles of ``topology/links.py`` (``nvlink``, ``pcie4_x16_p2p``, ``pcie4_x16_no_p2p``,
  ``pcie3_x8``, ``10gbe``) are taken as they are (the same objects); only the missing ones are added here, each
  derived by that module's rules and constants, never re-typed: PCIe at the signalling rate (GT/s x lanes x
  128/130, 8 bits a byte) times the copy efficiency measured on the H200 host (``links._PCIE_EFFICIENCY``, 0.88);
  without peer-to-peer the profile is marked ``via_host`` and the link model counts every transfer twice (device ->
  host -> device), as for ``pcie4_x16_no_p2p``; NVLink at its one-way rate times the 0.8 NCCL reaches (the
  ``nvlink`` profile's rule); Ethernet at the line rate times TCP's payload per 1500-byte frame (the ``10gbe``
  profile's rule). ``pcie3_x8`` (peer-to-peer) keeps its name; its twin without peer-to-peer is ``pcie3_x8_no_p2p``.
* **A link is bounded by the card.** A PCIe link of a newer generation or more lanes than the card's own interface
  runs at the card's (:func:`effective_link`); an NVLink profile is valid only on cards that have that NVLink, and a
  bridge joins two cards only.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..topology.links import _PCIE_EFFICIENCY, LINK_PROFILES, LinkProfile
from .rig_cards import CardProfile

__all__ = ["RIG_LINKS", "get_link", "pcie_profile", "effective_link", "host_link", "links_for"]

#: PCIe signalling per lane and direction, GT/s (PCI-SIG base specifications 3.0, 4.0, 5.0); 128b/130b encoding
_PCIE_GTS = {3: 8.0, 4: 16.0, 5: 32.0}
#: PCI-SIG's one-way x16 rates as it quotes them (GT/s x 16 x 128/130 / 8, rounded: 15.75, 31.5, 63.0 GB/s), the
#: figures topology/links.py starts from (31.5 for PCIe 4.0 x16, 7.88 for PCIe 3.0 x8)
_PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}
#: the share of NVLink's one-way rate NCCL reaches (the ``nvlink`` profile's rule: 360 of 450 GB/s)
_NVLINK_NCCL = LINK_PROFILES["nvlink"].bandwidth_gbps / 450.0
#: TCP payload per 1500-byte Ethernet frame (the ``10gbe`` profile's rule: 1448 of 1538 bytes on the wire)
_TCP_PAYLOAD = 1448 / 1538


def _pcie_raw_gbps(gen: int, lanes: int) -> float:
    return _PCIE_X16_GBPS[gen] * lanes / 16


def pcie_profile(gen: int, lanes: int, p2p: bool) -> LinkProfile:
    """The PCIe profile of a generation, width and peer-to-peer status: the runtime's where it names one, else one
    derived by its rules (achievable rate = signalling rate x 0.88; 10 us per message with peer-to-peer, 20 us and
    ``via_host`` without)."""
    name = f"pcie{gen}_x{lanes}_{'p2p' if p2p else 'no_p2p'}"
    if name in LINK_PROFILES:
        return LINK_PROFILES[name]
    if (gen, lanes, p2p) == (3, 8, True):
        return LINK_PROFILES["pcie3_x8"]
    raw = _pcie_raw_gbps(gen, lanes)
    how = ("GPU peer-to-peer, one copy" if p2p else
           "without GPU peer-to-peer: device -> host -> device, two copies (the transfer counts twice)")
    return LinkProfile(name, round(raw * _PCIE_EFFICIENCY, 1), 10.0 if p2p else 20.0, not p2p,
                       f"PCIe {gen}.0 x{lanes}: {_PCIE_GTS[gen]:g} GT/s x {lanes} x 128/130 = {raw:g} GB/s one way "
                       f"(PCI-SIG), times the 0.88 copy efficiency measured on the H200 host; {how}")


def _nvlink(name: str, both_ways_gbps: float, what: str) -> LinkProfile:
    one_way = both_ways_gbps / 2
    return LinkProfile(name, round(one_way * _NVLINK_NCCL, 1), 5.0, False,
                       f"{what}: {both_ways_gbps:g} GB/s both directions = {one_way:g} GB/s one way, times the 0.8 NCCL "
                       f"reaches (the nvlink profile's rule)")


def _ethernet(name: str, gbit: float) -> LinkProfile:
    return LinkProfile(name, round(gbit / 8 * _TCP_PAYLOAD, 2), 50.0, False,
                       f"{gbit:g} Gigabit Ethernet between machines: {gbit / 8:g} GB/s, times TCP's payload per 1500-byte "
                       f"frame (1448 of 1538 bytes; the 10gbe profile's rule); ~50 us per TCP message")


def _build() -> Dict[str, LinkProfile]:
    out: Dict[str, LinkProfile] = dict(LINK_PROFILES)  # the runtime's profiles, the same objects
    for gen in (3, 4, 5):
        for lanes in (8, 16):
            for p2p in (True, False):
                p = pcie_profile(gen, lanes, p2p)
                out.setdefault(p.name, p)
    for p in (
        _nvlink("nvlink_a100", 600.0, "NVLink 3 (A100 SXM; NVIDIA A100 datasheet)"),
        _nvlink("nvlink_bridge_h100", 600.0, "NVLink bridge of two H100 PCIe cards (NVIDIA H100 datasheet)"),
        _nvlink("nvlink_bridge_ampere", 112.5,
                "NVLink 3 bridge of two RTX 3090 / RTX A6000 cards (NVIDIA GA102 whitepaper, RTX A6000 datasheet)"),
        _ethernet("25gbe", 25.0),
        _ethernet("100gbe", 100.0),
        LinkProfile("ib_hdr", round(25.0 * _PCIE_EFFICIENCY, 1), 5.0, False,
                    "InfiniBand HDR between machines: 200 Gb/s = 25 GB/s one way (data rate), times the 0.88 copy "
                    "efficiency; GPUDirect RDMA assumed (no host staging); ~5 us per message"),
        LinkProfile("ib_ndr", round(50.0 * _PCIE_EFFICIENCY, 1), 5.0, False,
                    "InfiniBand NDR between machines: 400 Gb/s = 50 GB/s one way (data rate), times the 0.88 copy "
                    "efficiency; GPUDirect RDMA assumed (no host staging); ~5 us per message"),
    ):
        out[p.name] = p
    return out


#: every link the rig model knows: the runtime's five and the derived ones
RIG_LINKS: Dict[str, LinkProfile] = _build()
#: NVLink profiles that join two cards only
_BRIDGES = ("nvlink_bridge_h100", "nvlink_bridge_ampere")
_NVLINKS = ("nvlink", "nvlink_a100") + _BRIDGES
_NETWORK = ("10gbe", "25gbe", "100gbe", "ib_hdr", "ib_ndr")


def get_link(name) -> LinkProfile:
    """A link by name (or the profile itself); ``ValueError`` naming the valid links otherwise."""
    if isinstance(name, LinkProfile):
        return name
    try:
        return RIG_LINKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown link {name!r}; valid links: {', '.join(RIG_LINKS)}") from None


def _pcie_parts(name: str) -> Optional[Tuple[int, int, bool]]:
    p = get_link(name)
    if not p.name.startswith("pcie"):
        return None
    if p.name == "pcie3_x8":
        return 3, 8, True
    gen, lanes, *rest = p.name[4:].split("_")
    return int(gen), int(lanes[1:]), rest == ["p2p"]


def links_for(card: CardProfile, ranks: int = 2) -> List[str]:
    """The links valid for ``ranks`` cards of this kind: every PCIe and network profile, the card's own NVLink."""
    out = [n for n in RIG_LINKS if n.startswith("pcie") or n in _NETWORK]
    if card.nvlink and (ranks <= 2 or card.nvlink not in _BRIDGES):
        out.append(card.nvlink)
    return out


def effective_link(card: CardProfile, name, ranks: int = 2) -> Tuple[LinkProfile, List[str]]:
    """The profile ``ranks`` cards of this kind get on link ``name``, and notes on what changed.

    Raises ``ValueError`` (naming the valid links) for an NVLink the card does not have, or a bridge for more than two.
    """
    p = get_link(name)
    notes: List[str] = []
    if p.name in _NVLINKS:
        if p.name != card.nvlink:
            raise ValueError(f"the {card.title} has no {p.name} link; valid links for it: {', '.join(links_for(card, ranks))}")
        if p.name in _BRIDGES and ranks > 2:
            raise ValueError(f"an NVLink bridge joins two cards, not {ranks}: the ranks would also cross PCIe; give the PCIe "
                             f"link instead (valid links for {ranks} x {card.title}: {', '.join(links_for(card, ranks))})")
        return p, notes
    parts = _pcie_parts(p.name)
    if parts is None:
        return p, notes
    gen, lanes, p2p = parts
    if p2p and not card.pcie_p2p:
        notes.append(f"NVIDIA's driver does not enable PCIe peer-to-peer on the {card.title} (NVIDIA/nccl#1309; a patched "
                     f"kernel module does): the figures assume it works")
    g, w = min(gen, card.pcie_gen), min(lanes, card.pcie_lanes)
    if (g, w) != (gen, lanes):
        notes.append(f"the {card.title}'s own interface is PCIe {card.pcie_gen}.0 x{card.pcie_lanes}: "
                     f"{p.name} runs as PCIe {g}.0 x{w}")
        p = pcie_profile(g, w, p2p)
    return p, notes


def host_link(card: CardProfile) -> LinkProfile:
    """The card's own host -> device copy path (offload, pinned copies): its PCIe interface, one copy."""
    return pcie_profile(card.pcie_gen, card.pcie_lanes, True)
