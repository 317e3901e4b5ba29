"""`invoke setup`: a playbook of named steps run on every host (SSH trust mesh, /etc/hosts names, a
peers-only firewall, reserved ports): read -> plan -> apply -> report, idempotent, with --check and --undo.

    playbook    the playbook read and validated, its steps run, the outcome table
    steps/      one module per step (pure plans, their remote read and apply)
    setup.yaml  the default playbook (installed with the package)
"""
