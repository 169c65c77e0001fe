"""Pipeline parallelism: schedules as data, their verifier, their simulator
and a timeline drawing; and the runtime that executes them on pycollectives.

    from pycollectives.strategies.pipeline import one_f_one_b, verify, simulate
    s = one_f_one_b(p=4, m=8)  # per-rank action lists, sends and receives included
    print(s)  # step x rank table of torch's action strings (2F0, 1SEND_B3)
    verify(s)  # no deadlock, every dependency; else ScheduleError(rank, step)
    simulate(s).bubble_fraction  # 3/11 = (p-1)/(m+p-1)

    stages = gpt_stages(config, s.stages_of(comm.rank), s.num_stages)
    runtime = PipelineRuntime(s, stages, comm)  # comm: the pipeline communicator
    result = runtime.step(microbatches)  # gradients in .grad; result.records

See docs/pipeline.md for the execution model and the runtime.
"""

from .actions import Action, Kind, parse_action
from .autograd_stage import ActivationLedger, AutogradStage
from .builders import (
    BUILDERS,
    build,
    gpipe,
    ideal_times,
    interleaved_1f1b,
    one_f_one_b,
    with_comms,
    zb_h1,
)
from .execution_model import Record, check_static, execute, pair_messages, verify
from .gpt_stage import GPTStage, TensorSpec, balance, gpt_stages, layer_split
from .runtime import PipelineError, PipelineRuntime, StepResult, run_step
from .schedule import Op, Schedule, ScheduleError, format_table
from .simulate import SimResult, peak_activations, simulate, timed_table
from .split_backward import WeightGradStore
from .split_layers import (
    SplitColumnParallelLinear,
    SplitLinear,
    SplitLMHead,
    SplitParallelLMHead,
    SplitRowParallelLinear,
    deferred_parameters,
    split_weight_gradients,
)
from .timeline import (
    Measured,
    chrome_trace,
    draw_measured_and_simulated,
    draw_timeline,
    draw_timelines,
    measure,
    missing_matplotlib,
    normalized,
    save_chrome_trace,
)

__all__ = [
    "BUILDERS",
    "Action",
    "ActivationLedger",
    "AutogradStage",
    "GPTStage",
    "Measured",
    "PipelineError",
    "PipelineRuntime",
    "SplitColumnParallelLinear",
    "SplitLMHead",
    "SplitLinear",
    "SplitParallelLMHead",
    "SplitRowParallelLinear",
    "StepResult",
    "TensorSpec",
    "WeightGradStore",
    "balance",
    "chrome_trace",
    "draw_measured_and_simulated",
    "draw_timelines",
    "gpt_stages",
    "layer_split",
    "measure",
    "normalized",
    "run_step",
    "save_chrome_trace",
    "deferred_parameters",
    "split_weight_gradients",
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
