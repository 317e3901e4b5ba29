"""`invoke check --perf`: is the cluster as fast as its hardware allows, and which host is not?

    schedule    pure: the round-robin tournament of disjoint host pairs, the link test's duration, the sizes
    (on every host: the host package's linkagent, a TCP sink/source and the RTT/throughput client; torchlaunch,
    which starts allreduce under torchrun)
    links       controller side of the link matrix: one agent per host, driven round by round
    allreduce   torchrun entry module: matmul TFLOP/s per rank, then all_reduce over message sizes
    collectives starts the allreduce job with torchrun on every host (fleet.run, bounded)
    evaluate    pure: measurements in, a verdict per host and the problems with a fix out
    report      the per-host table, the problems, --json, the heatmap PNG
    gather      runs the above after the ordinary check
"""
