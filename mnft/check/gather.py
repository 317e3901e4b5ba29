"""Reading for `invoke check`: one facts probe per host, in parallel (with each host's clock skew), each host's
code hash, and the network test (a short-lived listener on the master's rendezvous port, a connection to it
from every host); then the rules (mnft.check.rules) turn facts into problems. Without an image all of it runs in
one command per host, the probe's session (mnft.check.session); with one, the facts come from the image's
conversation (mnft.check.inimage) and the code hash and the network test run in commands of their own.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Mapping

from mnft.onhost import nettest
from mnft.check.findings import CheckOptions, CheckReport, Problem, Reach
from mnft.check.rules import evaluate, iface_of_address, master_address, probe_failed, probe_skew, shared_fs_problems, source_address
from mnft.check.session import Run, Session, close_sessions, open_sessions
from mnft.core.errors import MnftError
from mnft.core.output import command
from mnft.hosts import fanin, pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import HostKeyRejected, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Results, Status
from mnft.hosts.settings import Host


def probe_command(host: Host, mode: str, *args: str) -> Command:
    """The probe in a mode; only `facts` looks beyond the standard library (where torch would be imported from)."""
    return pyrun.command(host, mode, *args, site=mode == "facts")


def probe_payload() -> bytes:
    return pyrun.payload("probe")


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
            if (seen := probe_skew(data, *sent[result.host])) is not None:
                skew[result.host] = seen
    return results, facts, skew


class _Apart:
    """The network test in commands of its own (check --image): a listener started on the master, a connect
    started on each host, each a new interpreter."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.listener = None

    def listen(self, master: Host, port: int, seconds: float) -> dict | None:
        if self.listener is not None:  # the last candidate's, refused
            self.listener.close_stdin()
        self.listener = self.fleet.start(master, probe_command(master, "listen", str(port), str(int(seconds))))
        self.listener.write(probe_payload())
        return _first_json_line(self.listener, timeout=self.fleet.timeouts.command)

    def connect(self, host: Host, request: dict) -> tuple[dict, str | None]:
        args = [request["host"], str(request["port"]), str(request["timeout"])] + (["--bind", request["bind"]] if request["bind"] else [])
        result = self.fleet.run_one(host, probe_command(host, "connect", *args), stdin=probe_payload())
        data = pyrun.reply(result, "the probe") or {}
        return data, None if result.ok else result.error

    def stop(self) -> None:
        if self.listener is None:
            return
        self.listener.close_stdin()
        try:
            self.listener.wait(timeout=5)
        except Exception:  # noqa: BLE001 - the listener also stops by itself after `seconds`
            self.listener.terminate()


class _InSessions:
    """The network test in the sessions already open on the hosts (mnft.check.session): no interpreter more."""

    def __init__(self, sessions: Mapping[str, Session], timeout: float) -> None:
        self.sessions, self.timeout = sessions, timeout

    def listen(self, master: Host, port: int, seconds: float) -> dict | None:
        session = self.sessions.get(master.name)
        if session is None:
            return {"ok": False, "error": "the master's probe ended before the listener could start"}
        answer, why = session.ask({"listen": {"port": port, "seconds": seconds}}, "listen", self.timeout)
        return answer if answer is not None else {"ok": False, "error": why}

    def connect(self, host: Host, request: dict) -> tuple[dict, str | None]:
        session = self.sessions.get(host.name)
        if session is None:
            return {}, "the host's probe ended before the network test"
        answer, why = session.ask({"connect": request}, "connect", self.timeout + request["timeout"])
        return (answer, None) if answer is not None else ({}, why)

    def stop(self) -> None:
        pass  # the listener stops with its session (close_sessions)


def connect_request(host: Host, facts: dict, master_addr: str, port: int, timeout: float) -> dict:
    """Pure: what a host's connect test is: to the master's address and port, within the timeout, from the source
    address of the interface the host names (rules.source_address; None: the kernel's choice)."""
    return {"host": master_addr, "port": port, "timeout": timeout, "bind": source_address(host, facts)}


