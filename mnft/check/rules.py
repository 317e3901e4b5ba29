"""The check's rules, pure: a host's facts in, problems with their fix out; and the facts read for a purpose
(an interface's address, the master's address peers use, a clock's skew)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import Any

from mnft.check.findings import GIB, CheckOptions, CheckReport, Problem, reference_host, reference_label
from mnft.env.diff import compare
from mnft.hosts.fleet import HostResult
from mnft.core.output import command
from mnft.onhost.health import device_label, health_problems
from mnft.hosts.leases import describe, drained_words, shown, verified
from mnft.hosts.settings import Host, Inventory


def clock_skew(clock: float, before: float, after: float, probe_total: float | None) -> float:
    """The host's clock minus this machine's, from a probe that read its clock as its last step.

    Of the round-trip [before, after], the probe itself ran `probe_total` seconds and read the clock at its end;
    the rest (sending, starting Python, returning the output) is split evenly around it. So the clock was read
    at after - (rtt - probe_total) / 2, not at the midpoint, which would be off by about half the probe's run
    time (a 4.5 s nvidia-smi read as 2.3 s of skew). The error is at most half the non-probe time."""
    rtt = after - before
    if probe_total is None or not 0 <= probe_total <= rtt:
        return round(clock - (before + after) / 2, 3)
    return round(clock - (after - (rtt - probe_total) / 2), 3)


def probe_skew(facts: dict, before: float, after: float) -> float | None:
    """clock_skew from a probe's facts (its clock, its own run time) and the round-trip around it; None without a clock."""
    clock = facts.get("clock")
    if not isinstance(clock, (int, float)):
        return None
    total = (facts.get("timings") or {}).get("total_s")
    return clock_skew(clock, before, after, total if isinstance(total, (int, float)) else None)


def ipv4_of(facts: dict, iface: str) -> list[str]:
    for entry in facts.get("interfaces") or []:
        if entry.get("name") == iface:
            return [a.split("/")[0] for a in entry.get("ipv4") or []]
    return []


def iface_of_address(facts: dict, address: str) -> str | None:
    for entry in facts.get("interfaces") or []:
        if any(a.split("/")[0] == address for a in entry.get("ipv4") or []):
            return entry.get("name")
    return None


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def master_address(inventory: Inventory, facts: dict | None) -> tuple[str | None, str | None]:
    """The address peers use to reach the master: (address, None) or (None, why not). Never 127.x for peers."""
    master = inventory.master
    multi = len(inventory.hosts) > 1
    if not multi and master.is_local:
        return "127.0.0.1", None
    if facts is None:
        return None, "the master's facts are missing"
    if master.iface:
        addrs = ipv4_of(facts, master.iface)
        if not addrs:
            names = ", ".join(i["name"] for i in facts.get("interfaces") or [])
            return None, f"interface {master.iface!r} has no IPv4 address on the master (it has: {names})"
        return addrs[0], None
    if _is_ipv4(master.address) and not ipaddress.IPv4Address(master.address).is_loopback:
        return master.address, None
    candidates = [
        a.split("/")[0]
        for entry in facts.get("interfaces") or []
        if entry.get("up") and entry.get("name") != "lo"
        for a in entry.get("ipv4") or []
        if not ipaddress.IPv4Address(a.split("/")[0]).is_loopback
    ]
    if len(candidates) == 1:
        return candidates[0], None
    if not candidates:
        return None, "the master has no non-loopback IPv4 address"
    return None, f"the master has several addresses ({', '.join(candidates)}): set 'iface' in the inventory"


def source_address(host: Host, facts: dict | None) -> str | None:
    if host.iface and facts:
        addrs = ipv4_of(facts, host.iface)
        return addrs[0] if addrs else None
    return None


SAME_EVERYWHERE = (
    ("python", "Python", lambda f: _minor((f.get("python") or {}).get("version"))),
    ("torch", "torch", lambda f: (f.get("torch") or {}).get("version")),
    ("cuda", "CUDA (torch build)", lambda f: (f.get("torch") or {}).get("cuda")),
    ("nccl", "NCCL", lambda f: f.get("nccl")),
    ("driver", "NVIDIA driver", lambda f: (f.get("nvidia") or {}).get("driver")),
)


