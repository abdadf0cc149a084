"""The execution planner: placement, meshes, micro-batches and staleness from a cost model.

``python -m jaxrlhf.plan --config RUN.yaml --cluster h100x8 --out PLAN.yaml`` (docs/planner.md).
Modules: :mod:`hardware` (device rooflines, cluster specs), :mod:`program_cost` (a compiled
program's FLOPs, bytes and collective bytes), :mod:`reshard_cost` (bytes a layout change
moves), :mod:`simulator` (list scheduling over device groups), :mod:`estimate` (one plan's
prediction), :mod:`candidates` (the plans considered), :mod:`search` (exhaustive or
annealing), :mod:`calibration` (``--calibrate``), :mod:`planner` (the command).
"""
