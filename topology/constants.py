"""Every hardware constant of the topology package, stated once, with its source.

Bandwidths are bytes per second, latencies seconds, memory bytes. Network rates quoted in
bits per second (Gbps) are divided by 8.
"""

GB = 1e9          # bandwidths and link rates use decimal units, as vendors quote them
GiB = 2 ** 30     # device memory uses binary units, as "16 GB" V100s hold 16 GiB

# Inside a DGX-1-class server: the DAPPLE paper (§VI-B) quotes NVLink "up to 130 GB/s", which is
# also about the allreduce bus bandwidth NCCL reaches on 8 V100s with NVLink.
NVLINK_BANDWIDTH = 130 * GB
# Per-transfer latency of an NVLink/NCCL point-to-point send: a few microseconds (NCCL's
# documented small-message latency is ~5-10 us); we use 10 us.
NVLINK_LATENCY = 10e-6

# Ethernet of the paper's Table III configs: 25 Gbps (A, B) and 10 Gbps (C).
ETHERNET_25G_BANDWIDTH = 25e9 / 8
ETHERNET_10G_BANDWIDTH = 10e9 / 8
# Per-transfer latency over TCP/IP Ethernet between servers (a round of a gRPC/NCCL-socket send
# including the software stack); commonly measured at 30-100 us, we use 50 us.
ETHERNET_LATENCY = 50e-6

# V100 16 GB (DAPPLE paper §VI-A, Table III).
V100_MEMORY = 16 * GiB

# Defaults of a spec string that names only its shape, e.g. "1x3": V100 16 GB, NVLink inside a
# host, 25 Gbps between hosts (the paper's config A hardware).
DEFAULT_DEVICE_MEMORY = V100_MEMORY
DEFAULT_INTRA_HOST_BANDWIDTH = NVLINK_BANDWIDTH
DEFAULT_INTER_HOST_BANDWIDTH = ETHERNET_25G_BANDWIDTH

# One host of N logical CPU devices (TF's `set_logical_device_configuration`), used by the
# single-machine demo. A "transfer" is a tensor copy between executor threads of one process:
# a memcpy at a few GB/s on a shared memory bus (a conservative single-thread memcpy rate),
# plus the executor's dispatch of a cross-device op, tens of microseconds.
LOCAL_CPU_COPY_BANDWIDTH = 5 * GB
LOCAL_CPU_COPY_LATENCY = 50e-6
# Memory of each logical device when the machine's RAM cannot be read: 4 GiB.
LOCAL_CPU_FALLBACK_MEMORY = 4 * GiB
