"""parallelism=auto's measured plan on the driver: when it measures, what it keeps, which layout it runs, and the
lines the node shows before and after sampling.

The layout choice itself, from given figures, is tests/distributed/test_auto_plan.py; the whole path in a real ComfyUI
server with CPU ranks is tests/comfyui/test_auto_plan_server.py (opt-in). Here the ranks' part is given: ``probe``
returns the info a probe run's rank 0 would, ``memory`` the ranks' memory, as :func:`measured_layout` takes them.
"""

from types import SimpleNamespace

import pytest
import torch

from patchray.distributed.bench.auto_plan import AttentionSite, Measured
from patchray.distributed.cluster import ClusterConfig
from patchray.nodes.bridge import auto_plan as bap
from patchray.nodes.bridge.dit_layout import Layout
from patchray.nodes.bridge.sampling_options import SamplingOptions

# rank 0's info after a probe run of a model whose call holds cond and uncond together (2 rows for a batch of 1):
# 4,096 tokens of 24 heads x 128 in 57 self-attentions over both rows, a 2 x 524,288 B output
_INFO = {"probe": [{"ms": 260.0, "rows": 2, "sites": [[4096, 24, 128, 2, 57]], "out_bytes": 1_048_576, "itemsize": 2},
                   {"ms": 200.0, "rows": 2, "sites": [[4096, 24, 128, 2, 57]], "out_bytes": 1_048_576, "itemsize": 2}],
         "probe_row_ms": 100.0}
_GIB = 1024**3


def _model(need_bytes=1e6):
    dm = torch.nn.Linear(8, 8)
    return SimpleNamespace(model=SimpleNamespace(diffusion_model=dm, memory_required=lambda shape: need_bytes,
                                                 manual_cast_dtype=None))


def _options(**kw):
    return SamplingOptions(ClusterConfig(num_ranks=2, device="cpu"), **kw)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHRAY_CACHE_DIR", str(tmp_path))


def _plan(mp, probes, *, refuse=(), link=("10gbe", "the topology probe's link (10gbe)"), cfg_on=True, mem_gib=64.0):
    def probe():
        probes.append(1)
        return _INFO

    def check(layout):
        if layout.mode in refuse:
            raise NotImplementedError(f"{layout.mode} refused")

    return bap.measured_layout(Layout("cfg", 2, cfg_groups=2), mp=mp, options=_options(), cfg_on=cfg_on, batch=1,
                               latent_shape=(1, 16, 128, 128), sequence_ok=True, check_layout=check, probe=probe,
                               memory=lambda: [(mem_gib * _GIB, mem_gib * _GIB, "cuda")] * 2, link=link)


def test_a_probe_runs_info_becomes_one_conditionings_call():
    m = bap.measured_from_info(_INFO, batch=1)
    # the slowest rank's best 100 ms per row x a batch of 1; the call's 2 rows were cond and uncond: per conditioning
    # 1 row of attention and half the output
    assert m == Measured(100.0, (AttentionSite(4096, 24, 128, 1, 57),), 524_288, 2, 1)
    assert bap.measured_from_info({}, batch=1) is None  # no call was timed: the rules decide


def test_the_first_auto_run_measures_and_later_ones_reuse_the_measurement():
    mp, probes = _model(), []
    first = _plan(mp, probes)
    assert probes == [1]
    assert first.layout == Layout("cfg", 2, cfg_groups=2)
    # cfg on 10gbe: 100 ms + 524,288 B / 1.18 GB/s + 50 us (tests/distributed/test_auto_plan.py works it out)
    assert first.expected_s == pytest.approx(0.10049, abs=1e-5)
    assert first.line.startswith("plan: cfg, expected 0.1 s/step (MODELLED from a measured call of 100 ms and the "
                                 "topology probe's link (10gbe))")
    again = _plan(mp, probes)
    assert probes == [1]  # kept on disk: no second probe
    assert "100 ms (measured earlier)" in again.line and again.layout == first.layout
    other = _model()
    other.model.diffusion_model = torch.nn.Linear(8, 16)  # another model of the class: another size, measured again
    _plan(other, probes)
    assert probes == [1, 1]


def test_a_layout_the_runs_checks_refuse_gives_way_to_the_next_fastest():
    planned = _plan(_model(), [], refuse=("cfg",))
    assert planned.layout == Layout("sequence", 2, seq_ranks=2)
    assert planned.line.startswith("plan: sequence (gathered attention), expected 2.54 s/step")


