#!/usr/bin/env python3
"""Benchmark: `invoke provision` on N simulated hosts (default 8) against the ways a lab does it today, side by side
in one run on the same lock and wheels:

  mnft cold      fresh hosts with `invoke setup`'s SSH mesh: wheels relayed host to host, uv, link swap, verified
  mnft no-op     the same again: nothing to do
  pip parallel   a plain copy of the wheelhouse to every host (rsync from the controller, all at once), then
                 `ssh host python3 -m venv … && pip install --no-index --find-links … -r lock` on all hosts at once
  ansible pip    ansible.builtin.pip (virtualenv, --no-index --find-links over the copies above), forks=N, if
                 ansible-core is installed (`pip install -e '.[bench]'`)

The lock is a transformers stack (no torch: `--lock FILE` for another) compiled by `uv pip compile` from this
machine's local package index; the controller's wheelhouse is filled before timing (every method starts from the
same wheels on the controller). Prints seconds, ratios to the pip baseline, and the bytes the controller sent
(its bridge's tx counter) against the wheelhouse size. Needs root (the simulated cluster).

    python bench/provision.py [--hosts 8] [--lock FILE] [--skip-ansible]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

BASE_PYTHON = "/usr/bin/python3"
REQUIREMENTS = "transformers\npyyaml\ntokenizers\nsafetensors\nnumpy\n"
LOCAL_SOURCES = ["--index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple", "--find-links", "/opt/wheels"]


def compile_lock(work: Path) -> Path:
    import uv

    (work / "bench.in").write_text(REQUIREMENTS)
    done = subprocess.run([uv.find_uv_bin(), "pip", "compile", "bench.in", "--offline", "--no-config", "--quiet", *LOCAL_SOURCES,
                           "--index-strategy", "unsafe-best-match", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
                           "--generate-hashes", "-o", "compiled.lock"], cwd=work, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"uv pip compile failed: {done.stderr.strip()}")
    lock = work / "requirements.lock"
    header = "\n".join(f"{a} {b}" for a, b in zip(LOCAL_SOURCES[::2], LOCAL_SOURCES[1::2]))
    lock.write_text(header + "\n" + (work / "compiled.lock").read_text())
    return lock


def invoke(env: dict, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def tx_bytes(cluster: Cluster) -> int:
    return int(Path(f"/sys/class/net/{cluster.bridge}/statistics/tx_bytes").read_text())


def timed(fn):
    started = time.monotonic()
    result = fn()
    return time.monotonic() - started, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--lock", type=Path)
    parser.add_argument("--skip-ansible", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-provision-"))
    env = dict(os.environ, HOME=str(work / "home"), MNFT_HOME=str(work / "mnft-home"), PYTHONUNBUFFERED="1")
    (work / "home").mkdir()
    lock = args.lock.resolve() if args.lock else compile_lock(work)
    cluster = Cluster.create(args.hosts, work / "cluster", outsider=False)
    rows: list[tuple[str, float, str]] = []
    try:
        inventory = cluster.write_inventory(work / "inventory.yaml", python=BASE_PYTHON)
        book = work / "trust.yaml"
        book.write_text("- name: controller key\n  authorized_keys: {}\n- name: mesh\n  mesh: {}\n")
        done = invoke(env, "setup", "--hosts", str(inventory), "--playbook", str(book))
        if done.returncode != 0:
            sys.exit(f"setup failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        # the controller's wheelhouse first (every method starts from the same wheels here), untimed
        from mnft.env import lockfile
        from mnft.env.wheelhouse import Platform, Wheelhouse

        os.environ["MNFT_HOME"] = env["MNFT_HOME"]
        parsed = lockfile.load(lock)
        house = Wheelhouse(Path(env["MNFT_HOME"]) / "wheelhouse")
        libc = os.confstr("CS_GNU_LIBC_VERSION").split()[1]
        here = Platform(parsed.python or "3.11", os.uname().machine, "glibc", libc)
        wheels = house.resolve(parsed, {here: parsed.pins_for(lockfile.marker_environment(platform.python_version(), here.arch))})
        files = [w.file for ws in wheels.values() for w in ws.values()]
        wheel_bytes = sum((house.root / f).stat().st_size for f in files)

        # ---- mnft cold
        before = tx_bytes(cluster)
        cold_s, done = timed(lambda: invoke(env, "provision", "--hosts", str(inventory), "--lock", str(lock), "--json"))
        sent = tx_bytes(cluster) - before
        if done.returncode != 0:
            sys.exit(f"mnft provision failed: {done.stdout[-3000:]}{done.stderr[-3000:]}")
        report = json.loads(done.stdout)
        # ---- mnft no-op
        noop_s, again = timed(lambda: invoke(env, "provision", "--hosts", str(inventory), "--lock", str(lock), "--json"))
        if again.returncode != 0 or json.loads(again.stdout)["changed"] != 0:
            sys.exit(f"the second run was not a no-op: {again.stdout[-2000:]}{again.stderr[-2000:]}")
        noop_work = json.loads(again.stdout)["seconds"]  # the provisioning itself, without starting Python and invoke

        # ---- pip parallel: a plain copy of the wheelhouse per host, then pip install on every host at once
        stage = work / "stage"
        stage.mkdir()
        for f in files:
            os.link(house.root / f, stage / f)
        pip_lock = work / "pip.lock"  # the same pins and hashes, without the index lines (pip gets --no-index)
        pip_lock.write_text("\n".join(ln for ln in lock.read_text().splitlines() if not ln.startswith("--")) + "\n")
        ssh_base = ["ssh", "-F", "/dev/null", "-i", str(cluster.controller_key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                    "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "IdentitiesOnly=yes"]

        def copy(host) -> None:
            rsh = " ".join(shlex.quote(w) for w in ssh_base)
            subprocess.run(["rsync", "-a", "-e", rsh, f"{stage}/", f"root@{host.address}:pip-wheels/"], check=True, capture_output=True)
            subprocess.run(["rsync", "-a", "-e", rsh, str(pip_lock), f"root@{host.address}:pip.lock"], check=True, capture_output=True)

        def pip_install(host) -> None:
            script = (f"{BASE_PYTHON} -m venv --without-pip /root/pip-env && {shlex.quote(cluster.python)} -m pip --python /root/pip-env/bin/python "
                      "install --quiet --disable-pip-version-check --no-index --find-links /root/pip-wheels --require-hashes -r /root/pip.lock")
            subprocess.run([*ssh_base, f"root@{host.address}", script], check=True, capture_output=True, timeout=1800)

        with ThreadPoolExecutor(max_workers=len(cluster.hosts)) as pool:
            copy_s, _ = timed(lambda: list(pool.map(copy, cluster.hosts)))
            install_s, _ = timed(lambda: list(pool.map(pip_install, cluster.hosts)))
        pip_s = copy_s + install_s
        rows.append(("pip parallel (copy + install)", pip_s, f"copy {copy_s:.1f}s + pip {install_s:.1f}s"))
        rows.append(("mnft cold (relay + uv)", cold_s, f"controller sent {sent / 1e6:.1f} MB on the wire = {sent / report['wheelhouse_bytes']:.2f}x "
                                                       f"one host's copy ({wheel_bytes / 1e6:.1f} MB wheels + {(report['wheelhouse_bytes'] - wheel_bytes) / 1e6:.1f} MB uv)"))
        rows.append(("mnft no-op", noop_s, f"0 changed; {noop_work:.2f} s of it provisioning, the rest starting python + invoke"))

        # ---- ansible's pip module over the same per-host copies
        if not args.skip_ansible and shutil.which("ansible-playbook"):
            hosts_ini = work / "ansible-hosts.ini"
            hosts_ini.write_text("[lab]\n" + "".join(f"{h.name} ansible_host={h.address} ansible_user=root ansible_python_interpreter={BASE_PYTHON}\n"
                                                     for h in cluster.hosts))
            names = [ln.split(";")[0].split()[0].strip(" \\") for ln in pip_lock.read_text().splitlines() if "==" in ln and not ln.startswith("#")]
            play = work / "play.yaml"
            play.write_text(
                "- hosts: lab\n  gather_facts: false\n  tasks:\n    - ansible.builtin.pip:\n"
                "        name: " + json.dumps(names) + "\n"
                "        virtualenv: /root/ansible-env\n        virtualenv_command: " + json.dumps(f"{BASE_PYTHON} -m venv") + "\n"
                "        extra_args: --no-index --find-links /root/pip-wheels --no-deps\n")
            ssh_args = f"-F /dev/null -o IdentitiesOnly=yes -o UserKnownHostsFile={cluster.known_hosts} -o StrictHostKeyChecking=yes"
            ansible_env = dict(env, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_PRIVATE_KEY_FILE=str(cluster.controller_key),
                               ANSIBLE_SSH_ARGS=ssh_args, ANSIBLE_FORKS=str(len(cluster.hosts)), ANSIBLE_PIPELINING="True")
            ansible_s, done = timed(lambda: subprocess.run(["ansible-playbook", "-i", str(hosts_ini), str(play)], env=ansible_env,
                                                           capture_output=True, text=True, timeout=3600))
            if done.returncode == 0:
                rows.append(("ansible pip module (install only)", ansible_s, f"forks={len(cluster.hosts)}; the copies above not counted"))
            else:
                rows.append(("ansible pip module", float("nan"), "failed: " + (done.stdout + done.stderr).strip().splitlines()[-1][:150]))
        else:
            rows.append(("ansible pip module", float("nan"), "skipped (ansible-core not installed: pip install -e '.[bench]')"))
    finally:
        cluster.teardown()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nprovision benchmark: {args.hosts} hosts, {len(files)} wheels ({wheel_bytes / 1e6:.1f} MB), lock {lock.name}")
    print(f"{'method':36} {'seconds':>8} {'vs pip':>7}  notes")
    for name, seconds, note in rows:
        ratio = seconds / pip_s if seconds == seconds else float("nan")
        print(f"{name:36} {seconds:8.2f} {ratio:7.2f}  {note}")
    print(f"\ngoals: cold <= 0.3x pip: {cold_s / pip_s:.2f}x; no-op <= 1 s: {noop_s:.2f} s ({noop_work:.2f} s without the CLI start); controller upload <= 1.2x the wheelhouse: "
          f"{sent / report['wheelhouse_bytes']:.2f}x (of wheels+uv {report['wheelhouse_bytes'] / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
