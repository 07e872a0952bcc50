"""topology: the cluster a plan runs on: hosts, devices per host, device memory, and the links
inside a host and between hosts (bandwidth, latency). Presets for the DAPPLE paper's configs A,
B and C, a spec-string parser and a JSON form.

Depends on nothing else in dapple; never imports TensorFlow or Horovod.
"""
