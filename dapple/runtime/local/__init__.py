"""The local runtime: every unit of the plan in this process (`runtime`); its transport is the
step's own (`graph_rewrite.local_transport`)."""