def gather_network(fleet: Fleet, report: CheckReport, options: CheckOptions, sessions: Mapping[str, Session] | None = None) -> None:
    """Listen on the master's rendezvous port for a few seconds; connect to it from every reachable host. In the
    hosts' open sessions where given (check's one command per host), else in commands of their own."""
    inventory = report.inventory
    master = inventory.master
    port = options.port or inventory.rendezvous_port
    report.port = port
    if master.name not in report.facts or report.master_addr is None:
        return
    seconds = options.network_timeout * 2 + 10
    via = _InSessions(sessions, fleet.timeouts.command) if sessions is not None else _Apart(fleet)
    try:
        for candidate in range(port, port + (options.port_search if options.find_free_port else 1)):
            line = via.listen(master, candidate, seconds)
            if line is not None and line.get("ok"):
                report.port, report.port_free, report.port_error = candidate, True, None
                break
            report.port_free = False
            report.port_error = (line or {}).get("error") or "the listener did not start"
        else:
            return
        reachable = [h for h in inventory.hosts if h.name in report.facts]
        said: dict[str, tuple[dict, str | None]] = {}

        def connect(host: Host) -> HostResult:
            said[host.name] = via.connect(host, connect_request(host, report.facts[host.name], report.master_addr, report.port, options.network_timeout))
            return HostResult(host.name, Status.OK)

        # Every host connects to one listener (not sshd: MaxStartups does not apply); its accept queue holds
        # nettest.LISTEN_BACKLOG, so larger clusters connect in waves of that many.
        results = [r for wave in fanin.pace([(h, master.name) for h in reachable], nettest.LISTEN_BACKLOG)
                   for r in fleet.map(connect, [h for h, _ in wave])]
        for result in results:
            data, error = said.get(result.host, ({}, result.error or "no answer"))
            local = data.get("local")
            report.reach[result.host] = Reach(
                ok=bool(data.get("ok") and data.get("reply_ok", True)),
                source=local,
                iface=iface_of_address(report.facts[result.host], local) if local else None,
                error=data.get("error") or error,
                seconds=data.get("seconds"),
            )
    finally:
        via.stop()


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
        report = CheckReport(inventory, dict(outcomes.by_host), facts, skew=skew)
        probed = [h for h in inventory.hosts if h.name in facts]
        nonce = secrets.token_hex(8) if len(probed) > 1 else None  # who shares a workdir: marked and looked for with the code hash
        sightings: dict = {}
        if options.code:
            from mnft.sync.mirror import code_hashes

            report.code, sightings = code_hashes(fleet, probed, Path(options.code_src) if options.code_src else None, mark=nonce)
        unmarked = {h.name: report.code[h.name].get("error") or "no answer" for h in probed if options.code and h.name not in sightings}
        return _judged(fleet, options, report, nonce, sightings, unmarked)
    return _in_sessions(fleet, options, modules)


