"""planner: from a per-layer profile and a topology to a Plan.

One subpackage per idea: `planner.formats` (the Plan data type, profiles and their readers, row
slicing), `planner.schedules` (schedules as specs in one registry, their action lists, lowering,
replay and memory; by name or plan: `planner.schedules.by_name`), `planner.estimate` (the cost
model, DAPPLE eq. 1-3, and the simulator) and `planner.search` (the DAPPLE search, eq. 4-5 with
Fresh / Append / Scatter placement, schedule choice, and the baselines: DP, straight, PipeDream).

Depends only on `topology` (reports live in `reports`, which depends on planner, never the
reverse); never imports TensorFlow or Horovod, so planner-only installs work.
"""
