"""Pipeline parallel: layout strings, schedule definitions, and the schedule simulator."""

from moetron.pipeline.layout import LayoutError, balanced_layout, estimate_item_costs, parse_layout
from moetron.pipeline.schedules import Action, ScheduleError, build_schedule, validate_schedule
from moetron.pipeline.simulator import simulate

__all__ = ["Action", "LayoutError", "ScheduleError", "balanced_layout", "build_schedule",
           "estimate_item_costs", "parse_layout", "simulate", "validate_schedule"]
