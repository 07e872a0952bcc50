"""planner: from a per-layer profile and a topology to a Plan.

Owns the Plan data type (`planner.plan`), schedules as specs in one registry
(`planner.schedules`; by name or plan: `planner.schedule`), profile
readers, the cost model (DAPPLE eq. 1-3), the DAPPLE search (eq. 4-5 with Fresh / Append /
Scatter placement), the PipeDream baseline and the simulator.

Depends only on `topology` (reports live in `reports`, which depends on planner, never the
reverse); never imports TensorFlow or Horovod, so planner-only installs work.
"""