def _in_sessions(fleet: Fleet, options: CheckOptions, modules: tuple[str, ...]) -> CheckReport:
    """check without an image: one command per host (mnft.check.session) for its facts, then its code hash and its
    workdir's mark in the same interpreter (or only the mark, without the code hash), then the network test in it."""
    from mnft.sync import mirror

    inventory = fleet.inventory
    names = [h.name for h in inventory.hosts]
    nonce = secrets.token_hex(8) if len(names) > 1 else None  # who shares a workdir: marked and looked for with the code hash
    local = _LocalTree(Path(options.code_src) if options.code_src else None) if options.code else None

    def run(host: Host) -> Run | None:
        tree = local.wait() if local is not None else None
        if tree is not None:
            return mirror.code_request(host, tree, mark=nonce, names=names)
        return mirror.mark_request(host, host.workdir, nonce, names) if nonce else None

    lifetime = fleet.timeouts.command * 2 + mirror.HASH_TIMEOUT + (options.network_timeout * 2 + 10) * (options.port_search + 1)
    opened = open_sessions(fleet, None, modules=modules, run=run, run_timeout=mirror.HASH_TIMEOUT, lifetime=lifetime)
    unknown = None
    if local is not None:
        local, unknown = local.wait(), local.unknown
    try:
        report = CheckReport(inventory, dict(opened.results.by_host), opened.facts, skew=opened.skew)
        probed = [h for h in inventory.hosts if h.name in opened.facts]
        ran = {h.name: opened.ran[h.name] for h in probed if h.name in opened.ran}
        sightings: dict = {}
        if local is not None:
            trees = {name: (result, mirror.parse_hash(result)) for name, result in ran.items()}
            report.code = {name: mirror.code_of(local, result, tree) for name, (result, tree) in trees.items()}
            sightings = {name: tree.mark for name, (_, tree) in trees.items() if tree is not None and tree.mark is not None}
        else:
            if unknown is not None:
                report.code = {h.name: mirror.code_unknown(unknown) for h in probed}
            sightings = {name: seen for name, result in ran.items() if (seen := mirror.sighting_of(result)) is not None}
        unmarked = {h.name: (report.code.get(h.name, {}).get("error") if local is not None else ran[h.name].error if h.name in ran else None)
                    or "no answer" for h in probed if h.name not in sightings}
        return _judged(fleet, options, report, nonce if len(probed) > 1 else None, sightings, unmarked, opened.sessions)
    finally:
        close_sessions(opened.sessions)


class _LocalTree:
    """The local tree (mirror.code_local: git and a walk of the tree) read in a thread of its own, while the hosts'
    SSH handshakes go on; each host waits for it only to be sent its code hash request."""

    def __init__(self, src: Path | None) -> None:
        self.tree, self.unknown, self._bug = None, None, None
        self._thread = threading.Thread(target=self._read, args=(src,), name="mnft-local-tree", daemon=True)
        self._thread.start()

    def _read(self, src: Path | None) -> None:
        from mnft.sync import mirror

        try:
            self.tree = mirror.code_local(src)
        except MnftError as exc:  # every host's code unknown, and only the marks asked for
            self.unknown = str(exc)
        except BaseException as exc:  # noqa: BLE001 - a bug: raised where the tree is waited for
            self._bug = exc

    def wait(self):
        """The tree (None: `unknown` says why it could not be read)."""
        self._thread.join()
        if self._bug is not None:
            raise self._bug
        return self.tree


def code_problems(code_of: dict[str, dict]) -> list[Problem]:
    """Pure: each host whose workdir holds other code than the local tree, as a note: train places its own code for
    each run (a snapshot, a job directory), so only what reads the workdir itself sees the difference."""
    out = []
    for name, code in code_of.items():
        if code.get("matches") is False:
            shown = ", ".join(code.get("differing") or [])
            out.append(Problem(name, "code", f"the workdir holds other code than {code.get('source') or 'the local tree'} ({shown}); train runs "
                               "the code it places for each run, so this matters only to tools that read the workdir itself",
                               command("sync") + " updates it", "note"))
    return out


