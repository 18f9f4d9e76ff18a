"""The measured plan behind ``parallelism=auto``: MODELLED seconds per step of every exact layout, from one model call
measured on the user's own ranks and the link between them, and the fastest layout that fits.

Design decisions:

* **One measured call, scaled by a stated rule.** The ranks time one model call of the loaded model on the run's own
  input at one rank's worth of work (the whole call on every rank), once per :func:`probe_key`. Every layout's compute
  is that call divided as the layout divides it: ``sequence`` over S ranks computes ``1/S`` of each call's tokens,
  ``cfg`` one conditioning per rank, ``batch`` its share of the batch rows. Linear in the work: sequence ranks'
  per-call overheads (smaller GEMMs, the CPU issuing a whole call's kernels) are not modelled, so sequence's figure is
  a lower bound.
* **Traffic from the runtime's own cost model.** Every self-attention the measured call made (its tokens, heads and
  head size, recorded during the call) costs what ``parallel.seq_cost.attention_cost`` says of it at S ranks, plus one
  gather of the call's output; ``cfg`` exchanges one conditioning's output, ``batch`` gathers the rows' outputs. Each
  exchange is ``latency x messages + bytes / bandwidth`` on the link profile (``topology.links``; twice through host
  memory without peer-to-peer). Nothing hides behind compute (an upper bound for overlapped and ring attention);
  halos, GroupNorm statistics and the modulation gather are not counted.
* **The same layouts the rules allow, and only those.** ``cfg`` at exactly 2 ranks with guidance, ``cfg+sequence``
  from 4 even ranks, ``batch`` when the batch has a row per rank, ``sequence`` when the model has a sequence split;
  a stale preset works between sequence ranks only, so with one the plan is ``sequence``. The caller says which
  layouts fit (its memory and refusal checks); the plan picks the fastest that fits, ties going to the rules' order
  (batch, cfg, cfg+sequence, sequence).
* **Kept on disk next to the exactness verdicts** (:class:`ProbeCache`, ``auto_plan.json`` in
  ``sampling.exactness.cache_dir``): the measurement, not the plan, so a link or rank count met later reuses it.

Every figure here is MODELLED and says what it is from.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..parallel.seq_cost import attention_cost
from ..sampling.exactness import JsonFileCache
from ..topology.links import LinkProfile, get_profile, transfer_ms

__all__ = ["AttentionSite", "Measured", "Candidate", "Plan", "RULE_ORDER", "link_ms", "candidates", "choose",
           "plan_line", "probe_key", "ProbeCache", "main"]

#: the rules' order of preference: ties in the modelled step time go to the earlier layout
RULE_ORDER = ("batch", "cfg", "cfg+sequence", "sequence")


class AttentionSite(NamedTuple):
    """Self-attentions of one shape in the measured call (queries and keys over the same ``tokens``).

    Args:
        tokens: tokens of the sequence (image, plus text in a joint attention).
        heads, head_dim: of q/k/v.
        batch: rows of the call.
        calls: attentions of this shape in one model call.
    """

    tokens: int
    heads: int
    head_dim: int
    batch: int
    calls: int


class Measured(NamedTuple):
    """What the ranks measured on one model call of one conditioning (the whole latent batch).

    Args:
        call_ms: the call's time on the slowest rank (every rank ran it whole).
        sites: its self-attentions (:class:`AttentionSite`).
        out_bytes: bytes of its output (the model's prediction for the whole batch).
        itemsize: bytes per activation element.
        batch: the latent batch (rows of the call).
    """

    call_ms: float
    sites: Tuple[AttentionSite, ...]
    out_bytes: int
    itemsize: int
    batch: int

    def to_dict(self) -> dict:
        return {"call_ms": self.call_ms, "sites": [list(s) for s in self.sites], "out_bytes": self.out_bytes,
                "itemsize": self.itemsize, "batch": self.batch}

    @classmethod
    def from_dict(cls, raw: dict) -> "Measured":
        return cls(float(raw["call_ms"]), tuple(AttentionSite(*map(int, s)) for s in raw["sites"]), int(raw["out_bytes"]),
                   int(raw["itemsize"]), int(raw["batch"]))


class Candidate(NamedTuple):
    """One layout, MODELLED. ``s_per_step`` = ``compute_ms + comm_ms`` per step, in seconds."""

    mode: str
    cfg_groups: int
    seq_ranks: int
    attention: str
    compute_ms: float
    comm_ms: float
    bytes_per_step: float

    @property
    def s_per_step(self) -> float:
        return (self.compute_ms + self.comm_ms) / 1e3


class Plan(NamedTuple):
    """The chosen layout (``None`` when no candidate fits) and every candidate, fastest first."""

    chosen: Optional[Candidate]
    candidates: Tuple[Candidate, ...]
    link: LinkProfile


def link_ms(nbytes: float, messages: int, link) -> float:
    """``latency x messages + bytes / bandwidth`` (twice through host memory), milliseconds."""
    p = get_profile(link)
    return transfer_ms(nbytes, p) + messages * p.latency_us / 1e3


def _shares(tokens: int, ranks: int) -> List[int]:
    base, extra = divmod(int(tokens), int(ranks))
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def _sequence_comm(m: Measured, ranks: int, attention: str, link) -> Tuple[float, float]:
    """``(ms, bytes)`` one rank exchanges in one call split over ``ranks`` sequence ranks."""
    if ranks < 2:
        return 0.0, 0.0
    ms = wire = 0.0
    for s in m.sites:
        mode = "gathered" if attention in ("gathered", "overlapped") else attention
        if mode == "ulysses" and s.heads % ranks:
            mode = "gathered"  # backstop, not the guard: the caller leaves ulysses out where heads do not divide
        cost = attention_cost(mode, _shares(s.tokens, ranks), s.heads, s.head_dim, m.itemsize, batch=s.batch)
        ms += s.calls * link_ms(cost.wire_bytes, cost.messages, link)
        wire += s.calls * cost.wire_bytes
    out = math.ceil(m.out_bytes / ranks) * (ranks - 1)  # the output gathered once per call
    return ms + link_ms(out, 1, link), wire + out


def _best_attention(m: Measured, ranks: int, attention: str, link) -> Tuple[str, float, float]:
    if attention != "auto":
        return (attention, *_sequence_comm(m, ranks, attention, link))
    options = ["gathered"] + (["ulysses"] if all(s.heads % ranks == 0 for s in m.sites) else [])
    best = min(options, key=lambda a: (_sequence_comm(m, ranks, a, link)[0], options.index(a)))
    return (best, *_sequence_comm(m, ranks, best, link))


def candidates(m: Measured, link, num_ranks: int, cfg_on: bool, *, sequence_ok: bool = True,
               stale_preset: bool = False, attention: str = "auto") -> List[Candidate]:
    """Every exact layout the rules allow for this run, MODELLED (in :data:`RULE_ORDER`).

    Args:
        m: the measured call (:class:`Measured`).
        link: a link profile (name or :class:`~..topology.links.LinkProfile`).
        num_ranks: the cluster's ranks (>= 2).
        cfg_on: the guidance evaluates two conditionings per step (cfg > 1): two calls per step, or one per CFG group.
        sequence_ok: the model has a sequence split.
        stale_preset: a preset with stale neighbour data: it works between sequence ranks only.
        attention: the ``sequence_attention`` widget (``auto``: the cheaper of gathered and ulysses).
    """
    n = int(num_ranks)
    calls = 2 if cfg_on else 1
    out: List[Candidate] = []
    if n < 2:
        return out
    if stale_preset:
        if not sequence_ok:
            return out
        att, ms, wire = _best_attention(m, n, attention, link)
        return [Candidate("sequence", 1, n, att, calls * m.call_ms / n, calls * ms, calls * wire)]
    if m.batch >= n:
        share = math.ceil(m.batch / n) / m.batch
        wire = m.out_bytes * share * (n - 1)  # every rank's rows' outputs gathered to all
        out.append(Candidate("batch", 1, 1, "-", calls * m.call_ms * share, calls * link_ms(wire, 1, link), calls * wire))
    if cfg_on and n == 2:
        out.append(Candidate("cfg", 2, 1, "-", m.call_ms, link_ms(m.out_bytes, 1, link), float(m.out_bytes)))
    if cfg_on and n >= 4 and n % 2 == 0 and sequence_ok:
        s = n // 2
        att, ms, wire = _best_attention(m, s, attention, link)
        peer = math.ceil(m.out_bytes / s)  # each rank's band of its conditioning's output to its peer in the other group
        out.append(Candidate("cfg+sequence", 2, s, att, m.call_ms / s, ms + link_ms(peer, 1, link), wire + peer))
    if sequence_ok:
        att, ms, wire = _best_attention(m, n, attention, link)
        out.append(Candidate("sequence", 1, n, att, calls * m.call_ms / n, calls * ms, calls * wire))
    return out


def choose(found: Sequence[Candidate], fits: Optional[Dict[str, bool]] = None, link=None) -> Plan:
    """The fastest candidate that fits (``fits``: mode -> whether the caller's checks pass; missing: fits); ties go to
    :data:`RULE_ORDER`."""
    fits = fits or {}
    ranked = sorted(found, key=lambda c: (round(c.s_per_step, 9), RULE_ORDER.index(c.mode)))
    chosen = next((c for c in ranked if fits.get(c.mode, True)), None)
    return Plan(chosen, tuple(ranked), get_profile(link) if link is not None else None)


def _ms(x: float) -> str:
    return f"{x:.0f} ms" if x >= 10 else f"{x:.2g} ms"


def plan_line(plan: Plan, m: Measured, link_words: str, cached: bool) -> str:
    """``plan: <mode>, expected X s/step (MODELLED from a measured call of N ms and <link>)``, then the others."""
    c = plan.chosen
    how = " (measured earlier)" if cached else ""
    mode = c.mode + (f" ({c.attention} attention)" if c.seq_ranks > 1 else "")
    line = (f"plan: {mode}, expected {c.s_per_step:.3g} s/step (MODELLED from a measured call of {_ms(m.call_ms)}{how} "
            f"and {link_words})")
    others = [f"{o.mode} {o.s_per_step:.3g}" for o in plan.candidates if o is not c]
    if others:
        line += "; others MODELLED: " + ", ".join(others) + " s/step"
    return line


def probe_key(model_class: str, params: int, dtype: str, latent_shape: Sequence[int], ranks: int, cluster: str,
              sharding: str, host_version: str, patchray_version: str) -> str:
    """The cache key of a measurement: it holds only while none of these changes (the model class, its size and
    weight dtype, the latent's shape, the rank count, the cluster's devices, the sharding and both programs' versions)."""
    shape = "x".join(str(int(d)) for d in latent_shape)
    return f"{model_class}|{int(params)}|{dtype}|{shape}|{int(ranks)}|{cluster}|{sharding}|{host_version}|{patchray_version}"


class ProbeCache(JsonFileCache):
    """Measurements in one JSON file (``auto_plan.json`` beside the exactness verdicts). A missing or unreadable
    record is no record (the call is measured again)."""

    NAME = "auto_plan.json"

    def get(self, key: str) -> Optional[Measured]:
        raw = self._raw(key)
        try:
            return Measured.from_dict(raw) if raw is not None else None
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, m: Measured) -> None:
        self._write(key, m.to_dict())


def main(argv=None) -> int:
    """``python -m patchray auto-plan [--clear]``: the model calls ``parallelism`` auto measured (one per model, size,
    rank count and cluster); ``--clear`` forgets them, so the next auto run measures again."""
    import argparse

    p = argparse.ArgumentParser(prog="patchray auto-plan", description=main.__doc__)
    p.add_argument("--clear", action="store_true", help="forget every measurement (auto measures again on first use)")
    args = p.parse_args(argv)
    cache = ProbeCache()
    if args.clear:
        print(f"forgot {cache.clear()} measurement(s) in {cache.path}")
        return 0
    data = cache.load()
    print(f"{len(data)} measurement(s) in {cache.path}")
    for key, raw in sorted(data.items()):
        ms = raw.get("call_ms") if isinstance(raw, dict) else None
        print(f"  {key}: one model call {ms:.1f} ms" if isinstance(ms, (int, float)) else f"  {key}: (unreadable)")
    return 0
