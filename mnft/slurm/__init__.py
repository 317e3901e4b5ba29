"""`mnft train --slurm`: the same job on a Slurm allocation, with mnft's check, logs, metrics and resume.

mnft renders an sbatch script from the run (its #SBATCH options and the command that continues the run inside
the allocation) and submits it; inside the allocation (the batch script, or `salloc`) mnft runs one job step of
host checks on every node, plans one torchrun per node with the launch plan of the SSH path (node_rank from the
node's position in `scontrol show hostnames`, which is SLURM_NODEID; the master by its IPv4 address), and runs
mnft's host agent on every node in one `srun --ntasks-per-node=1 --kill-on-bad-exit=1` step. Recovery is
Slurm's own (`--requeue`, SLURM_RESTART_COUNT) plus mnft's resume rules; a warning signal before the time limit
makes the job save and the batch requeue itself.

    plan        the sbatch script and the srun command lines, from options and the launch plan (pure)
    cluster     what Slurm says: its binaries, partitions and nodes, a job's state, the allocation's nodes
                (sinfo / squeue / scontrol, run and parsed)
    submit      the controller side: checks the request, records the run, writes and submits the script;
                status, stop and logs of a Slurm run
    allocation  inside the allocation: the check step, the plan, the agents' step supervised, requeue on the
                warning signal
    (the host side of the steps, which picks its node's launch by SLURM_NODEID and runs mnft's agent with it:
    the host package's slurmnode)
"""
