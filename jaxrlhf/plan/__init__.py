"""The execution planner: placement, meshes, micro-batches and staleness from a cost model.

``python -m jaxrlhf.plan --config RUN.yaml --cluster h100x8 --out PLAN.yaml`` (docs/planner.md).
Modules: :mod:`hardware` (device rooflines, cluster specs), :mod:`simulator` (list scheduling
over device groups), :mod:`estimate` (one plan's prediction), :mod:`candidates` (the plans
considered), :mod:`search` (exhaustive or annealing), :mod:`calibration` (``--calibrate``),
:mod:`planner` (the command). A compiled
program's FLOPs, bytes and collective bytes come from :mod:`jaxrlhf.train.program_cost`, the
bytes a weight sync moves from :mod:`jaxrlhf.sharding.reshard`.
"""
