"""Regenerate expected.json: how Ansible itself reads each inventory here (`ansible-inventory --list`: every
host's merged variables; `ansible all --list-hosts`: its host order), for tests/test_inventory.py to hold mnft's
INI reader to. Needs ansible-core (the `bench` extra): python3 tests/data/ansible-ini/make.py"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    version = subprocess.run(["ansible", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    out: dict = {"ansible": version}
    for path in sorted(HERE.glob("*.ini")):
        done = subprocess.run(["ansible-inventory", "-i", str(path), "--list"], capture_output=True, text=True,
                              env={"ANSIBLE_INVENTORY_UNPARSED_FAILED": "1", "ANSIBLE_INVENTORY_ENABLED": "ini",
                                   "PATH": "/usr/bin:/bin:" + str(Path(__import__("sys").executable).parent)})
        if done.returncode:
            why = [line for line in done.stderr.splitlines() if "with 'ini' plugin:" in line]
            out[path.name] = {"error": (why or done.stderr.strip().splitlines())[0].split("plugin: ", 1)[-1]}
            continue
        listed = subprocess.run(["ansible", "all", "-i", str(path), "--list-hosts"], capture_output=True, text=True,
                                check=True).stdout.splitlines()[1:]
        out[path.name] = {"hostvars": json.loads(done.stdout)["_meta"]["hostvars"],
                          "list_hosts": [line.strip() for line in listed]}
    (HERE / "expected.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
