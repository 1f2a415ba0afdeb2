"""The generic policy protocol: report contents, first-match-wins, idempotence, shared params, errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_ds.inject.policy import Policy, ReplacementReport, apply_policies, count_params


class Halve(nn.Module):
    """A replacement with a known parameter count: an nn.Linear without bias -> a diagonal scale."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.scale


class LinearToScale:
    name = "scale"

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def matches(self, name, module):
        return type(module) is nn.Linear and name.startswith(self.prefix)

    def replace(self, name, module):
        return Halve(module.out_features)

    def detail(self, name, old, new):
        return {"n": old.out_features}


class MatchesEverything(LinearToScale):
    name = "greedy"

    def matches(self, name, module):
        return isinstance(module, (nn.Linear, Halve))


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2)))


def test_report_lists_each_replacement_with_counts():
    m = tiny()
    before = sum(p.numel() for p in m.parameters())
    rep = apply_policies(m, [LinearToScale()])
    assert rep.names == ["0", "2.0", "2.1"]
    assert [(e.dense_params, e.new_params) for e in rep.entries] == [(20, 4), (16, 4), (10, 2)]
    assert rep.dense_params == 46 and rep.new_params == 10
    assert rep.compression_ratio == pytest.approx(4.6)
    assert rep.model_params_before == before == 46 and rep.model_params_after == 10
    assert rep.entries[0].detail == {"n": 4} and rep.entries[0].old_type == "Linear" and rep.entries[0].new_type == "Halve"
    assert isinstance(m[0], Halve) and isinstance(m[2][1], Halve)
    assert "whole model" in rep.table() and "4.60x" in rep.table()


def test_idempotent_second_apply_replaces_nothing():
    m = tiny()
    apply_policies(m, [LinearToScale()])
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    rep2 = apply_policies(m, [LinearToScale()])
    assert rep2.entries == [] and rep2.compression_ratio == 1.0
    assert m.state_dict().keys() == sd.keys() and all(torch.equal(sd[k], v) for k, v in m.state_dict().items())


def test_first_matching_policy_wins_and_unmatched_modules_untouched():
    m = tiny()
    rep = apply_policies(m, [LinearToScale(prefix="2."), LinearToScale()])
    assert rep.names == ["0", "2.0", "2.1"]
    m = tiny()
    rep = apply_policies(m, [LinearToScale(prefix="2.")])
    assert rep.names == ["2.0", "2.1"] and type(m[0]) is nn.Linear


def test_policy_matching_its_own_output_is_rejected():
    with pytest.raises(RuntimeError, match="greedy.*matches its own replacement of '0'"):
        apply_policies(tiny(), [MatchesEverything()])


def test_non_policy_rejected():
    with pytest.raises(TypeError, match="is not a policy"):
        apply_policies(tiny(), [object()])
    assert isinstance(LinearToScale(), Policy)


def test_count_params_counts_shared_once_and_uses_ds_numel():
    a = nn.Linear(3, 3)
    p = nn.Parameter(torch.empty(0))
    p.ds_numel = 12  # what ZeRO-3 leaves on a partitioned parameter
    assert count_params([a.weight, a.weight, a.bias]) == 12
    assert count_params([p]) == 12


def test_children_of_replaced_module_not_visited():
    class Outer(LinearToScale):
        name = "outer"

        def matches(self, name, module):
            return name == "2" and isinstance(module, nn.Sequential)

        def replace(self, name, module):
            return nn.Identity()

        def detail(self, name, old, new):
            return {}

    m = tiny()
    rep = apply_policies(m, [Outer(), LinearToScale()])
    assert rep.names == ["0", "2"] and isinstance(rep, ReplacementReport)
