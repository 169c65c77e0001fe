"""pycollectives.launcher.spawn(survive=True, replace=N): the launcher serves
the job's store (it outlives rank 0), starts a new process in a lost rank's
place (replacing() names the rank), names a replacement by the place it
took (took_place), bounds the replacements, and does not wait for a
replacement that has nothing left to join. Tiny programs without communicators (the one
with the store imports torch for it: seconds each on a loaded machine)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pycollectives.launcher import launcher_store, replacing, spawn, took_place


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_0_replaced() -> int:
    """Rank 0 dies at once; rank 1 waits in the store for rank 0's replacement
    (the store must outlive rank 0), which answers."""
    rank = int(os.environ["RANK"])
    if rank == 0 and replacing() is None:
        _die()
    store = launcher_store(60)
    if rank == 0:
        assert replacing() == 0
        store.set("back", "replacement of 0")
        return 0
    store.wait(["back"])
    print(f"rank 1 heard: {store.get('back').decode()}", flush=True)
    return 0


@pytest.mark.timeout(60)
def test_a_lost_rank_0_is_replaced_and_the_store_outlives_it(capfd):
    assert spawn(_rank_0_replaced, 2, prog="t", survive=True, replace=2) == 0
    out, err = capfd.readouterr()
    assert "rank 1 heard: replacement of 0" in out, (out, err)
    assert "t: rank 0 killed by SIGKILL: a new process takes its place (replacement 1 of 2)" in err


def _rank_1_dies() -> int:
    if os.environ["RANK"] == "1":
        _die()
    time.sleep(30)  # a survivor waiting for a newcomer that never comes
    return 0


@pytest.mark.timeout(60)
def test_with_no_replacement_left_the_run_ends_naming_the_rank(capfd):
    start = time.monotonic()
    assert spawn(_rank_1_dies, 2, prog="t", survive=True, replace=0, grace=1.0) == 128 + 9
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    assert "t: rank 1 killed by SIGKILL, and no replacement is left (0 of 0 used): the run " \
           "ends" in err, err  # fmt: skip
    assert "t: rank 0 still running 1 s after rank 1 failed: killed" in err, err
    assert "t: rank 1 failed first: killed by SIGKILL, and no replacement is left" in err, err


def _lost_after_the_end(marker: str) -> int:
    """Rank 1 dies at once, its replacement waits (as in a grow that will not
    open: the others are done); rank 0 finishes once the replacement runs
    (it creates `marker`)."""
    if os.environ["RANK"] == "1":
        if replacing() is None:
            _die()
        open(marker, "w").close()
        time.sleep(30)
    while not os.path.exists(marker):
        time.sleep(0.01)
    return 0


@pytest.mark.timeout(60)
def test_a_replacement_with_nothing_left_to_join_is_ended_and_the_run_succeeds(capfd, tmp_path):
    start = time.monotonic()
    args = (str(tmp_path / "waiting"),)
    assert spawn(_lost_after_the_end, 2, args, prog="t", survive=True, replace=3, grace=1.0) == 0
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    assert "t: rank 1's replacement still running 1 s after the others finished" in err, err


def test_replace_needs_survive():
    with pytest.raises(ValueError, match="needs survive=True"):
        spawn(_die, 1, prog="t", replace=1)


@pytest.mark.parametrize(
    "env",
    [
        {"PYCOLL_LAUNCHER_STORE": "yes", "MASTER_PORT": "29500"},
        {"PYCOLL_LAUNCHER_STORE": "1", "MASTER_PORT": "-1"},
        {"PYCOLL_LAUNCHER_STORE": "1", "MASTER_PORT": "70000"},
        {"PYCOLL_LAUNCHER_STORE": "1", "MASTER_PORT": "../x"},
        {"PYCOLL_REPLACES": "-3"},
        {"PYCOLL_REPLACES": "1e9x"},
        {"PYCOLL_REPLACES": ""},
    ],
)
def test_a_malformed_launcher_environment_raises_naming_the_variable(monkeypatch, env):
    """The variables spawn() sets are read back checked: a hostile or garbled value raises
    ValueError naming the variable (nothing connects, nothing is indexed by it)."""
    for k in ("PYCOLL_LAUNCHER_STORE", "PYCOLL_REPLACES", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    name = next(k for k in env if k.startswith("PYCOLL"))
    with pytest.raises(ValueError, match=name):
        launcher_store(1.0) if name == "PYCOLL_LAUNCHER_STORE" else replacing()


def _rank_1_stops(marker: str) -> int:
    """Rank 1's first process stops itself (SIGSTOP: it never exits by itself); rank 0
    waits for rank 1's replacement, which creates `marker`."""
    if os.environ["RANK"] == "1":
        if replacing() is None:
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(30)  # not reached unless someone sends SIGCONT
            return 3
        open(marker, "w").close()
        return 0
    while not os.path.exists(marker):
        time.sleep(0.01)
    return 0