def test_nothing_is_measured_where_one_whole_call_does_not_fit_a_rank():
    # the stand-in's memory estimate is 3 GiB for a call; a card of 2 GiB holds no whole call (the probe runs the whole
    # model on every rank), so nothing is measured and the rules' layout stays, with the reason on the node
    probes = []
    planned = _plan(_model(need_bytes=3 * _GIB), probes, mem_gib=2.0)
    assert probes == []
    assert planned.layout == Layout("cfg", 2, cfg_groups=2) and "none was measured" in planned.line


def test_the_link_is_the_probes_else_the_one_the_cluster_implies():
    local = ClusterConfig(num_ranks=2, device="cuda")
    assert bap.plan_link(local, probed=lambda c: "nvlink") == ("nvlink", "the topology probe's link (nvlink)")
    name, words = bap.plan_link(local, probed=lambda c: None)
    assert name == "pcie4_x16_no_p2p" and "assumed" in words
    remote = ClusterConfig(num_ranks=2, device="cuda", address="ray://head:10001")
    assert bap.plan_link(remote, probed=lambda c: None)[0] == "10gbe"


def test_the_line_after_sampling_gives_the_measured_step_bytes_and_communication():
    line = bap.after_line(6.0, 3, 41.3e6, 0.9, 0.10049)
    assert line == ("measured: 2 s/step over 3 steps, 41.3 MB exchanged per step, 0.9 s in communication (0.3 s/step); "
                    "the plan expected 0.1 s/step (MODELLED)")
    assert bap.after_line(1.0, 1, None, None, None) == "measured: 1 s/step over 1 step, 0 B exchanged per step"


# ------------------------------------------------------------------------------------------- on the ranks


def _gather_then_exchange(ctx):
    from patchray.distributed import comm
    from patchray.nodes.bridge.ksampler_rank import comm_seconds

    with comm_seconds(ctx.device, ctx.world_size) as stats:
        comm.all_gather_padded(torch.ones(4, 8), ctx, dim=0, sizes=[4] * ctx.world_size)  # 128 B a rank
        comm.all_reduce(torch.ones(10), ctx)  # 40 B
    outside = dict(stats)
    comm.all_gather_padded(torch.ones(4, 8), ctx, dim=0, sizes=[4] * ctx.world_size)  # after the block: not counted
    return outside, dict(stats)


def test_the_ranks_count_the_bytes_they_send_and_the_seconds_inside_communication():
    from patchray.distributed.spawn import run_ranks

    got = run_ranks(_gather_then_exchange, 3, timeout_s=120)
    for inside, after in got:
        # the gather: 128 B to each of 2 peers = 256 B; the all-reduce (a ring): 2 x 40 B x 2/3 = 53.3 -> 53 B
        assert inside["bytes"] == 256 + 53
        assert inside["s"] > 0.0
        assert after == inside  # the hook is gone once the block ends


def test_the_probe_wrapper_times_each_call_and_records_its_self_attentions():
    from patchray.nodes.bridge.dit_rank import Counter
    from patchray.nodes.bridge.ksampler_rank import probe_calls

    record, session = [], SimpleNamespace(calls=0, entered=0)
    q = torch.zeros(2, 48, 4 * 16)  # [B, L, H * D]: 2 rows, 48 tokens, 4 heads of 16
    text = torch.zeros(2, 7, 4 * 16)

    def attention_fn(q_, k_, v_, heads, **kw):
        return q_

    def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        attend = transformer_options["optimized_attention_override"]
        for _ in range(3):
            attend(attention_fn, q, q, q, 4)  # self-attention: counted
        attend(attention_fn, q, text, text, 4)  # cross-attention over the text: kept whole, not counted
        attend(attention_fn, q.view(2, 48, 4, 16).transpose(1, 2), q.view(2, 48, 4, 16).transpose(1, 2), None, 4,
               skip_reshape=True)  # [B, H, L, D]
        return torch.zeros(2, 16, 6, 8)

    wrapper = probe_calls(Counter(session), record)
    out = wrapper(executor, torch.zeros(2, 16, 6, 8), torch.zeros(2), None, None, None, {"cond_or_uncond": [0, 1]})
    assert out.shape == (2, 16, 6, 8) and session.calls == 1
    (call,) = record
    assert call["rows"] == 2 and call["ms"] > 0.0
    # 3 self-attentions laid out [B, L, H * D] and one [B, H, L, D] read as one shape: 48 tokens, 4 heads of 16, 2 rows
    assert call["sites"] == [[48, 4, 16, 2, 4]]
    assert call["out_bytes"] == 2 * 16 * 6 * 8 * 4 and call["itemsize"] == 4
