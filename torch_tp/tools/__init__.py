"""The tools: what helps to write, check and try plans, built on the core and never used by it.

* :mod:`torch_tp.tools.report`: the dry-run report (:func:`torch_tp.report.plan_report`), a
  trace of the model on the meta device (:mod:`~torch_tp.tools.report.trace`) and its
  rendering (:mod:`~torch_tp.tools.report.render`);
* :mod:`torch_tp.tools.plan_cli`: ``python -m torch_tp plan``;
* :mod:`torch_tp.tools.demo`: ``python -m torch_tp demo``.

The command line itself is ``torch_tp/__main__.py``.
"""
