"""planner: from a per-layer profile and a topology to a Plan.

Owns the Plan data type (`planner.plan`), schedules as data (`planner.schedule`), profile
readers, the cost model (DAPPLE eq. 1-3), the DAPPLE search (eq. 4-5 with Fresh / Append /
Scatter placement), the PipeDream baseline, the simulator and the strategy reports.

Depends only on `topology`; never imports TensorFlow or Horovod, so planner-only installs work.
"""
