"""Reading for `invoke check`: one facts probe per host, in parallel (with each host's clock skew), each host's
code hash, and the network test (a short-lived listener on the master's rendezvous port, a connection to it
from every host); then the rules (mnft.check.rules) turn facts into problems.
"""

from __future__ import annotations

import json
import secrets
import time

from mnft.check import probe
from mnft.check.findings import CheckOptions, CheckReport, Problem, Reach
from mnft.check.rules import clock_skew, evaluate, iface_of_address, master_address, shared_fs_problems, source_address
from mnft.hosts import fanin, pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import HostKeyRejected, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Results, Status
from mnft.hosts.settings import Host


def probe_command(host: Host, mode: str, *args: str) -> Command:
    """The probe in a mode; only `facts` looks beyond the standard library (where torch would be imported from)."""
    return pyrun.command(host, mode, *args, site=mode == "facts")


def probe_payload() -> bytes:
    return pyrun.payload(probe.source())


def gather_facts(fleet: Fleet, hosts: list[Host] | None = None, modules: tuple[str, ...] = ()) -> tuple[Results, dict[str, dict], dict[str, float]]:
    """Run the facts probe everywhere (with `modules`: which of them each host's Python resolves). Returns outcomes,
    facts and each host's clock skew vs this machine."""
    source = probe_payload()
    sent: dict[str, tuple[float, float]] = {}

    def one(host: Host) -> HostResult:
        try:  # connect first: the SSH handshake must not sit inside the window the clock skew is measured in
            fleet.connection(host)
        except (Unreachable, HostKeyRejected):
            pass  # run_one reports it
        before = time.time()
        wanted = ("--modules", ",".join(modules)) if modules else ()
        result = fleet.run_one(host, probe_command(host, "facts", "--workdir", host.workdir, *wanted), stdin=source)
        sent[host.name] = (before, time.time())
        return result

    results = fleet.map(one, hosts)
    facts, skew = {}, {}
    for result in results:
        data = pyrun.reply(result, "the probe")
        if data is not None:
            facts[result.host] = data
            before, after = sent[result.host]
            if isinstance(data.get("clock"), (int, float)):
                total = (data.get("timings") or {}).get("total_s")
                skew[result.host] = clock_skew(data["clock"], before, after, total if isinstance(total, (int, float)) else None)
    return results, facts, skew


def gather_network(fleet: Fleet, report: CheckReport, options: CheckOptions) -> None:
    """Listen on the master's rendezvous port for a few seconds; connect to it from every reachable host."""
    inventory = report.inventory
    master = inventory.master
    port = options.port or inventory.rendezvous_port
    report.port = port
    if master.name not in report.facts or report.master_addr is None:
        return
    seconds = options.network_timeout * 2 + 10
    for candidate in range(port, port + (options.port_search if options.find_free_port else 1)):
        listener = fleet.start(master, probe_command(master, "listen", str(candidate), str(int(seconds))))
        listener.write(probe_payload())
        line = _first_json_line(listener, timeout=fleet.timeouts.command)
        if line is not None and line.get("ok"):
            report.port, report.port_free, report.port_error = candidate, True, None
            break
        listener.close_stdin()
        report.port_free = False
        report.port_error = (line or {}).get("error") or "the listener did not start"
    else:
        return
    try:
        reachable = [h for h in inventory.hosts if h.name in report.facts]

        def connect(host: Host) -> HostResult:
            args = [report.master_addr, str(report.port), str(options.network_timeout)]
            source = source_address(host, report.facts[host.name])
            if source:
                args += ["--bind", source]
            return fleet.run_one(host, probe_command(host, "connect", *args), stdin=probe_payload())

        # Every host connects to one listener (not sshd: MaxStartups does not apply); its accept queue holds
        # probe.LISTEN_BACKLOG, so larger clusters connect in waves of that many.
        results = [r for wave in fanin.pace([(h, master.name) for h in reachable], probe.LISTEN_BACKLOG)
                   for r in fleet.map(connect, [h for h, _ in wave])]
        for result in results:
            data = pyrun.reply(result, "the probe") or {}
            local = data.get("local")
            report.reach[result.host] = Reach(
                ok=bool(data.get("ok") and data.get("reply_ok", True)),
                source=local,
                iface=iface_of_address(report.facts[result.host], local) if local else None,
                error=data.get("error") or (None if result.ok else result.error),
                seconds=data.get("seconds"),
            )
    finally:
        listener.close_stdin()
        try:
            listener.wait(timeout=5)
        except Exception:  # noqa: BLE001 - the listener also stops by itself after `seconds`
            listener.terminate()


