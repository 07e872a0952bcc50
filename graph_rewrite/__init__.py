"""graph_rewrite: a Keras model plus a Plan become the pipelined training step.

Cuts the model's layer graph into stages (every tensor crossing a cut is a boundary tensor),
splits the global batch into micro-batches and each micro-batch among a stage's replicas,
builds each (stage, replica, micro-batch) forward and backward unit, joins stages with
split/concat boundaries, accumulates gradients, sums them across replicas and applies them
once, and lowers the plan's schedule (`planner.schedules.by_name`) to control dependencies.

Reads Plans; never calls the search. Depends on `planner` (plan, schedule) and TensorFlow.
"""