@pytest.mark.timeout(60)
def test_a_rank_stopped_past_the_timeout_is_killed_and_replaced(capfd, tmp_path):
    """spawn(stopped=1): rank 1 stopped for 1 s (the survivors' timeout) is killed, and a
    new process takes its place as for a killed rank."""
    marker = str(tmp_path / "replaced")
    assert spawn(_rank_1_stops, 2, (marker,), prog="t", survive=True, replace=1, stopped=1.0) == 0
    err = capfd.readouterr().err
    assert "t: rank 1 stopped (SIGSTOP) for 1 s, past the survivors' timeout: killed" in err, err
    assert "t: rank 1 killed by SIGKILL: a new process takes its place (replacement 1 of 1)" in err


def _rank_1_stops_for_good() -> int:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
        return 3  # not reached
    return 0


@pytest.mark.timeout(60)
def test_a_rank_stopped_when_the_others_finished_is_killed_not_waited_for(capfd):
    """survive without `stopped`: rank 0 finishes while rank 1 stays stopped; the launcher
    kills rank 1 `grace` seconds later (it used to wait for it for ever) and the run succeeds."""
    assert spawn(_rank_1_stops_for_good, 2, prog="t", survive=True, grace=1.0) == 0
    err = capfd.readouterr().err
    assert "t: rank 1 stopped (SIGSTOP) for 1 s, after the others finished: killed" in err, err
    assert "t: rank 1 killed by SIGKILL: the others finished" in err, err


@pytest.mark.parametrize("stopped", [0, -1.0, float("nan")])
def test_stopped_must_be_positive(stopped):
    with pytest.raises(ValueError, match="stopped="):
        spawn(_rank_1_stops_for_good, 2, prog="t", survive=True, stopped=stopped)


def _swapped(folder: str) -> int:
    """Ranks 1 and 2 die; their replacements take each other's place
    (took_place, as newcomers joining in the other order would): the one now
    in place 1 dies in turn, and its replacement (the third) waits; then the
    one now in place 2 fails with an error of its own."""
    rank, r = int(os.environ["RANK"]), replacing()
    if r is None:
        if rank in (1, 2):
            _die()
        time.sleep(30)  # rank 0: ended after the failure
        return 0
    try:
        os.close(os.open(f"{folder}/for{r}", os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # the third replacement: rank 1's place again
        open(f"{folder}/third", "w").close()
        time.sleep(30)
        return 0
    took_place(3 - r)
    if r == 2:  # now rank 1: lost in turn, once the other one holds rank 2
        while not os.path.exists(f"{folder}/for1"):
            time.sleep(0.01)
        _die()
    while not os.path.exists(f"{folder}/third"):
        time.sleep(0.01)
    raise ValueError("the newcomer in rank 2's place failed")


@pytest.mark.timeout(60)
def test_a_replacement_is_named_by_the_place_it_took(capfd, tmp_path):
    assert spawn(_swapped, 3, (str(tmp_path),), prog="t", survive=True, replace=3, grace=1.0) == 1
    err = capfd.readouterr().err
    assert "t: rank 1 (a replacement started for rank 2) killed by SIGKILL: a new process takes " \
           "its place (replacement 3 of 3)" in err, err  # fmt: skip
    assert "t: rank 2: ValueError: the newcomer in rank 2's place failed" in err, err
    assert "t: rank 2 (a replacement started for rank 1) failed first: ValueError: the " \
           "newcomer in rank 2's place failed" in err, err  # fmt: skip
    assert "t: rank 1 still running 1 s after rank 2 (a replacement started for rank 1) " \
           "failed: killed" in err, err  # fmt: skip


def test_took_place_checks_its_rank_and_does_nothing_outside_a_replacement(monkeypatch):
    monkeypatch.delenv("PYCOLL_REPLACES", raising=False)
    monkeypatch.setenv("RANK", "3")
    took_place(1)  # not a replacement: nothing changes
    assert os.environ["RANK"] == "3"
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="took_place: rank="):
            took_place(bad)
