"""The dry-run report: what a plan costs and what is wrong with it, before anything runs, on a
model built on the meta device.

* :mod:`torch_tp.report.plan`: :func:`plan_report`, a tensor-parallel plan's parameters per
  rank, the collectives of one training step and the plan's problems;
* :mod:`torch_tp.report.trace`: how the collectives are predicted, by running the
  unparallelized model once on meta tensors and following each tensor's layout by the
  styles' contracts;
* :mod:`torch_tp.report.adapters`: PEFT's LoRA layers a style hosts, traced as their base
  layer's style computes them (the adapters' parameters per rank, their partial sums in a
  row-parallel base's reduction, their partial gradients);
* :mod:`torch_tp.report.quality`: what a plan splits per block (linear parameters, matmul
  FLOPs) and the modules it computes whole;
* :mod:`torch_tp.report.render`: the result (:class:`PlanReport`) and its printed table;
* :mod:`torch_tp.report.pipeline`: :func:`pipeline_report`, per pipeline stage.
"""

from torch_tp.report.pipeline import PipelineReport, StageRow, pipeline_report
from torch_tp.report.plan import plan_report
from torch_tp.report.render import (
    BlockQuality,
    Collective,
    ParameterGroup,
    PlanReport,
    Problem,
)

__all__ = [
    "BlockQuality",
    "Collective",
    "ParameterGroup",
    "PipelineReport",
    "PlanReport",
    "Problem",
    "StageRow",
    "pipeline_report",
    "plan_report",
]
