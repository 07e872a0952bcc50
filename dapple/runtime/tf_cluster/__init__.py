"""The TensorFlow-cluster runtime: one `tf.distribute.Server` per plan device, one client.

`dapple launch --runtime=tensorflow` starts a server per slot (`launch`, `server`) and runs the
training script once, as task 0 (the chief), with the cluster in `DAPPLE_TF_CLUSTER`.
`import dapple` then connects this process to the cluster (`cluster`) before the script builds
its model, and `PipelinedModel` runs the step the local runtime builds with plan device d on
task d (`runtime`):
stage boundaries become TensorFlow's own buffered Send/Recv over gRPC. The chief watches the
other tasks and ends the job when one stops answering (`watchdog`).
"""