def _first_json_line(process, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = process.readline(timeout=max(0.0, deadline - time.monotonic()))
        if item is None:
            return None
        stream, line = item
        if line is None:
            if stream == "stdout":
                return None
            continue
        if stream == "stdout":
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def gather(fleet: Fleet, options: CheckOptions = CheckOptions()) -> CheckReport:
    inventory = fleet.inventory
    modules = tuple(sorted({n.module for n in options.modules}))
    if options.image:  # the host's facts and the image's, the probe run inside it: one command per host
        from mnft.check.inimage import gather_image_facts

        outcomes, facts, skew = gather_image_facts(fleet, options.image, modules)
    else:
        outcomes, facts, skew = gather_facts(fleet, modules=modules)
    report = CheckReport(inventory, dict(outcomes.by_host), facts, skew=skew)
    probed = [h for h in inventory.hosts if h.name in facts]
    workdirs = {h.name: h.workdir for h in probed}
    nonce = secrets.token_hex(8) if len(probed) > 1 else None  # who shares a workdir: marked and looked for with the code hash
    sightings: dict = {}
    if options.code:
        from pathlib import Path

        from mnft.sync.mirror import code_hashes

        report.code, sightings = code_hashes(fleet, probed, Path(options.code_src) if options.code_src else None, mark=nonce)
        for name, code in report.code.items():
            if code.get("matches") is False:
                shown = ", ".join(code.get("differing") or [])
                report.problems.append(Problem(name, "code", f"the code in the workdir differs from the local tree ({shown})", "invoke sync", "warning"))
    if nonce:
        from mnft.sync.mirror import detect_sharing, sharing_of

        if sightings:
            report.shared, unmarked = sharing_of(fleet, probed, workdirs, nonce, sightings)
            unmarked.update({h.name: report.code[h.name].get("error") or "no answer" for h in probed if h.name not in sightings})
        else:  # no code hash (or no local tree to hash): a round-trip of its own
            report.shared, unmarked = detect_sharing(fleet, probed, workdirs)
        report.problems.extend(shared_fs_problems(probed, report.shared, unmarked))
    report.master_addr, why = master_address(inventory, facts.get(inventory.master_name))
    if why and inventory.master_name in facts:
        report.problems.append(Problem(inventory.master_name, "master_addr", why, "set 'iface' (or an IPv4 'address') for the master in the inventory"))
    if options.network:
        gather_network(fleet, report, options)
    if options.required_files:
        report.problems.extend(missing_files(fleet, [h for h in inventory.hosts if h.name in facts], options.required_files))
    if options.own_devices is None:
        gpu_leases(fleet, [h for h in inventory.hosts if h.name in facts], facts)
    report.problems.extend(evaluate(inventory, facts, report, options))
    return report


def gpu_leases(fleet: Fleet, hosts: list[Host], facts: dict[str, dict]) -> None:
    """On hosts where a GPU is in use, whose run holds it (each GPU's "lease": the lab's word, mnft.hosts.lab),
    asked only there: a lab with every GPU idle costs no round-trip more."""
    busy = [h for h in hosts if any(g.get("processes") for g in (facts[h.name].get("nvidia") or {}).get("gpus") or [])]
    if not busy:
        return
    from mnft.hosts import leases

    for name, view in leases.lab(fleet, busy).items():
        held = {d.get("index"): d for d in view.get("devices") or [] if d.get("state") == "held"}
        for gpu in (facts[name].get("nvidia") or {}).get("gpus") or []:
            if gpu.get("index") in held:
                gpu["lease"] = {"holder": held[gpu["index"]].get("holder"), "lockers": held[gpu["index"]].get("lockers")}


def missing_files(fleet: Fleet, hosts: list[Host], paths: tuple[str, ...]) -> list[Problem]:
    """A problem for each host that lacks one of the files (`test -f`, relative paths in the workdir)."""
    problems = []
    for path in paths:
        def command(host: Host, path: str = path) -> Command:
            return Command.of("test", "-f", path, cwd=None if path.startswith(("/", "~")) else host.workdir)

        for result in fleet.run(command, hosts=hosts):
            if result.status is Status.OK:
                continue
            if result.status is Status.FAILED and result.exit_code == 1:
                problems.append(Problem(result.host, "script", f"{path} does not exist on this host",
                                        "copy it there (or use a path inside the synced tree, relative to it)"))
            else:
                problems.append(Problem(result.host, "script", f"cannot tell whether {path} exists: {result.error}", "check the host"))
    return problems
