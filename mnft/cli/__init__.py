"""mnft's command line, on top of every capability: Invoke tasks that parse arguments, call the capability
and map its errors to exit codes.

    parsing     Invoke glue: the verbatim words after `--`, optional positional arguments
    tasks       the task collection (`invoke TASK` in the checkout, `mnft TASK` anywhere)
    main        the `mnft` console command: an Invoke Program over the tasks
    local.yaml  the default inventory: this machine only, no SSH (installed with the package)
"""
