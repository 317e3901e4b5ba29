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
    pyrun       a stdlib-only Python script run on a host in one round-trip
    leases      one operation per host at a time: the controller takes, holds and lets go of host leases
    leasehost   a host's lease file and its flock: take, hold while the controller's channel lives, show
                (stdlib only)
    report      the inventory's effective settings, per-host results and trust outcomes as tables
"""