FIXES = {
    "python": "use the same Python minor version on every host (set 'python' per host in the inventory)",
    "torch": "install the same torch build everywhere, e.g. pip install torch=={value}",
    "cuda": "install the torch build for the same CUDA everywhere (the +cuXXX wheel the master has)",
    "nccl": "install the same nvidia-nccl package as the master (it comes with the torch wheel)",
    "driver": "upgrade or downgrade the NVIDIA driver to the master's version",
}


def provision_fix(inventory: Inventory, what: str) -> str:
    """The fix that puts `what` right the way the lab installs: the hosts' environment from the lock."""
    where = f" --hosts {inventory.path}" if inventory.path else ""
    return f"{what}, then mnft provision{where} (it builds every host's environment from the lock)"


def probe_failed(inventory: Inventory, outcome: HostResult) -> Problem:
    """A host whose probe did not run to its end (it was reached: the connection is fine) as a problem with its fix:
    the Python the inventory names, or the environment mnft provisioned there, not found (exit 127), or else
    what the probe said."""
    host = inventory.host(outcome.host)
    missing = outcome.exit_code == 127
    if missing and host.base_python is not None:
        return Problem(host.name, "python", f"{host.python} not found: the environment mnft provisioned here ({host.venv}) is gone",
                       provision_fix(inventory, "build it again"))
    if missing:
        return Problem(host.name, "python", f"{host.python} not found: {outcome.error}",
                       "install that Python on the host, or set 'python' for this host in the inventory")
    return Problem(host.name, "probe", f"the check's probe failed: {outcome.error}", f"run {host.python} on {host.name} by hand to see why; "
                   "the probe needs only its standard library (Python 3.8 or newer)")


def cpu_only_torch(inventory: Inventory, host: Host, facts: dict, gpus: list[dict]) -> Problem | None:
    """Rule "torch sees the host's GPUs": a CPU-only build (no CUDA: `2.13.0+cpu`) where nvidia-smi lists GPUs
    trains on the CPU, or fails at NCCL: an error, with its fix. A host meant to train on its CPUs says so in the
    inventory (`device: cpu`), and then it is what is meant."""
    torch = facts.get("torch") or {}
    if not gpus or not torch.get("version") or torch.get("cuda") or host.device == "cpu":
        return None
    driver = (facts.get("nvidia") or {}).get("cuda_driver")
    build = f"the CUDA build of torch {str(torch['version']).split('+')[0]} (a +cuXXX wheel"
    build += f" for CUDA {driver} or older, the driver's)" if driver else ")"
    fix = (provision_fix(inventory, f"pin {build} in the lock") if host.base_python is not None else
           f"install {build}: pip install torch=={str(torch['version']).split('+')[0]} --index-url https://download.pytorch.org/whl/cuXXX")
    fix += "; or, if this host is meant to train on its CPUs, say so: `device: cpu` in its inventory entry"
    return Problem(host.name, "cuda", f"torch {torch['version']} is a CPU-only build: it cannot use this host's {len(gpus)} GPU(s)", fix)


