"""Where a `PipelinedModel`'s step runs: the `Runtime` interface (`base`), the choice of one
(`choice`), the launchers (`launch`, `rank_processes`), and one folder per backend:

* `local/`: every unit in this process, each on its own device;
* `horovod/`: one unit per Horovod rank, with its transport, rank layout and step watchdog;
* `tf_cluster/`: every unit from this process on a TensorFlow cluster's tasks.

Runtimes live in `dapple/`, not `graph_rewrite/`: they own the process (Horovod's start,
broadcasts, checkpoints, devices), while the step they run (`graph_rewrite.pipeline`) and its
in-process transport stay below them. Importing this package imports no backend.
"""
