"""`import pycollectives` and the benchmark's `--help` do not import torch (seconds on a cold
disk), while every public name and the backend "pycoll" stay as before. Each case runs in a fresh
interpreter: this one has torch imported already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import paths
import pytest

pytest.importorskip("pycollectives", reason="pycollectives (and its extension) cannot be imported")

ROOT = str(paths.ROOT)


def _run(code: str) -> dict:
    """Runs `code` in a fresh Python and returns the JSON object it prints last."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))),
    }
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


# The console script pycollectives-bench calls pycollectives.bench.cli:main; `python -m
# pycollectives.bench` runs the package's __main__ (and imports the package first).
_CLI = """
import contextlib, io, json, runpy, sys
sys.argv = ["pycollectives-bench", *ARGV]
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        if ENTRY == "script":
            from pycollectives.bench.cli import main
            code = main()
        else:
            runpy.run_module("pycollectives.bench", run_name="__main__", alter_sys=True)
            code = None
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("entry", ["script", "module"])
@pytest.mark.parametrize(
    "argv, code, text",
    [
        (["--help"], 0, "usage: pycollectives-bench"),
        (["-b", "1x"], 2, "invalid size '1x'"),
        (["-b", "64M", "-e", "8"], 2, "--minbytes 67108864 is larger than --maxbytes 8"),
        (["--compare", "nccl"], 2, "nccl runs on CUDA tensors only"),
        (["--nproc", "2", "-r", "2"], 2, "--root 2 is not a rank (--nproc 2)"),
    ],
)
def test_bench_help_and_bad_flags_answer_without_torch(entry, argv, code, text):
    """`pycollectives-bench --help` and a bad flag answer before anything imports torch."""
    env_vars = ("RANK", "WORLD_SIZE", "PYCOLL_BENCH_JOINT_MPI")
    clean = f"import os\nfor k in {env_vars!r}: os.environ.pop(k, None)\n"
    r = _run(clean + f"ARGV, ENTRY = {argv!r}, {entry!r}\n" + _CLI)
    assert r["code"] == code, r
    assert text in r["out"] + r["err"], r
    assert not r["torch"], f"{argv}: torch was imported"


def test_import_pycollectives_leaves_torch_and_keeps_every_name():
    """`import pycollectives` does not import torch; every public name is there on first use."""
    r = _run("""
        import json, sys
        import pycollectives as pc
        before = "torch" in sys.modules
        names = {n: type(getattr(pc, n)).__name__ for n in pc.__all__}
        from pycollectives import Communicator, ReduceOp, init  # noqa: F401
        submodule = pc.rendezvous.init is pc.init  # imported by the package before
        try:
            pc.no_such_name
            missing = "no error"
        except AttributeError as e:
            missing = str(e)
        print(json.dumps({"before": before, "names": names, "dir": sorted(set(pc.__all__) - set(dir(pc))),
                          "reduce_op": pc.ReduceOp.SUM.name, "simd": pc.simd_level(),
                          "submodule": submodule, "missing": missing}))
    """)
    assert r["before"] is False, "import pycollectives imported torch"
    assert r["names"]["Communicator"] == "type" and r["names"]["init"] == "function", r
    assert r["names"]["PeerFailure"] == "type" and r["dir"] == [], r
    assert r["reduce_op"] == "SUM" and r["simd"] in ("avx512", "avx2", "generic"), r
    assert r["submodule"] is True, r
    assert r["missing"] == "module 'pycollectives' has no attribute 'no_such_name'", r


@pytest.mark.parametrize(
    "first",
    ["import pycollectives\nimport torch.distributed as dist",
     "import torch.distributed as dist\nimport pycollectives",
     "import pycollectives\nimport torch\ndist = torch.distributed",
     # transformers and others ask whether torch is there before importing it
     "import pycollectives, importlib.util\nassert importlib.util.find_spec('torch')\n"
     "import torch.distributed as dist"],
)  # fmt: skip
def test_backend_is_registered_whichever_is_imported_first(first):
    """`import pycollectives` before or after torch: "pycoll" is registered once torch is there,
    torch keeps its own loader, and the hook is gone from sys.meta_path."""
    r = _run(
        first
        + """
import json, sys
torch = sys.modules["torch"]
print(json.dumps({
    "registered": "PYCOLL" in dist.Backend._plugins,
    "loader": type(torch.__loader__).__name__,
    "spec_loader": type(torch.__spec__.loader).__name__,
    "hooks": [type(f).__name__ for f in sys.meta_path if "AfterTorch" in type(f).__name__],
}))
"""
    )
    assert r["registered"], r
    assert r["loader"] == r["spec_loader"] == "SourceFileLoader", r
    assert r["hooks"] == [], r


def test_init_process_group_pycoll_after_a_lazy_import():
    """The order isort gives (pycollectives before torch): init_process_group("pycoll") runs a
    collective on one rank."""
    r = _run("""
        import json, os
        import pycollectives  # noqa: F401
        import torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.HashStore()
        dist.init_process_group("pycoll", store=store, rank=0, world_size=1)
        t = torch.ones(4)
        dist.all_reduce(t)
        backend = dist.get_backend()
        dist.destroy_process_group()
        print(json.dumps({"backend": backend, "sum": t.tolist()}))
    """)
    assert r == {"backend": "pycoll", "sum": [1.0, 1.0, 1.0, 1.0]}, r
