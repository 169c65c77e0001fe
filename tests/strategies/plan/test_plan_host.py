"""The planner's model of hosts whose ranks outnumber their cores (strategies/plan/host.py):
its arithmetic on exact small cases, and that it leaves one rank per device as it was."""

from __future__ import annotations

import json

import pytest

from pycollectives.strategies.plan import parse_request
from pycollectives.strategies.plan.cli import main, plan
from pycollectives.strategies.plan.costs import LinkCost
from pycollectives.strategies.plan.host import HostCPU, host_bound, sync_points
from pycollectives.strategies.plan.layout import Layout, Priced, price
from pycollectives.strategies.plan.local import fit_block_costs
from pycollectives.strategies.plan.units import PlanInputError

FREE = {"intra": LinkCost(0.0, 0.0, "free"), "inter": LinkCost(0.0, 0.0, "free")}
LINKS = {"intra": LinkCost(2e-6, 1 / 100e9, "i"), "inter": LinkCost(10e-6, 1 / 10e9, "x")}
REQ = {
    "layers": 8, "hidden": 256, "heads": 8, "vocab": 1024, "seq": 128, "global_batch": 64,
    "hosts": 1, "devices_per_host": 4, "memory_per_device": "16GB",
    "intra_host": "100GB/s,2us", "inter_host": "10GB/s,10us", "flops": "100GFLOP/s",
    "sharding": ["none", "zero1", "zero2", "zero3", "fsdp"],
    "schedules": ["gpipe", "1f1b", "interleaved", "zb-h1"], "microbatches": [4],
    "recompute": ["none"], "dtype": "fp32",
}  # fmt: skip


def test_host_bound_sums_each_hosts_ranks_over_its_cores():
    assert host_bound([1.0, 2.0, 3.0, 4.0], 4, 2) == 5.0
    assert host_bound([1.0, 2.0, 3.0, 4.0], 2, 2) == 3.5  # hosts {1, 2}, {3, 4}
    assert host_bound([1.0, 2.0, 3.0, 4.0], 2, 8) == 3.5  # 2 ranks use 2 of 8 cores
    assert host_bound([1.0, 2.0, 3.0], 2, 2) == 3.0  # the last host: one rank, one core
    assert host_bound([], 2, 2) == 0.0
    with pytest.raises(PlanInputError, match="cores=0"):
        host_bound([1.0], 1, 0)


def test_sync_points_count_what_waits_for_every_member():
    one = dict(dp=1, tp=1, pp=1, sharding="none", microbatches=4, blocks=8, stages=1,
               first=True, last=True)  # fmt: skip
    assert sync_points(**one) == 1  # the loss
    assert sync_points(**{**one, "tp": 2}) == 1 + 4 * (4 * 8 + 1 + 3)
    assert sync_points(**{**one, "dp": 4}) == 2
    assert sync_points(**{**one, "dp": 4, "sharding": "zero1"}) == 3
    assert sync_points(**{**one, "dp": 4, "sharding": "zero2"}) == 1 + 9 + 1
    assert sync_points(**{**one, "dp": 4, "sharding": "zero3"}) == 1 + 2 * 4 * 9 + 9
    mid = {**one, "pp": 4, "blocks": 2, "first": False, "last": False}
    assert sync_points(**mid) == 1 + 2 * 4 + 1
    assert sync_points(**{**mid, "dp": 2, "sharding": "fsdp", "stages": 2}) == 1 + 6 + 17
    assert sync_points(**{**mid, "tp": 2}) == 1 + 4 * 4 * 2 + 9


def test_one_rank_per_core_prices_as_before():
    """Cores not given, or as many as the ranks: the step and its parts are today's."""
    base, _ = plan(parse_request(REQ), LINKS)
    same, _ = plan(parse_request({**REQ, "cores_per_host": 4, "collective_wait": "1ms"}), LINKS)
    assert [p.layout for p in base] == [p.layout for p in same]
    for a, b in zip(base, same, strict=True):
        assert a.step_s == b.step_s and a.time == b.time and b.host_cpu_s == 0.0
        assert a.time["shared_cores"] == a.time["collective_waits"] == a.time["optimizer"] == 0


def test_a_pipeline_on_one_core_costs_its_whole_model():
    """pp = 2 on a host of 1 core: the bubble costs nothing, the step is both stages'
    compute, exactly that of the whole model on one device (free messages, no waits)."""
    lo2 = Layout(1, 1, 2, "none", "1f1b", 4, "none")
    two = price(parse_request({**REQ, "devices_per_host": 2, "cores_per_host": 1}), lo2, FREE)
    one = price(parse_request({**REQ, "devices_per_host": 1}), Layout(1, 1, 1, "none", "none", 4, "none"), FREE)  # fmt: skip
    assert isinstance(two, Priced) and isinstance(one, Priced)
    assert two.step_s == pytest.approx(one.step_s, rel=1e-12)
    assert two.host_cpu_s == pytest.approx(one.step_s, rel=1e-12)
    # the bubble is in the critical path, which the host's bound covers
    assert two.time["pipeline_bubble"] > 0 and two.time["shared_cores"] > 0


