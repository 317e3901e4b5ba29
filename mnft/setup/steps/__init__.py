"""Setup steps, one module each: pure plan functions tested with data, plus their remote read and apply.

`mnft.setup.playbook` maps a playbook's step name to its module (`STEPS`), validates parameters against each
module's `PARAMS` and runs `module.run(ctx, params)` (or `module.undo`). `base` is what every step shares;
`remote` is the host side (stdlib only, shipped through pyrun); `blocks` edits marked blocks of a text file.
"""
