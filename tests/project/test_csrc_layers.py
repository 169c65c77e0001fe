"""The layers of csrc/: every `#include "..."` names a file of csrc/ in the includer's own
folder or a lower one, core < reduce < transport < algo < comm < cuda < bindings, and no
transport reaches into another's folder (transport/shm/, tcp/, cma/ share only transport/conn.h).
Reads the sources; builds nothing."""

from __future__ import annotations

import re
from pathlib import Path

import paths

ROOT = paths.ROOT
CSRC = ROOT / "csrc"
# Lowest first: a folder may include its own files and those of the folders before it.
LAYERS = ["core", "reduce", "transport", "algo", "comm", "cuda", "bindings"]
SOURCE_SUFFIXES = {".h", ".cc", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def includes(csrc: Path) -> list[tuple[str, str]]:
    """Every (includer, included) pair of csrc/'s sources, both relative to csrc/."""
    pairs = []
    for f in sorted(csrc.rglob("*")):
        if f.suffix in SOURCE_SUFFIXES and f.is_file():
            rel = f.relative_to(csrc).as_posix()
            pairs += [(rel, inc) for inc in INCLUDE.findall(f.read_text())]
    return pairs


def violations(csrc: Path) -> list[str]:
    """What breaks the layering of the tree at `csrc`, one line each (empty: nothing)."""
    found = []
    for top in sorted(p.name for p in csrc.iterdir() if p.is_dir()):
        if top not in LAYERS:
            found.append(f"csrc/{top}/ is in no layer: add it to LAYERS and README's map")
    for src, inc in includes(csrc):
        where = f"csrc/{src} includes {inc!r}"
        if not (csrc / inc).is_file():
            found.append(f"{where}, not a file of csrc/")
            continue
        a, b = src.split("/")[0], inc.split("/")[0]
        if a not in LAYERS or b not in LAYERS:
            continue  # reported above
        if LAYERS.index(b) > LAYERS.index(a):
            found.append(f"{where}: an upward include ({a} is below {b})")
        elif a == b == "transport":
            sa, sb = src.split("/"), inc.split("/")
            if len(sb) > 2 and (len(sa) == 2 or sa[1] != sb[1]):
                found.append(f"{where}: a transport's folder from outside it")
    return found


def test_csrc_includes_go_down() -> None:
    assert includes(CSRC), "no includes found: csrc/ moved?"
    assert violations(CSRC) == []


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return tmp


def test_checker_finds_each_kind(tmp_path: Path) -> None:
    """The check itself fails on what it guards against (the include of comm/topology.h by
    transport/tcp_net.h that it was written after, among others)."""
    tree = _tree(
        tmp_path,
        {
            "core/topology.h": "",
            "comm/topology.h": "",
            "transport/conn.h": "",
            "transport/shm/fifo.h": '#include "transport/conn.h"\n#include "core/topology.h"\n',
            "transport/tcp/net.h": '#include "comm/topology.h"\n',
            "transport/cma/cma.h": '#include "transport/shm/fifo.h"\n',
            "transport/bad.h": '  #  include "transport/tcp/net.h"\n',
            "algo/x.cc": '#include "algo/gone.h"\n#include <vector>\n',
            "extra/y.h": "",
        },
    )
    got = violations(tree)
    assert len(got) == 5, got
    assert "csrc/extra/ is in no layer" in got[0]
    assert "algo/x.cc includes 'algo/gone.h', not a file" in got[1]
    assert "transport/bad.h includes 'transport/tcp/net.h': a transport's folder" in got[2]
    assert "transport/cma/cma.h includes 'transport/shm/fifo.h': a transport's folder" in got[3]
    assert "transport/tcp/net.h includes 'comm/topology.h': an upward include" in got[4]
