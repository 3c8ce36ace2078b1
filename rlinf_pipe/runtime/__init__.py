"""The Ray runtime: the cluster, `Worker` and `WorkerGroup` with their verbs, the device locks of shared GPUs."""