def _minor(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def comparable(facts: dict) -> dict[str, Any]:
    """The values that must be identical on every host."""
    return {key: get(facts) for key, _, get in SAME_EVERYWHERE}


# packages with a rule of their own above (its message and fix say more than a version pair): reported once
ENV_RULE_IGNORES = ("torch", "nvidia-nccl-cu11", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def environment_drift(name: str, facts: dict, reference: dict, label: str) -> Problem | None:
    """Rule "environment identical across hosts": the installed distributions (read from metadata by the probe)
    against the reference host's, naming each differing package: `numpy 2.1.0 (master: 1.26.4); extra: foo 0.3`."""
    mine, theirs = facts.get("dists"), reference.get("dists")
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return None
    diff = compare(mine, theirs, ignore=ENV_RULE_IGNORES)
    if diff.empty:
        return None
    return Problem(name, "env", diff.describe(label), f"make the hosts' environments identical from one lock: {command('provision --hosts FILE')}")


def gpus_in_use(host: str, gpus: list[dict], own: tuple[int, ...] | None = None) -> list[Problem]:
    """GPUs a process uses already. Your own processes are a leftover of an ended run (a warning: stop it); another
    user's are their run, not a problem of yours (a note: `mnft lab` tells whose run, since when). own: the GPUs
    this run took (train --gpus): only those matter, the rest are other runs' to use."""
    problems = []
    for gpu in gpus:
        procs = gpu.get("processes") or []
        if not procs or own is not None and gpu.get("index") not in own:
            continue
        theirs = [p for p in procs if p.get("mine") is False]
        pids = ", ".join(str(p.get("pid")) for p in procs)
        lease = gpu.get("lease")
        if lease and own is None:  # a run of mnft holds it: whose, which, since when (the lock's holder, not the file's word)
            mine = not theirs
            whose = "your" if mine else "another user's"
            problems.append(Problem(host, "gpus", f"GPU {gpu.get('index')} is held by {whose} "
                                    f"{describe(lease.get('holder'))}{verified(lease.get('holder'), lease.get('lockers'))}",
                                    "a run holds it: --gpus G takes free GPUs beside it; `mnft lab` shows the lab", "note"))
        elif theirs and len(theirs) == len(procs):
            users = ", ".join(sorted({str(p.get("user")) for p in theirs}))
            problems.append(Problem(host, "gpus", f"GPU {gpu.get('index')} is in use by {users} (pid {pids})",
                                    "another user's work: `mnft lab` shows whose run and since when; --gpus G takes free GPUs beside it", "note"))
        else:
            problems.append(Problem(host, "gpus", f"GPU {gpu.get('index')} is held by your process(es) {pids}",
                                    f"a leftover of an ended run: stop it ({command('stop RUN')}) or those processes before training", "warning"))
    return problems


# ------------------------------------------------------------------------------------------------ an image

PYTHON_SIDE = ("python", "torch", "cuda", "nccl")  # what an image brings (the driver stays the host's)
RUNTIME_FIX = "install podman, docker or apptainer on the host, or set container_runtime: in the inventory (a kind or an absolute path)"


def gpu_health(host: str, view: dict | None) -> list[Problem]:
    """Each GPU's health as its host judges it (mnft.onhost.health.health_problems), with the fix: a GPU that
    breaks runs (lost, uncorrectable ECC since boot, a pending remap, an Xid needing a reset) fails the check and is
    never leased; throttling, persistence off, MIG are warnings; a drained GPU is a note naming who, when and why."""
    if not view:
        return []
    problems = []
    if view.get("error"):
        problems.append(Problem(host, "gpu-health", f"GPUs not read: {shown(view['error'], 300)}",
                                "nvidia-smi -pm 1 (or nvidia-persistenced) where persistence is off; a wedged driver: drain the host and reboot it"))
    if view.get("drain_problem"):
        problems.append(Problem(host, "drain", shown(view["drain_problem"], 300) or "", "remove it as root", "warning"))
    for d in view.get("devices") or []:
        label = device_label(d)
        for p in health_problems(d):
            problems.append(Problem(host, "gpu-health", f"{label}: {p['what']}", p["fix"], "error" if p["level"] == "broken" else "warning"))
        if d.get("drain"):
            problems.append(Problem(host, "drain", f"{label}: {drained_words(d['drain'])}", "mnft undrain once it is mended (root or the host's admin group)", "note"))
    return problems


def kernel_log_unread(views: dict[str, dict | None]) -> list[Problem]:
    """The hosts whose kernel log (the Xids) this user cannot read, said once: one note naming every such host
    (the line names the user and the fix, the same on each host), not one per host."""
    by_why: dict[str, list[str]] = {}
    for host, view in views.items():
        why = next(((d.get("health") or {}).get("kmsg") for d in (view or {}).get("devices") or [] if (d.get("health") or {}).get("kmsg")), None)
        if why:
            by_why.setdefault(shown(why, 300) or "", []).append(host)
    return [Problem(", ".join(hosts), "kernel-log", why, "", "note") for why, hosts in by_why.items()]


def probed_inside(facts: dict) -> bool:
    """With an image: the probe ran inside it on this host and answered (mnft.check.inimage.merge)."""
    return bool((facts.get("image_probe") or {}).get("ok"))


def python_reference(inventory: Inventory, facts: dict[str, dict], image: str | None) -> str | None:
    """The host whose Python, torch, CUDA and NCCL the others are compared with: the reference host, or with an
    image, the first host (the master first) where the probe ran inside the image."""
    ref_name = reference_host(inventory, facts)
    if not image or ref_name is None or probed_inside(facts[ref_name]):
        return ref_name
    return next((h.name for h in inventory.hosts if h.name in facts and probed_inside(facts[h.name])), None)


def short_id(image_id: str | None) -> str:
    """sha256:0123456789ab… (an image id as a person compares it); '-' for none."""
    if not image_id:
        return "-"
    return image_id[:19] + "…" if len(image_id) > 19 else image_id


def _image_id(facts: dict | None) -> str | None:
    return (((facts or {}).get("container") or {}).get("image") or {}).get("id")


def verified_image_id(inventory: Inventory, facts: dict[str, dict]) -> str | None:
    """The image's id a check judged: its reference host's (the id every other host was required to have)."""
    ref_name = image_reference(inventory, facts)
    return _image_id(facts.get(ref_name)) if ref_name is not None else None


def image_reference(inventory: Inventory, facts: dict[str, dict]) -> str | None:
    """The host whose image id the others must have: the master, or when it has none the first host that has one."""
    if _image_id(facts.get(inventory.master_name)):
        return inventory.master_name
    return next((h.name for h in inventory.hosts if _image_id(facts.get(h.name))), None)


def _python_missing(error: str, python: str) -> bool:
    low = error.lower()
    return python in low and ("not found" in low or "no such file" in low)


def image_problems(inventory: Inventory, facts: dict[str, dict], image: str, expected_id: str | None = None) -> list[Problem]:
    """The rules of a run in an image: a runtime on every host, the image there, by the same id as the master's (or,
    in a later check of a run, as the id its first check verified: `expected_id`), GPUs the runtime can hand to a
    container, and the probe inside the image answered. Pure: facts in, problems out."""
    from mnft.image.runtime import CDI_FIX

    problems: list[Problem] = []
    master = inventory.master_name
    ref_name = image_reference(inventory, facts)
    for host in inventory.hosts:
        f = facts.get(host.name)
        if f is None:
            continue
        container, inside = f.get("container"), f.get("image_probe") or {}
        if not isinstance(container, dict):
            problems.append(Problem(host.name, "image", f"the image's facts could not be read: {inside.get('error') or 'no answer'}",
                                    "see the message; `mnft check --json` shows the host's answer"))
            continue
        if not container.get("runtime"):
            problems.append(Problem(host.name, "runtime", f"no container runtime: {container.get('error') or 'none of podman, docker, apptainer, singularity found'}",
                                    RUNTIME_FIX))
            continue
        found = container.get("image") or {}
        if not found.get("present"):
            if container.get("error"):  # the runtime could not say
                problems.append(Problem(host.name, "image", f"{container['runtime']} cannot tell whether {image} is there: {container['error']}",
                                        f"make `{container.get('path') or container['runtime']} image inspect {image}` work on {host.name}"))
            else:
                problems.append(Problem(host.name, "image", f"{host.name} lacks {image}",
                                        f"mnft sync --image {image} (relays it from a host that has it)"))
            continue
        if expected_id is not None:
            if found.get("id") != expected_id:
                problems.append(Problem(host.name, "image", f"{host.name} has {short_id(found.get('id'))}, the run began in {short_id(expected_id)}: "
                                        f"{image} changed since the run's first check",
                                        f"put the run's image back as {image} on every host (`mnft sync --image` from a host that has "
                                        f"{short_id(expected_id)}, with --force), or start a new run; --force goes on in the image there"))
        elif ref_name is not None and host.name != ref_name and found.get("id") != _image_id(facts[ref_name]):
            whose = f"the master {ref_name}" if ref_name == master else f"{ref_name} (the first host that has it; the master {master} does not)"
            problems.append(Problem(host.name, "image", f"{host.name} has {short_id(found.get('id'))}, {whose} has {short_id(_image_id(facts[ref_name]))}",
                                    f"mnft sync --image {image} --force"))
        if container.get("gpus") and container.get("runtime") == "podman" and not container.get("cdi"):
            problems.append(Problem(host.name, "cdi", "podman has no CDI description of this host's NVIDIA GPUs: a container would see none", CDI_FIX))
        elif inside.get("ran") and not inside.get("ok"):
            error, python = str(inside.get("error") or "no answer"), str(inside.get("python") or "python3")
            fix = (f"the image needs {python} (3.8 or newer) on its PATH: mnft's probe and the job's torchrun run with it"
                   if _python_missing(error, python) else
                   f"run it by hand on {host.name} to see why: {container.get('path') or container['runtime']} run --rm -i {image} {python} -V")
            problems.append(Problem(host.name, "image", f"the probe inside {image} failed: {error}", fix))
    return problems


def evaluate(inventory: Inventory, facts: dict[str, dict], report: CheckReport, options: CheckOptions) -> list[Problem]:
    problems: list[Problem] = []
    master = inventory.master_name
    image = options.image
    ref_name = reference_host(inventory, facts)
    reference = comparable(facts[ref_name]) if ref_name is not None else None
    ref_label = reference_label(inventory, ref_name)
    # the Python side (Python, torch, CUDA, NCCL, distributions, modules): with an image, what the probe saw inside it
    py_name = python_reference(inventory, facts, image)
    py_reference = comparable(facts[py_name]) if py_name is not None else None
    py_label = reference_label(inventory, py_name) if py_name == ref_name else f"{py_name}'s (the first host whose image answered)"
    known = {name for name, f in facts.items() if not image or probed_inside(f)}
    if image:
        problems += image_problems(inventory, facts, image, options.image_id)
    uses_gpu = any((f.get("torch") or {}).get("cuda") or (f.get("nvidia") or {}).get("gpus") for f in facts.values())
    inventory_provisioned = any(h.base_python is not None for h in inventory.hosts)  # the lab installs from a lock
    for host in inventory.hosts:
        f = facts.get(host.name)
        if f is None:
            continue
        mine = comparable(f)
        if host.name in known and (f.get("torch") or {}).get("version") is None:
            where = f"{(f.get('python') or {}).get('executable') or host.python}"
            problems.append(Problem(host.name, "torch", f"torch is not installed in the image {image} ({where})", f"use an image with torch, then mnft sync --image {image} --force")
                            if image else
                            Problem(host.name, "torch", f"torch is not installed for {where}", provision_fix(inventory, "add torch to the lock")
                                    if host.base_python is not None or inventory_provisioned else
                                    "pip install torch in the Python the inventory names ('python'), or give the hosts one environment from a lock: "
                                    + provision_fix(inventory, "put torch in it")))
        if reference is not None and host.name != ref_name:
            for key, label, _ in SAME_EVERYWHERE:
                if key in PYTHON_SIDE and image:
                    continue  # below, against the Python-side reference
                if mine[key] != reference[key] and not (key == "torch" and mine[key] is None):
                    fix = FIXES[key].format(value=reference[key])
                    if inventory_provisioned and key in ("torch", "cuda", "nccl"):
                        fix = provision_fix(inventory, f"pin {ref_label}'s {label} ({reference[key]}) in the lock")
                    problems.append(Problem(host.name, key, f"{label} {mine[key] or 'none'} differs from {ref_label} {reference[key] or 'none'}", fix))
        if image and py_reference is not None and host.name != py_name and host.name in known:
            for key, label, _ in SAME_EVERYWHERE:
                if key in PYTHON_SIDE and mine[key] != py_reference[key] and not (key == "torch" and mine[key] is None):
                    problems.append(Problem(host.name, key, f"{label} {mine[key] or 'none'} in the image differs from {py_label} {py_reference[key] or 'none'}",
                                            f"one image everywhere: mnft sync --image {image} --force"))
        if py_name is not None and host.name != py_name and host.name in known:
            drift = environment_drift(host.name, f, facts[py_name], "master" if py_name == master else py_name)
            if drift is not None:
                problems.append(drift if not image else replace(drift, fix=f"one image everywhere: mnft sync --image {image} --force"))
        gpus = (f.get("nvidia") or {}).get("gpus") or []
        cpu_only = cpu_only_torch(inventory, host, f, gpus) if host.name in known else None
        if cpu_only is not None:
            problems.append(cpu_only)
        if uses_gpu:
            if len(gpus) < host.slots:
                problems.append(Problem(host.name, "gpus", f"{len(gpus)} GPU(s) for {host.slots} slot(s)", "lower 'slots' for this host or fix the GPUs (nvidia-smi)"))
            problems += gpus_in_use(host.name, gpus, (options.own_devices or {}).get(host.name) if options.own_devices is not None else None)
        problems += gpu_health(host.name, f.get("gpu_health"))
        disk = f.get("disk") or {}
        free = disk.get("free_bytes")
        if isinstance(free, int) and free < options.min_free_gb * GIB:
            problems.append(Problem(host.name, "disk", f"{free / GIB:.1f} GiB free at {disk.get('path')} (floor {options.min_free_gb:g} GiB)", "free disk space or point 'workdir' at a larger disk"))
        if not f.get("rsync"):
            problems.append(Problem(host.name, "rsync", "rsync is not installed", "install rsync (apt-get install rsync / dnf install rsync)"))
        if host.iface and not ipv4_of(f, host.iface):
            names = ", ".join(i.get("name", "?") for i in f.get("interfaces") or [])
            problems.append(Problem(host.name, "iface", f"interface {host.iface!r} does not exist or has no IPv4 address (has: {names})", "set 'iface' to the cluster network's interface (ip -br addr)"))
        found = f.get("modules") or {}
        for need in options.modules:
            if found.get(need.module) is False:
                python = (f.get("python") or {}).get("executable") or host.python
                if image:
                    package = need.dist or need.module
                    problems.append(replace(need.problem(host.name, f"{python} in the image {image}"),
                                            fix=f"install {package} in the image (its build), then mnft sync --image {image} --force"))
                else:
                    problems.append(need.problem(host.name, python))
        skew = report.skew.get(host.name)
        ref_skew = report.skew.get(ref_name) if ref_name is not None else None
        if skew is not None and ref_skew is not None and abs(skew - ref_skew) > options.max_clock_skew_s:
            problems.append(Problem(host.name, "clock", f"clock differs from {ref_label} by {skew - ref_skew:+.1f}s", "enable time sync (chrony / systemd-timesyncd) on every host"))
    if options.network and report.master_addr and master in facts:
        if report.port_free is False:
            problems.append(Problem(master, "port", f"rendezvous port {report.port} is not free on the master: {report.port_error}", "stop what holds it (ss -ltnp) or choose another port (rendezvous_port / --port)"))
        for host in inventory.hosts:
            reach = report.reach.get(host.name)
            if reach is not None and not reach.ok:
                via = f" from {reach.source}" if reach.source else (f" from {host.iface}" if host.iface else "")
                problems.append(Problem(host.name, "network", f"cannot reach the master {report.master_addr}:{report.port}{via}: {reach.error}", f"open the port on the master's firewall for the peers ({command('setup')}), or set 'iface' to the cluster interface"))
        if len(inventory.hosts) > 1 and ipaddress.IPv4Address(report.master_addr).is_loopback:
            problems.append(Problem(master, "master_addr", f"the master's address {report.master_addr} is a loopback address peers cannot reach", "set the master's 'address' or 'iface' to the cluster network"))
    problems += kernel_log_unread({h.name: facts[h.name].get("gpu_health") for h in inventory.hosts if h.name in facts})
    return problems


def shared_fs_problems(hosts: list[Host], shared: dict[str, tuple[str, ...]], unmarked: dict[str, str] | None = None) -> list[Problem]:
    """The inventory's shared_fs asserts that the declared hosts' workdirs (and data_dirs) are one directory; check
    holds the workdir to what was found. Declared hosts whose workdir is not the one most declared hosts see
    fail (a mount missing on them); a host whose mark could not be left (unmarked: host -> why) gets a warning
    saying so, and nobody is blamed for not seeing its directory; hosts that share without saying so get a warning (mnft
    copes: sync writes once, each host's run files have their own names)."""
    unmarked = unmarked or {}
    asserted = {h.name for h in hosts if h.shared_fs}
    problems = [Problem(name, "shared_fs", f"declared shared_fs, not verified: no mark could be left beside its workdir ({why})",
                        "make the workdir's parent directory writable for the SSH user (the marks go into .mnft-share/ there)", "warning")
                for name, why in unmarked.items() if name in asserted]
    declared = [h.name for h in hosts if h.shared_fs and h.name not in unmarked]
    if len(declared) > 1:
        def seen_with(name: str) -> set[str]:
            return set(shared.get(name, ())) | {name}

        reference = max(declared, key=lambda name: (len(seen_with(name) & set(declared)), -declared.index(name)))
        for name in declared:
            if name not in seen_with(reference):
                problems.append(Problem(name, "shared_fs", f"declared shared_fs, but its workdir is not the one {reference} sees",
                                        f"mount the shared filesystem on {name} (or remove shared_fs from the inventory)"))
    for name, group in sorted(shared.items()):
        if name == group[0] and not all(n in asserted for n in group):
            problems.append(Problem(name, "shared_fs", f"{', '.join(group)} see one workdir (a shared filesystem) without shared_fs in the "
                                    "inventory: mnft found it (`shared_fs: true` asserts that the workdir and the data_dir are shared, "
                                    "for check and sync --data to verify: docs/inventory.md)", "", "note"))
    return problems
