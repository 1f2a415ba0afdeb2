"""titan_ds.hms.timeline: off by default (nothing recorded), the per-phase breakdown counts each span once."""
from collections import defaultdict

import pytest
import torch

from titan_ds.hms import timeline
from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.optimizer_swapper import HMSOptimizerSwapper


def _span(phase, start, end, lane="main", step=1):
    return {"phase": phase, "lane": lane, "start": start, "end": end, "step": step}


def test_breakdown_counts_each_span_in_its_innermost_phase():
    spans = [_span("wall", 0, 10, "steps"), _span("forward", 0, 3), _span("param fetch", 1, 2),
             _span("backward", 3, 6), _span("grad write", 4, 4.5), _span("step", 6, 9.5), _span("opt read", 6, 7),
             _span("opt write", 9, 9.5), _span("opt write (bg)", 7, 9.2, "writer"), _span("forward", 0, 5, step=2),
             _span("param write (bg)", 6.5, 7.5, "param writer"),
             _span("param fetch", 10.5, 11)]  # after the step (a validation read): left out
    b = timeline.breakdown(spans, 1)
    assert b["forward"] == 2 and b["param fetch"] == 1 and b["backward"] == 2.5 and b["grad write"] == 0.5
    assert b["opt read"] == 1 and b["opt write"] == 0.5 and b["opt compute"] == 2
    assert b["opt write (bg)"] == pytest.approx(2.2) and b["param write (bg)"] == 1 and b["wall"] == 10 and b["idle"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no wall span"):
        timeline.breakdown(spans, 2)


def test_swapper_records_only_when_enabled(tmp_path):
    class _Opt:
        state, param_groups = defaultdict(dict), [{"params": []}]

    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    sw = HMSOptimizerSwapper(None, None, str(tmp_path / "b"), _Opt(), 100, "cpu", torch.float32, None, store=store,
                             pipeline_depth=1)
    p = torch.nn.Parameter(torch.zeros(100))
    p.ds_id = 0
    sw.initialize_parameters([p], [p.data.clone()])
    assert timeline.current() is None
    sw.swap_in_optimizer_state(p)
    sw.swap_out_optimizer_state(p)
    sw.log_timers()
    tl = timeline.enable()
    try:
        sw.swap_in_optimizer_state(p)
        sw.swap_out_optimizer_state(p)
        sw.log_timers()
    finally:
        timeline.disable()
    phases = [s[0] for s in tl.spans]
    assert phases.count("opt read") == 1 and phases.count("opt write (bg)") == 1 and "opt write" in phases
    assert timeline.current() is None
    store.close()
