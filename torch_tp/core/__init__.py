"""The core: applying a plan.

* :mod:`~torch_tp.core.api`: :func:`~torch_tp.parallelize_module`;
* :mod:`~torch_tp.core.plan`: resolving a plan against a model and checking it whole;
* :mod:`~torch_tp.core.style`: the parallel styles, each declaring its contract
  (:mod:`~torch_tp.core.contract`) and registered by it (:mod:`~torch_tp.core.registry`);
  :mod:`~torch_tp.core._names` maps plan names and plain data to styles;
* :mod:`~torch_tp.core._layouts`: the runtimes that change layouts at module boundaries,
  with Megatron's regions (:mod:`~torch_tp.core._regions`) on the fast path;
* :mod:`~torch_tp.core.random`: the RNG tracker the styles draw sequence-parallel dropout
  masks from, and that :func:`~torch_tp.parallelize_module` installs.

The core imports neither the features (:mod:`torch_tp.features`) nor the tools
(:mod:`torch_tp.tools`); private torch APIs come from :mod:`torch_tp._torch_compat`.
"""
