"""The hosts and how mnft reaches them.

    inventory   which hosts take part, in node_rank order, and how to reach each (mnft YAML, Ansible YAML or INI,
                hostfile)
    ansible     an Ansible inventory's groups, ranges and variables, translated into mnft's host settings
    ansible_ini an Ansible INI inventory read as Ansible reads it, into the YAML form's shape
    settings    one host's settings: the keys, their defaults, validation; the Host and Inventory values
    hostkeys    which SSH host keys are trusted; recording a new one is an explicit act
    trust       `invoke trust-hosts`: read, judge and record hosts' keys
    command     remote commands as argument lists, quoted once per shell layer, secrets never on the line
    connection  the one connection factory: verified SSH (Fabric/paramiko) or the local machine
    fleet       one command on every host in parallel, one outcome per host (ok/failed/unreachable/rejected)
    fanin       hosts connecting to hosts: batches no sshd receives more than K of (MaxStartups), drops retried
    pyrun       a host module of mnft.onhost run on a host in one round-trip, its payload on stdin
    payload     what a host command ships: its entry and the host modules it imports, found in their source
    leases      the controller takes, holds and lets go of leases: a run's devices and workdir, a sync's
                directory, the whole host for setup and provision; waits in line for them (--wait)
    terminal    an interactive terminal on a host over the verified connection (pty, raw keys, window size); -L forwarding
    usage       the hosts' usage logs summed: GPU-hours per user and host, idle share, longest waits (pure)
    lab         the lab as its people share it: every device's holder, the rows of `mnft lab`, --nodes' pick
    report      the inventory's effective settings, per-host results and trust outcomes as tables
"""
