"""Pipeline parallelism, the part that needs no communication: schedules as
data, their verifier, their simulator and a timeline drawing.

    from strategies.pipeline import one_f_one_b, verify, simulate
    s = one_f_one_b(p=4, m=8)  # per-rank action lists, sends and receives included
    print(s)  # step x rank table of torch's action strings (2F0, 1SEND_B3)
    verify(s)  # no deadlock, every dependency; else ScheduleError(rank, step)
    simulate(s).bubble_fraction  # 3/11 = (p-1)/(m+p-1)

See docs/pipeline.md for the execution model a runtime must follow.
"""

from strategies.pipeline.actions import Action, Kind, parse_action
from strategies.pipeline.builders import (
    BUILDERS,
    build,
    gpipe,
    ideal_times,
    interleaved_1f1b,
    one_f_one_b,
    with_comms,
    zb_h1,
)
from strategies.pipeline.engine import Record, execute
from strategies.pipeline.schedule import Op, Schedule, ScheduleError, format_table
from strategies.pipeline.simulate import SimResult, peak_activations, simulate, timed_table
from strategies.pipeline.timeline import draw_timeline, missing_matplotlib
from strategies.pipeline.verify import check_static, pair_messages, verify

__all__ = [
    "BUILDERS",
    "Action",
    "Kind",
    "Op",
    "Record",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build",
    "check_static",
    "draw_timeline",
    "execute",
    "format_table",
    "gpipe",
    "ideal_times",
    "interleaved_1f1b",
    "missing_matplotlib",
    "one_f_one_b",
    "pair_messages",
    "parse_action",
    "peak_activations",
    "simulate",
    "timed_table",
    "verify",
    "with_comms",
    "zb_h1",
]
