"""The compact stdout view of benchmark records (the JSON is the result; this is for reading at a terminal).

Design decision: one line per case, fixed columns, the numbers a reader compares first (latency, peak memory,
busiest rank's calls and bytes on the wire, agreement) plus the link model's figure for three representative
links, so a consumer-rig user sees at a glance what the case would cost on PCIe without peer-to-peer or
between two machines.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

__all__ = ["case_line", "format_table", "TABLE_LINKS"]

#: link-model columns on stdout (every profile is in the JSON)
TABLE_LINKS = ("nvlink", "pcie4_x16_no_p2p", "10gbe")


def _num(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _gib(rec: dict) -> Optional[float]:
    peak = rec.get("peak_memory") or {}
    return peak.get("max_gib")


def _agreement(rec: dict) -> str:
    agr = rec.get("agreement")
    if not agr:
        return "ref" if rec.get("mode") == "unsharded" and rec.get("status") == "ok" else "-"
    text = f"{agr['max_abs']:.1e}"
    if rec.get("agreement_enforced"):
        text += " ok" if rec.get("agreement_ok") else " FAIL"
    return text


def _status(rec: dict) -> str:
    if rec.get("status") == "ok":
        return "ok"
    err = rec.get("error") or {}
    return err.get("kind") or rec.get("status") or "?"


def case_line(rec: dict) -> str:
    """One case as a progress line."""
    comm = rec.get("comm") or {}
    wire = rec.get("wire_bytes_by_rank")
    return (
        f"  {rec.get('name', rec.get('mode')):<24} {_status(rec):<8} "
        f"{_num(rec.get('latency_ms'), '.1f'):>9} ms  {_num(_gib(rec), '.3f'):>7} GiB  "
        f"calls {_num(comm.get('total_calls_max'), 'd'):>4}  "
        f"sent {_num(max(wire) / 2**20 if wire else None, '.2f'):>7} MiB  agree {_agreement(rec)}"
    )


def format_table(records: Sequence[dict]) -> str:
    """All records as a table, grouped by shape, with the link model for :data:`TABLE_LINKS`."""
    if not records:
        return "(no records)"
    first = records[0]
    peak_metric = next(((r.get("peak_memory") or {}).get("metric") for r in records if (r.get("peak_memory") or {}).get("metric")), None)
    mem_label = "peak GiB" if peak_metric != "process_rss_peak" else "RSS GiB"
    head = (
        f"{'shape':<14} {'case':<24} {'status':<8} {'ms':>9} {mem_label:>8} {'calls':>5} {'MiB sent':>9} "
        f"{'max_abs':>12} " + " ".join(f"{name[:12]:>12}" for name in TABLE_LINKS)
    )
    lines: List[str] = [
        f"\n{first.get('family')} {first.get('half')} ({first.get('size')}), {first.get('world_size')} ranks, "
        f"{first.get('dtype')}, device {first.get('device')}; latency = median of {first.get('iters')} timed "
        f"iterations (slowest rank); link columns = modelled ms",
        head,
        "-" * len(head),
    ]
    for rec in records:
        comm = rec.get("comm") or {}
        wire = rec.get("wire_bytes_by_rank")
        model = rec.get("link_model") or {}
        lines.append(
            f"{(rec.get('shape') or {}).get('label', ''):<14} {str(rec.get('name'))[:24]:<24} {_status(rec):<8} "
            f"{_num(rec.get('latency_ms'), '.1f'):>9} {_num(_gib(rec), '.3f'):>8} "
            f"{_num(comm.get('total_calls_max'), 'd'):>5} {_num(max(wire) / 2**20 if wire else None, '.2f'):>9} "
            f"{_agreement(rec):>12} " + " ".join(f"{_num(model.get(n), '.1f'):>12}" for n in TABLE_LINKS)
        )
    if peak_metric == "process_rss_peak":
        lines.append("RSS GiB: CPU ranks have no accelerator memory; this is each rank process's peak resident set (max over ranks).")
    failed = [r for r in records if r.get("status") == "error"]
    for r in failed:
        err = r.get("error") or {}
        lines.append(f"  {r.get('name')}: {err.get('kind')}: {str(err.get('message'))[:300]}")
    return "\n".join(lines)
