"""Setup steps, one module each: pure plan functions tested with data, plus their remote read and apply.

`STEPS` maps a playbook's step name to its module; `mnft.setup.playbook` validates parameters against each
module's `PARAMS` and runs `module.run(ctx, params)` (or `module.undo`).
"""

from __future__ import annotations

from mnft.setup.steps import authorized_keys, firewall, hosts_file, mesh, reserved_ports

STEPS = {
    "authorized_keys": authorized_keys,
    "mesh": mesh,
    "hosts_file": hosts_file,
    "firewall": firewall,
    "reserved_ports": reserved_ports,
}
USES_ADDRESSES = ("mesh", "hosts_file", "firewall")