def test_data_parallel_ranks_on_shared_cores_add_up_exactly():
    """dp = 4 on 2 cores, free links: each rank's busy CPU is its compute (FLOPs at a
    core's rate, plus a block call's cost per block and micro-batch), the optimizer's step
    on all its parameters and the CPU of its 2 sync points (the gradient all-reduce and the
    loss); the step is twice a rank's (4 ranks over 2 cores) plus a wait for each."""
    call, opt, sync, wait = 100e-6, 5e-9, 50e-6, 1e-3
    req = parse_request({**REQ, "cores_per_host": 2, "block_call": "100us",
                         "optimizer_per_param": "5ns", "collective_cpu": "50us",
                         "collective_wait": "1ms"})  # fmt: skip
    got = price(req, Layout(4, 1, 1, "none", "none", 4, "none"), FREE)
    assert isinstance(got, Priced)
    m, tokens = req.model, 64 // 4 * 128
    flops = 6 * m.params() * tokens + 12 * m.layers * m.hidden * m.seq * tokens
    compute = flops / 100e9 + 4 * m.layers * call
    assert got.time["compute"] == pytest.approx(compute, rel=1e-12)
    assert got.time["optimizer"] == pytest.approx(m.params() * opt, rel=1e-12)
    rank = compute + m.params() * opt + 2 * sync
    assert got.host_cpu_s == pytest.approx(4 * rank, rel=1e-12)
    assert got.time["collective_waits"] == pytest.approx(2 * wait, rel=1e-12)
    assert got.step_s == pytest.approx(2 * rank + 2 * wait, rel=1e-12)
    assert got.time["shared_cores"] == pytest.approx(rank + 2 * sync, rel=1e-12)
    # ZeRO-1 steps a quarter of the parameters on each rank, and syncs once more
    z1 = price(req, Layout(4, 1, 1, "zero1", "none", 4, "none"), FREE)
    assert z1.time["optimizer"] == pytest.approx(m.params() * opt / 4, rel=1e-12)
    z1_rank = compute + m.params() * opt / 4 + 3 * sync
    assert z1.step_s == pytest.approx(2 * z1_rank + 3 * wait, rel=1e-12)


def test_cpu_inputs_are_checked_and_echoed():
    req = parse_request({**REQ, "cores_per_host": 2, "block_call": "120us",
                         "optimizer_per_param": "4.5ns", "collective_cpu": "30us",
                         "collective_wait": "0.8ms"})  # fmt: skip
    cpu = req.cluster.cpu
    assert cpu.cores == 2 and cpu.shared(4) and not cpu.shared(2)
    assert (cpu.block_call_s, cpu.optimizer_param_s, cpu.sync_cpu_s, cpu.wait_s) == pytest.approx(
        (120e-6, 4.5e-9, 30e-6, 0.8e-3), rel=1e-12
    )
    echo = req.echo()["cluster"]
    assert echo["cores_per_host"] == 2 and echo["collective_wait_s"] == pytest.approx(0.8e-3)
    assert parse_request(REQ).echo()["cluster"]["cores_per_host"] is None
    with pytest.raises(PlanInputError, match="cores_per_host=0"):
        parse_request({**REQ, "cores_per_host": 0})
    with pytest.raises(PlanInputError, match="collective_wait='1'"):
        parse_request({**REQ, "collective_wait": "1"})
    with pytest.raises(PlanInputError, match="negative"):
        HostCPU(2, -1.0)


def test_cli_cores_per_host(tmp_path, capsys):
    argv = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in REQ.items()]  # fmt: skip
    out = tmp_path / "plan.json"
    assert main([*argv, "--cores-per-host=2", "--collective-wait=1ms", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["inputs"]["cluster"]["cores_per_host"] == 2
    assert all(r["host_cpu_s"] > 0 and r["time_s"]["collective_waits"] >= 1e-3
               for r in data["layouts"])  # fmt: skip
    assert "cores" in capsys.readouterr().out


def test_fit_block_costs_recovers_call_and_rate():
    call, rate = 150e-6, 30e9
    samples = [(f, call + f / rate) for f in (1e6, 4e6, 2e7, 8e7)]
    got_call, got_rate = fit_block_costs(samples)
    assert got_call == pytest.approx(call, rel=1e-9)
    assert got_rate == pytest.approx(rate, rel=1e-9)
    with pytest.raises(PlanInputError, match="samples"):
        fit_block_costs([])


def test_host_bound_ties_between_schedules_go_to_the_least_bubble():
    """pp = 4 on 2 cores, the host's bound above every schedule's critical path: the four
    schedules price the same step, and plan() orders them by their bubble (ZB-H1 first,
    GPipe and 1F1B last), the measured order on such a host (Priced.order)."""
    req = parse_request({**REQ, "cores_per_host": 2, "sharding": ["none"]})
    fits, _ = plan(req, FREE)
    pp4 = [p for p in fits if p.layout.pp == 4]
    assert {p.layout.schedule for p in pp4} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    bubbles = [p.time["pipeline_bubble"] for p in pp4]
    assert bubbles == sorted(bubbles) and bubbles[0] < bubbles[-1]
    ties = [p for p in pp4 if p.step_s == pp4[0].step_s]
    assert len(ties) >= 2 and pp4[0].layout.schedule == "zb-h1", [
        (p.layout.schedule, p.step_s, p.time["pipeline_bubble"]) for p in pp4
    ]
    assert [p.order() for p in fits] == sorted(p.order() for p in fits)
