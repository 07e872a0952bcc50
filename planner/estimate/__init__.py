"""Estimates: the cost model (DAPPLE eq. 1-3), per-task durations, and the discrete-event simulator."""
