"""Pipeline parallel: layout strings, schedule definitions, and the schedule simulator."""

from moetron.pipeline.layout import LayoutError, balanced_layout, item_costs, parse_layout
from moetron.pipeline.schedules import Action, ScheduleError, build_schedule, validate_schedule
from moetron.pipeline.simulator import simulate

__all__ = ["Action", "LayoutError", "ScheduleError", "balanced_layout", "build_schedule",
           "item_costs", "parse_layout", "simulate", "validate_schedule"]

# The runtime: stage modules built from a model, P2P, and the schedule executor.
from moetron.pipeline.stage import (  # noqa: E402
    MicroBatch,
    PipelineStageModule,
    build_stage_modules,
    even_layout,
)
from moetron.pipeline.runtime import (  # noqa: E402
    PipelineResult,
    reduce_shared_gradients,
    run_schedule,
    sync_shared_parameters,
)

__all__ += ["MicroBatch", "PipelineResult", "PipelineStageModule", "build_stage_modules", "even_layout",
            "reduce_shared_gradients", "run_schedule", "sync_shared_parameters"]
