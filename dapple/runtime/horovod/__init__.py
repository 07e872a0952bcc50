"""The Horovod runtime: one process (rank) per plan device (`runtime`), the rank layout
(`ranks`), the transport and per-rank step (`transport`) and the stalled-step watchdog
(`watchdog`). Only `ranks` and `watchdog` import without Horovod."""
