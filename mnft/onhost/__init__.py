"""What runs on a host: the host side of every capability, as a package of small modules shipped as one payload.

Each module is one concern and imports only the standard library and its siblings (relative imports: `from . import
procs`), in Python 3.8 syntax: a host has whatever Python it has. The controller never installs these files on a
host. `mnft.hosts.payload` ships an entry module together with the modules it imports (read from the source, not
listed by hand) in one payload on the command's stdin, and `boot` (the payload's first module) serves them to
`import` on the host, from memory, then calls the entry's `main(argv)`.

The controller imports a host module only for its constants and pure functions (what both sides must judge
alike: whose a GPU process is, a root-owned file, a duration, the checkout record, the tree hash), so that each is
written once.

Entries (a `main(argv)`, named by the command that ships them) and the modules they import:

    boot          the payload's reader on the host: its modules served to `import` from memory, the entry's main run
    leasehost     the host's leases (`hold`, `show`, `lab`, `drain`, `usage`, `rundirs`): leases (take, release, show,
                  lab), line (the waiting line's tickets, its fair order, max_waiting), labpolicy (the lab
                  admin's rules: /etc/mnft/lab.yaml), hold (the held process and the runs it forks),
                  leasefiles (the lease directory and its files, safely opened), runs (a run's processes, collisions),
                  gpuread (the GPUs read for a take or a look, topology, pick), smi (nvidia-smi within a bound),
                  gpucache (this boot's records), health (what is wrong with a GPU), kernellog (the Xids, read where
                  this user may: /dev/kmsg, mnft's reader through sudo, the journal), nvml (NVML through ctypes),
                  drain (admins' marks), usageread (`lab --usage`)
    agent         a run on this host (`launch`, `keep`, `stop`, `status`, `tail`, `pack`, sessions): launcher (start,
                  supervise), keeper (the run's session leader), runprocs (the run's processes, proved and signalled),
                  runleases (the leases a keeper holds), watches (idle and collision watches; the lab's idle_stop
                  from labpolicy), samples (straggler
                  samples), follow (files followed as they grow), queries (status, tail, checkpoints, logs packed),
                  sessions (`mnft shell`), containers (a run's container), rungpus (nvidia-smi for a run),
                  runfiles (a run directory's files)
    probe         check's facts and network tests in one round-trip or one session: facts, nettest, probeout
    treehash      a tree's identity, also the controller's: checkout (the record of what mnft placed, job
                  directories, snapshots), sharemarks (who shares a directory), systemdirs, filehash
    envhost       provision's host side: envfacts (Pythons, platform, an environment's distributions), meshpeers
    uninstallhost uninstall's host side
    imagehost     an image's identity on a host; save, load, place and clean for `sync --image` (meshpeers: whom it relays from)
    setuphost     setup's file and nftables edits, with a dead-man revert; fit_drain (drain: the drain file to the admins of now)
    linkagent     the link test's TCP sink/source and RTT client
    torchlaunch   starts a shipped torchrun entry (perf's all_reduce) bounded by the controller's connection
    slurmnode     under `srun` on every node: its launch by SLURM_NODEID, the agent run with it
    superhost     a detached run's supervisor: its bundle unpacked, its directory prepared, it started in a session of
                  its own, its state read, its stop asked (runprocs: its pid proved by its start time; meshpeers)

Shared by several entries, and by the controller (written once): procs (whose a process is), rootfiles (a file only
root can have written; durations), usage (the usage log's line and its writing).

Standalone (each imports nothing of the package and runs as a file of its own): entry, the launch wrapper every rank
runs its entry point through, written into the run directory; xidreader, the reader of the kernel log's Xid lines
that `mnft setup`'s kernel_log step installs root-owned for the members to run through sudo (kernellog reads
/dev/kmsg through its kmsg_records too).
"""
