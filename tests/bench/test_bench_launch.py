"""The benchmark's launcher starts its ranks on the pycollectives it runs itself, wherever it is
started from: `python -m` puts the working directory first on sys.path, and from the root of a
clone (the README's quick start) the ranks would import the source tree, which has no built _C,
instead of the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import paths
import pytest

pytest.importorskip("pycollectives", reason="pycollectives (and its extension) cannot be imported")

import pycollectives.bench.launch as launch  # noqa: E402
from pycollectives.bench.cli import main  # noqa: E402
from pycollectives.bench.specs import COLLECTIVES  # noqa: E402

ROOT = str(paths.ROOT)
DECOY = "decoy: the source tree of a clone, whose _C is not built"
FLAGS = ["--nproc", "2", "-b", "8", "-e", "64K", "-f", "8", "-n", "2", "-w", "1", "--trials", "1"]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


@pytest.fixture
def clone_root(tmp_path):
    """A working directory that looks to the ranks like a clone's root without a built _C: a
    `pycollectives` package whose import fails."""
    root = tmp_path / "clone"
    (root / "pycollectives").mkdir(parents=True)
    (root / "pycollectives" / "__init__.py").write_text(f"raise ImportError({DECOY!r})\n")
    return root


def _launcher_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*_TORCHRUN_VARS, "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def test_ranks_ignore_a_source_tree_in_the_working_directory(tmp_path, clone_root):
    """`pycollectives-bench --nproc 2 ...` from a clone's root: the launcher (a console script,
    which has its own directory, not the working one, on sys.path) imports the real package, and
    so must its ranks."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "pycollectives-bench"  # what pip writes for [project.scripts]
    script.write_text("import sys\nfrom pycollectives.bench import main\nsys.exit(main())\n")
    out_json = tmp_path / "rows.json"
    cmd = [sys.executable, str(script), *FLAGS, "--coll", "all", "--json", str(out_json)]
    p = subprocess.run(cmd, cwd=clone_root, env=_launcher_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert DECOY not in p.stderr, p.stderr
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["collective"] for r in rows} == set(COLLECTIVES)
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), rows


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["python-P", "bootstrap"])
def test_bench_command_runs_the_package_not_the_working_directory(
    monkeypatch, capfd, clone_root, safe_path_flag
):
    """Both ways of keeping the working directory off the ranks' sys.path (`python -P` from
    Python 3.11, the `-c` bootstrap before) run a whole --nproc benchmark from the clone's root."""
    if safe_path_flag and sys.version_info < (3, 11):
        pytest.skip("python -P needs Python >= 3.11")
    monkeypatch.setattr(launch, "_SAFE_PATH_FLAG", safe_path_flag)
    assert ("-P" in launch.bench_command([])) == safe_path_flag
    for k in _TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(clone_root)
    rc = main([*FLAGS, "--coll", "all_reduce,broadcast", "--timeout", "110"])
    out, err = capfd.readouterr()
    assert DECOY not in err, err
    assert rc == 0, out + err
    assert out.count("# Out of bounds values : 0 OK") == 2, out


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["python-P", "bootstrap"])
def test_mpirun_runs_the_bench_command(monkeypatch, clone_root, safe_path_flag):
    """The mpirun job (--compare mpi) starts its ranks with the same command: what mpirun would
    run, run from the clone's root, gets to the real benchmark (its --help)."""
    if safe_path_flag and sys.version_info < (3, 11):
        pytest.skip("python -P needs Python >= 3.11")
    monkeypatch.setattr(launch, "_SAFE_PATH_FLAG", safe_path_flag)
    started: list[tuple[list[str], dict[str, str]]] = []

    class _Job:
        def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
            started.append((cmd, env))

        def wait(self, timeout: float | None = None) -> int:
            return 0

    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", _Job)
        assert launch._mpirun(["--help"], 2, time.monotonic() + 60, {}, None) == 0
    [(cmd, env)] = started
    assert cmd[0] == "mpirun"
    rank_cmd = launch.bench_command(["--help"])
    assert cmd[-len(rank_cmd) :] == rank_cmd, cmd
    p = subprocess.run(rank_cmd, cwd=clone_root, env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0 and "usage: pycollectives-bench" in p.stdout, p.stdout + p.stderr


def test_sizes_end_at_the_end_size():
    """-b 8 -e 64M -f 4: the factor steps from 32 MiB to 128 MiB; 64 MiB is still the last size."""
    from pycollectives.bench.specs import size_list

    sizes = size_list(8, 64 << 20, 4)
    assert sizes[0] == 8 and sizes[-2:] == [32 << 20, 64 << 20], sizes
    assert size_list(8, 32 << 20, 4)[-1] == 32 << 20 and size_list(8, 8, 4) == [8]


def test_compare_mpi_without_mpi_fails_before_the_sweep(monkeypatch, capsys):
    """--compare mpi where mpi4py or mpirun is missing: exit 2 at once, naming the install
    command, no rank started."""
    monkeypatch.setattr(launch, "mpi_missing", lambda: ["mpi4py"])
    monkeypatch.setattr(launch, "launch_ranks", lambda *a: pytest.fail("ranks started"))
    for k in _TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        main([*FLAGS, "--compare", "gloo,mpi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--compare mpi needs mpi4py" in err and "pip install mpi4py" in err, err
