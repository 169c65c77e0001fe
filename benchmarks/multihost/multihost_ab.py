"""A/B of two builds of the extension, or of two settings, across hosts: 2 hosts
x 1 rank over veth (tests/support/netns.py; root only), all-reduce, all-gather and
reduce-scatter at 2 and 16 MiB with pycollectives only (benchmarks/
multihost.py's job_sweep).

The two builds' `_C*.so` (--old, --new; either left out: the installed one)
are copied in turn into pycollectives/ before each round, in alternating
order (old, new; new, old; ...), and the installed one is put back at the
end. Where the Python side changed too, --old-tree names a source tree built
in place (`python setup.py build_ext --inplace`) whose pycollectives the old
side's ranks import instead (e.g. `git archive main | tar -x -C /tmp/main`). --old-env / --new-env (NAME=VALUE, repeatable) set environment variables
(PYCOLL_SOCKET_BUFFER, PYCOLL_NSLOTS, ...) for that side's ranks only, so one
build's settings can be compared the same way. On a shared machine the time
per call moves several-fold between rounds, so the table gives, beside the
medians, the median over rounds of new/old (each round's pair run back to
back) and in how many rounds the new side was faster. Writes its section of
docs/benchmarks.md (--section names its markers).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))

import netns  # noqa: E402
from multihost_jobs import run_on_hosts  # noqa: E402

# (_doc and multihost import pycollectives: main() imports them, so that the
# ranks, which import this script first, can take it from --old-tree.)
SIZES = [2 << 20, 16 << 20]
COLLS = ["all_reduce", "all_gather", "reduce_scatter"]


def table(res: dict[tuple, list[float]], colls: list[str], sizes: list[int]) -> list[str]:
    """Medians (ms), their ratio, the median of the rounds' ratios, the rounds won."""
    import _doc

    out = [
        "| collective | size | old ms | new ms | new / old (medians) "
        "| new / old (median over rounds) | rounds new faster |",
        "|---|---|---|---|---|---|---|",
    ]
    for coll in colls:
        for size in sizes:
            old, new = res[(coll, size, "old")], res[(coll, size, "new")]
            ratios = [b / a for a, b in zip(old, new, strict=True)]
            o, n = statistics.median(old), statistics.median(new)
            out.append(
                f"| {coll} | {_doc.size_label(size)} | {o * 1e3:.2f} | {n * 1e3:.2f} | "
                f"{n / o:.2f} | {statistics.median(ratios):.2f} | "
                f"{sum(r < 1 for r in ratios)}/{len(ratios)} |"
            )
    return out


def parse_env(items: list[str], option: str) -> dict[str, str]:
    """{NAME: VALUE} from NAME=VALUE strings; raises SystemExit naming the
    option for an item without '=' or with an empty name."""
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"multihost_ab: {option} takes NAME=VALUE, not {item!r}")
        env[name] = value
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the baseline build's _C*.so (default: the installed one)")
    ap.add_argument("--old-tree", help="a source tree built in place, for the baseline's ranks")
    ap.add_argument("--sizes", help="comma-separated sizes in bytes (default: 2 MiB, 16 MiB)")
    ap.add_argument("--colls", help=f"comma-separated collectives (default: {','.join(COLLS)})")
    ap.add_argument("--new", help="the candidate build's _C*.so (default: the installed one)")
    for side in ("old", "new"):
        ap.add_argument(
            f"--{side}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"an environment variable for the {side} side's ranks (repeatable)",
        )
    ap.add_argument("--what", default="", help="what the new build changes (for the notes)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--section",
        default="multihost_ab",
        help="the name of its markers in docs/benchmarks.md (a new name appends a section, "
        "leaving earlier A/B records in place)",
    )
    args = ap.parse_args()
    import _doc
    import multihost

    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else SIZES
    colls = args.colls.split(",") if args.colls else COLLS
    trees = {"old": args.old_tree, "new": None}
    envs = {
        side: parse_env(getattr(args, f"{side}_env"), f"--{side}-env") for side in ("old", "new")
    }
    if netns.unavailable():
        sys.exit(f"multihost_ab: {netns.unavailable()}")
    installed = next((ROOT / "pycollectives").glob("_C*.so"))
    keep = installed.read_bytes()
    res: dict[tuple, list[float]] = {}
    try:
        with netns.Fabric(2) as fabric:
            for rnd in range(args.rounds):
                for which in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                    if getattr(args, which):
                        shutil.copyfile(getattr(args, which), installed)
                    else:
                        installed.write_bytes(keep)
                    rows = run_on_hosts(
                        fabric,
                        [0, 1],
                        multihost.job_sweep,
                        colls,
                        sizes,
                        0,
                        env=envs[which],
                        timeout=300,
                        tree=trees[which],
                    )[0]
                    for _, coll, size, sec in rows:
                        res.setdefault((coll, size, which), []).append(sec)
                    print(rnd, which, [(c, s, f"{t * 1e3:.2f} ms") for _, c, s, t in rows])
    finally:
        installed.write_bytes(keep)
    notes = [
        "Hosts: network namespaces on one machine, one veth pair each to a bridge; the "
        "machine is shared with other jobs",
        f"{args.rounds} rounds, each running both builds back to back (order alternating); "
        "a round's time is the median of 3 repetitions (multihost.py's job_sweep)",
    ]
    for side in ("old", "new"):
        build = getattr(args, side) or trees[side] or "the installed build"
        env = " ".join(f"{k}={v}" for k, v in envs[side].items()) or "default settings"
        notes.append(f"{side.capitalize()}: {Path(build).name}, {env}")
    if args.what:
        notes.append(f"What the new side changes: {args.what}")
    _doc.emit_section(
        f"<!-- {args.section}:begin -->",
        f"<!-- {args.section}:end -->",
        "Across hosts: A/B of two builds or settings (2 hosts x 1 rank)",
        "`sudo python benchmarks/multihost/multihost_ab.py " + shlex.join(sys.argv[1:]) + "`",
        notes,
        table(res, colls, sizes),
        not args.no_write,
    )


if __name__ == "__main__":
    main()
