"""What sits above the core, unchanged across hosts (network namespaces,
netns.py).

The torch.distributed backend "pycoll" on 2 hosts x 1 rank: every scenario of
test_backend.py (the c10d API, functional collectives, torch DDP, FSDP2, TP)
under gloo and then "pycoll" in the same processes, pycoll's results against
gloo's by test_backend's rules (2 ranks: bitwise).

On 2 hosts x 2 ranks (ranks 0, 1 on host 0; 2, 3 on host 1) the 3D trainer
(strategies.parallel3d) trains the tiny GPT of test_3d.py and matches one
process within test_3d's tolerances:

- tp=2 x pp=2 under 1F1B: each tensor-parallel pair within a host (shared
  memory), the pipeline's activations and gradients across the hosts (TCP
  point-to-point, batched where sends and receives pair);
- dp=2 x tp=2 with ZeRO-3 on the dp axis: the tensor-parallel pair within a
  host, the parameter all-gathers and gradient reduce-scatters across hosts.
"""

from __future__ import annotations

import io

import netns
import pytest
import test_3d as t3
import test_backend as tb
import torch
from multihost_jobs import run_on_hosts

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

LAYOUT = [0, 0, 1, 1]  # rank r on host LAYOUT[r]
STEPS = 4


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def job(comm, dp: int, tp: int, pp: int, change: dict) -> dict:  # noqa: ANN001
    """test_3d's training job, plus where this rank's groups live."""
    out = t3.job_train(comm, dp, tp, pp, change, STEPS)
    out["hosts"] = comm.hosts
    return out


@pytest.mark.parametrize(
    "dp,tp,pp,change",
    [(1, 2, 2, {"schedule": "1f1b"}), (2, 2, 1, {"zero": 3})],
    ids=["tp2-pp2-1f1b", "dp2-tp2-zero3"],
)
def test_3d_training_across_hosts_matches_one_process(fabric, dp, tp, pp, change):
    _, losses, end = t3.reference(STEPS)
    out = run_on_hosts(fabric, LAYOUT, job, dp, tp, pp, change, timeout=180)
    got: dict[str, torch.Tensor] = {}
    for r, o in enumerate(out):
        assert o["hosts"] == LAYOUT, (r, o["hosts"])
        worst = max(abs(a - b) for a, b in zip(o["losses"], losses, strict=True))
        assert worst <= 1e-12, (r, o["coords"], worst)
        got.update({n: torch.from_numpy(v) for n, v in o["end"].items()})
    assert set(got) == set(end)
    for name, want in end.items():
        diff = (got[name] - want).abs().max().item()
        assert diff <= 1e-10, (name, diff)


def job_backend(comm) -> bytes:  # noqa: ANN001
    """test_backend's scenarios, their torch store beside pycollectives' own."""
    return tb._job(comm.rank, comm.world_size, port_offset=1)


def test_torch_backend_across_hosts_matches_gloo(fabric):
    env = {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo's interface inside each namespace
    raw = run_on_hosts(fabric, [0, 1], job_backend, env=env, timeout=180)
    res = [torch.load(io.BytesIO(b), weights_only=False) for b in raw]
    for scenario in tb.SCENARIOS:
        tb.check_matches_gloo(res, 2, scenario)