def _judged(fleet: Fleet, options: CheckOptions, report: CheckReport, nonce: str | None, sightings: dict, unmarked: dict[str, str],
            sessions: dict[str, Session] | None = None) -> CheckReport:
    """The rest of a check once every host's facts (and code hash) are in: the code's problems, who shares a
    workdir (from the sightings of `nonce`'s marks; `unmarked`: why a host has none), the master's address, the
    network test (in the sessions where given), the job's files, whose run holds a busy GPU, and the rules."""
    inventory, facts = report.inventory, report.facts
    probed = [h for h in inventory.hosts if h.name in facts]
    report.problems.extend(probe_failed(inventory, o) for o in report.outcomes.values() if o.status is Status.FAILED and o.host not in facts)
    report.problems.extend(code_problems(report.code))
    if nonce:
        from mnft.sync.mirror import detect_sharing, sharing_of

        workdirs = {h.name: h.workdir for h in probed}
        if sightings:
            report.shared, why = sharing_of(fleet, probed, workdirs, nonce, sightings)
            why.update(unmarked)
        else:  # no host marked in the round-trip already made: a round-trip of its own
            report.shared, why = detect_sharing(fleet, probed, workdirs)
        report.problems.extend(shared_fs_problems(probed, report.shared, why))
    report.master_addr, why_not = master_address(inventory, facts.get(inventory.master_name))
    if why_not and inventory.master_name in facts:
        report.problems.append(Problem(inventory.master_name, "master_addr", why_not, "set 'iface' (or an IPv4 'address') for the master in the inventory"))
    if options.network:
        gather_network(fleet, report, options, sessions)
    if sessions:
        close_sessions(sessions)  # the listener off the port before anything else: train starts its rendezvous there
    if options.required_files:
        report.problems.extend(missing_files(fleet, probed, options.required_files))
    if options.own_devices is None:
        gpu_leases(fleet, probed, facts)
    report.problems.extend(evaluate(inventory, facts, report, options))
    return report


STALLED = "did not answer in"  # the probe's and the lease script's words for a GPU read that hung (mnft.onhost.smi.stalled_line)


def gpu_leases(fleet: Fleet, hosts: list[Host], facts: dict[str, dict]) -> None:
    """On hosts with GPUs, the lab's view of them (mnft.hosts.lab): whose run holds a GPU in use (each GPU's
    "lease"), and each GPU's health and drain mark as the host judges them ("gpu_health": the lab's devices, or
    {"error"}: rules.gpu_health). Asked only there: a lab without GPUs costs no round-trip more, and a host whose
    nvidia-smi the probe saw stall is not asked again (its health: the stall)."""
    busy = [h for h in hosts if (facts[h.name].get("nvidia") or {}).get("gpus") or "nvidia" in (facts[h.name].get("errors") or {})]
    for host in [h for h in busy if STALLED in str((facts[h.name].get("errors") or {}).get("nvidia") or "")]:
        # the probe's nvidia-smi already stalled for its whole bound: asking again would double check's time
        facts[host.name]["gpu_health"] = {"devices": [], "error": str(facts[host.name]["errors"]["nvidia"]), "drain_problem": None}
        busy.remove(host)
    if not busy:
        return
    from mnft.hosts import leases

    for name, view in leases.lab(fleet, busy).items():
        facts[name]["gpu_health"] = {"devices": view.get("devices") or [], "error": view.get("devices_error") or view.get("error"),
                                     "drain_problem": view.get("drain_problem")}
        held = {d.get("index"): d for d in view.get("devices") or [] if d.get("state") == "held"}
        for gpu in (facts[name].get("nvidia") or {}).get("gpus") or []:
            if gpu.get("index") in held:
                gpu["lease"] = {"holder": held[gpu["index"]].get("holder"), "lockers": held[gpu["index"]].get("lockers")}


def missing_files(fleet: Fleet, hosts: list[Host], paths: tuple[str, ...]) -> list[Problem]:
    """A problem for each host that lacks one of the files (`test -f`, relative paths in the workdir)."""
    problems = []
    for path in paths:
        def test_file(host: Host, path: str = path) -> Command:
            return Command.of("test", "-f", path, cwd=None if path.startswith(("/", "~")) else host.workdir)

        for result in fleet.run(test_file, hosts=hosts):
            if result.status is Status.OK:
                continue
            if result.status is Status.FAILED and result.exit_code == 1:
                problems.append(Problem(result.host, "script", f"{path} does not exist on this host",
                                        "copy it there (or use a path inside the synced tree, relative to it)"))
            else:
                problems.append(Problem(result.host, "script", f"cannot tell whether {path} exists: {result.error}", "check the host"))
    return problems
