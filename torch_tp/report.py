"""The dry-run report: what a plan costs and what is wrong with it, before anything runs.

The public home of :mod:`torch_tp.tools.report` (the trace in
:mod:`torch_tp.tools.report.trace`, the result and its table in
:mod:`torch_tp.tools.report.render`).
"""

from torch_tp.tools.report import Collective, ParameterGroup, PlanReport, Problem, plan_report

__all__ = ["Collective", "ParameterGroup", "PlanReport", "Problem", "plan_report"]
