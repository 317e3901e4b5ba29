"""`invoke check` and `invoke trust-hosts` against a real simulated cluster (hosts in network namespaces, real sshd).

Every test runs the real CLI as a subprocess (cwd = the repository) with a private controller home: the
developer's ~/.ssh and ~/.mnft are never read or written. Tests that break a host use `healthy_cluster`, which
puts back the original host keys, restarts sshd and kills strays afterwards; files a test writes on a host are
removed by the test itself.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from runhelpers import wait_listening

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
MARKER = "mnft-pwned"  # a file the injection payloads try to create


# ------------------------------------------------------------------------------------------------ helpers


def controller_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), PYTHONUNBUFFERED="1")


def invoke(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(REPO), *args],
        cwd=REPO, env=controller_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )


def check_json(tmp_path: Path, inventory: Path, *extra: str) -> tuple[int, dict]:
    done = invoke(tmp_path, "check", "--hosts", str(inventory), "--json", *extra)
    assert done.returncode != 2, done.stderr
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") from None


def outcomes(report: dict) -> dict[str, str]:
    return {name: host["outcome"] for name, host in report["hosts"].items()}


def problem_fields(report: dict, host: str) -> list[str]:
    return [p["field"] for p in report["hosts"][host]["problems"]]


def sshd_log_sizes(cluster) -> dict[str, int]:
    """Each host's sshd log size once it has stopped growing: sshd writes asynchronously, and an earlier test's
    sessions may still be logging their end."""
    sizes = lambda: {h.name: (h.root / "run" / "sshd.log").stat().st_size for h in cluster.hosts}  # noqa: E731
    deadline, now = time.monotonic() + 10, sizes()
    while True:
        time.sleep(0.5)
        previous, now = now, sizes()
        if now == previous or time.monotonic() > deadline:
            return now


def new_connections(cluster, before: dict[str, int]) -> dict[str, list[str]]:
    """The connections each host's sshd logged since `before` (its sizes): a session accepted, or one that ended
    before authentication ([preauth]); not the end of an earlier session."""
    found = {}
    for h in cluster.hosts:
        with open(h.root / "run" / "sshd.log", errors="replace") as log:
            log.seek(before[h.name])
            lines = [line for line in log if "Accepted" in line or "preauth" in line]
        if lines:
            found[h.name] = lines
    return found


# ------------------------------------------------------------------------------------------------ healthy


def test_four_healthy_hosts_pass(cluster, tmp_path):
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")

    code, report = check_json(tmp_path, inventory)
    assert code == 0, report
    assert outcomes(report) == {h.name: "ok" for h in cluster.hosts}
    assert report["exit_code"] == 0 and report["port_free"] is True
    for name, host in report["hosts"].items():
        assert host["facts"]["hostname"] == name
        assert host["reach"]["ok"] is True and host["reach"]["iface"] == "eth0"
        assert host["problems"] == []

    table = invoke(tmp_path, "check", "--hosts", str(inventory))
    assert table.returncode == 0, table.stdout + table.stderr
    assert "every host can join the job" in table.stdout
    for host in cluster.hosts:
        assert host.name in table.stdout


# ------------------------------------------------------------------------------------------------ version drift


def test_torch_version_drift_fails_naming_the_host_and_the_field(cluster, tmp_path):
    drifted = cluster.hosts[2]
    # A per-host interpreter whose `import torch` would load a torch 9.9.9 package (PYTHONPATH precedes
    # site-packages): the package with the build's version.py, and its installed metadata.
    fake = drifted.home / "mnft-test-fake-torch"
    package = fake / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from torch.version import __version__\n")
    (package / "version.py").write_text("__version__ = '9.9.9'\ncuda = None\ngit_version = 'fake'\n")
    dist = fake / "site" / "torch-9.9.9.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    wrapper = fake / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH=/root/mnft-test-fake-torch/site exec {shlex.quote(cluster.python)} \"$@\"\n")
    wrapper.chmod(0o755)
    try:
        inventory = cluster.write_inventory(
            tmp_path / "inventory.yaml", python={drifted.name: "/root/mnft-test-fake-torch/python"}
        )
        code, report = check_json(tmp_path, inventory, "--no-network")
        assert code == 1, report
        assert report["hosts"][drifted.name]["facts"]["torch"]["version"] == "9.9.9"
        assert report["hosts"][drifted.name]["facts"]["torch"]["location"] == "/root/mnft-test-fake-torch/site/torch"
        # the wrapper's torch is what that interpreter really imports
        imported = cluster.run(drifted, ["/root/mnft-test-fake-torch/python", "-c", "import torch; print(torch.__version__)"])
        assert imported.stdout.strip() == "9.9.9"
        assert outcomes(report) == {h.name: ("failed" if h is drifted else "ok") for h in cluster.hosts}
        [problem] = report["hosts"][drifted.name]["problems"]
        assert problem["field"] == "torch" and "9.9.9" in problem["message"]
        assert "pip install torch==" in problem["fix"]

        table = invoke(tmp_path, "check", "--hosts", str(inventory), "--no-network")
        assert table.returncode == 1
        assert f"{drifted.name}: torch" in table.stdout
    finally:
        subprocess.run(["rm", "-rf", str(fake)], check=True)


# ------------------------------------------------------------------------------------------------ unreachable


def test_unreachable_hosts_are_reported_while_the_others_report_facts(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    h1, h2, h3, h4 = cluster.hosts
    cluster.stop_sshd(h2)  # refused
    nobody = str(cluster.subnet.network_address + 99)  # no host: the connection attempt gets no answer
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", address={h4.name: nobody})

    code, report = check_json(tmp_path, inventory, "--connect-timeout", "5")

    assert code == 4, report
    assert outcomes(report) == {"h1": "ok", "h2": "unreachable", "h3": "ok", "h4": "unreachable"}
    assert "refused" in report["hosts"]["h2"]["error"]
    # Within the connect timeout given on the command line (or a faster "no route"), not the 10 s default.
    error = report["hosts"]["h4"]["error"]
    assert "within 5s" in error or "no route" in error, error
    for name in ("h1", "h3"):
        assert report["hosts"][name]["facts"]["hostname"] == name
        assert report["hosts"][name]["reach"]["ok"] is True


# ------------------------------------------------------------------------------------------------ host keys


def test_changed_host_key_is_refused_and_never_trusted(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    changed = cluster.hosts[2]
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    new_key = cluster.regenerate_host_key(changed)

    code, report = check_json(tmp_path, inventory, "--no-network")
    assert code == 4, report
    assert outcomes(report) == {h.name: ("host-key-rejected" if h is changed else "ok") for h in cluster.hosts}
    error = report["hosts"][changed.name]["error"]
    assert "HOST KEY CHANGED" in error and "man-in-the-middle" in error
    assert report["hosts"][changed.name]["facts"] is None

    trust = invoke(tmp_path, "trust-hosts", "--hosts", str(inventory), "--json")
    assert trust.returncode == 4, trust.stdout + trust.stderr
    states = {r["name"]: r["state"] for r in json.loads(trust.stdout)}
    assert states == {h.name: ("changed" if h is changed else "already-trusted") for h in cluster.hosts}
    mnft_known = tmp_path / "mnft-home" / "known_hosts"
    assert not mnft_known.exists() or new_key.split()[1] not in mnft_known.read_text()

    cluster.restore([changed])
    code, report = check_json(tmp_path, inventory, "--no-network")
    assert code == 0, report


def test_unknown_host_key_is_refused_until_trusted_on_purpose(cluster, tmp_path):
    stranger = cluster.hosts[1]
    partial = tmp_path / "known_hosts"
    lines = cluster.known_hosts.read_text().splitlines()
    partial.write_text("".join(ln + "\n" for ln in lines if not ln.startswith(stranger.address + " ")))
    assert stranger.address not in partial.read_text()
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", known_hosts=str(partial))

    code, report = check_json(tmp_path, inventory, "--no-network")
    assert code == 4, report
    assert outcomes(report)[stranger.name] == "host-key-rejected"
    assert "unknown host key" in report["hosts"][stranger.name]["error"]
    assert "invoke trust-hosts" in report["hosts"][stranger.name]["error"]

    trust = invoke(tmp_path, "trust-hosts", "--hosts", str(inventory))
    assert trust.returncode == 0, trust.stdout + trust.stderr
    pub = tmp_path / "host_key.pub"
    pub.write_text(stranger.host_key_pub + "\n")
    expected = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]
    assert expected.startswith("SHA256:")
    assert expected in trust.stdout
    recorded = (tmp_path / "mnft-home" / "known_hosts").read_text().splitlines()
    assert recorded == [f"{stranger.address} {stranger.host_key_pub.split()[0]} {stranger.host_key_pub.split()[1]}"]
    assert oct((tmp_path / "mnft-home" / "known_hosts").stat().st_mode & 0o777) == "0o600"

    again = invoke(tmp_path, "trust-hosts", "--hosts", str(inventory), "--json")
    assert again.returncode == 0
    assert {r["state"] for r in json.loads(again.stdout)} == {"already-trusted"}

    code, report = check_json(tmp_path, inventory, "--no-network")
    assert code == 0, report


# ------------------------------------------------------------------------------------------------ bad inventories


def _bad_inventories(cluster, tmp_path: Path) -> list[tuple[str, Path, list[str]]]:
    """(case, inventory file, words stderr must name)."""
    good = yaml.safe_load(cluster.write_inventory(tmp_path / "good.yaml").read_text())

    def variant(name: str, mutate) -> Path:
        doc = json.loads(json.dumps(good))
        mutate(doc)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def raw(name: str, text: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        return path

    h1, h2 = cluster.hosts[0], cluster.hosts[1]
    duplicate = (tmp_path / "good.yaml").read_text() + f"  {h1.name}:\n    address: {h1.address}\n"
    return [
        ("missing file", tmp_path / "nowhere.yaml", ["not found"]),
        ("yaml syntax", raw("syntax", f"hosts:\n  h1: {{address: [{h1.address}\n  h2: {{}}\n"), ["YAML syntax error"]),
        ("empty", raw("empty", ""), ["empty"]),
        ("duplicate host", raw("duplicate", duplicate), ["duplicate", repr(h1.name)]),
        ("unknown key", variant("unknown-key", lambda d: d["hosts"]["h2"].update(adress=h2.address)), ["'adress'", "'h2'", "did you mean 'address'"]),
        ("bad port", variant("bad-port", lambda d: d["hosts"]["h2"].update(port=70000)), ["'port'", "'h2'", "70000"]),
        ("slots 0", variant("slots-0", lambda d: d["hosts"]["h2"].update(slots=0)), ["'slots'", "'h2'"]),
        ("unknown connection", variant("telnet", lambda d: d["hosts"]["h2"].update(connection="telnet")), ["'connection'", "'h2'", "telnet"]),
    ]


def test_bad_inventories_exit_2_with_one_line_and_touch_no_host(cluster, tmp_path):
    cases = _bad_inventories(cluster, tmp_path)
    before = sshd_log_sizes(cluster)
    failures = []
    for case, path, words in cases:
        done = invoke(tmp_path, "check", "--hosts", str(path), timeout=60)
        lines = done.stderr.strip().splitlines()
        named = [w for w in [str(path), *words] if w not in done.stderr]
        if done.returncode != 2 or len(lines) != 1 or named or done.stdout.strip():
            failures.append(f"{case}: exit {done.returncode}, missing {named}, stderr={done.stderr!r} stdout={done.stdout[-300:]!r}")
    assert not failures, "\n".join(failures)
    sshd_log_sizes(cluster)  # until sshd has written what it will
    assert new_connections(cluster, before) == {}, "a bad inventory made an SSH connection"


# ------------------------------------------------------------------------------------------------ injection

# Each payload tries to create a file named MARKER; {m} is replaced by an absolute path to it.
PAYLOADS = [
    "; touch {m}",
    "$(touch {m})",
    "`touch {m}`",
    "x\ntouch {m}",
    "'; touch {m}; '",
    "\"; touch {m}; \"",
    "x && touch {m}",
    "x | touch {m}",
    "$(touch${{IFS}}{m})",  # no white space: valid as a host name
    ";touch${{IFS}}{m};",
]


def _markers_everywhere(cluster) -> list[str]:
    found = []
    for host in cluster.hosts:
        listing = cluster.run(host, ["sh", "-c", "ls -a /root /tmp /root/mnft 2>/dev/null; true"]).stdout
        if MARKER in listing:
            found.append(f"{host.name}: {listing}")
    for place in (Path("/tmp"), REPO, Path.cwd()):
        found += [str(p) for p in place.glob(f"*{MARKER}*")]
    return found


def test_injection_payloads_in_the_inventory_never_execute(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    h1, h2, h3, h4 = cluster.hosts
    assert _markers_everywhere(cluster) == []
    before = sshd_log_sizes(cluster)
    # Names, users and interfaces reach ssh_config, /etc/hosts and nftables rules: a payload there is refused when
    # the inventory is read (exit 2, the one-line message names the host and key, no SSH connection is made).
    refused = []  # (payload, inventory, what the one line names)
    for number, template in enumerate(PAYLOADS):
        payload = template.format(m=f"/tmp/{MARKER}")
        names = tmp_path / f"names-{number}.yaml"
        doc = yaml.safe_load(cluster.write_inventory(tmp_path / "base.yaml", hosts=[h1, h2]).read_text())
        doc["hosts"] = {payload: doc["hosts"][h1.name], h2.name: doc["hosts"][h2.name]}
        names.write_text(yaml.safe_dump(doc, sort_keys=False))
        iface = cluster.write_inventory(tmp_path / f"iface-{number}.yaml", iface={h2.name: payload})
        address = cluster.write_inventory(tmp_path / f"address-{number}.yaml", address={h3.name: payload})
        user = cluster.write_inventory(tmp_path / f"user-{number}.yaml", user={h1.name: payload})
        refused += [(payload, inventory, named) for inventory, named in ((names, "not a valid host name"), (iface, "key 'iface'"),
                                                                         (address, "key 'address'"), (user, "key 'user'"))]
    # 40 commands that touch no host: a few at once (each is a Python start and an inventory read, nothing else)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda one: invoke(tmp_path, "check", "--hosts", str(one[1]), "--json", "--connect-timeout", "3", "--no-network"),
                             refused))
    for (payload, inventory, named), done in zip(refused, runs):
        why = f"{payload!r} in {inventory.name}: exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
        assert done.returncode == 2, why
        assert named in done.stderr and len(done.stderr.strip().splitlines()) == 1, why
    sshd_log_sizes(cluster)  # until sshd has written what it will
    assert new_connections(cluster, before) == {}, "a refused inventory made an SSH connection"
    # Paths, interpreters and identities are data: carried to the hosts, quoted, never executed.
    carried = []
    for number, template in enumerate(PAYLOADS):
        payload = template.format(m=f"/tmp/{MARKER}")
        tilde_payload = "~/" + template.format(m=f"~/{MARKER}")
        fields = cluster.write_inventory(
            tmp_path / f"fields-{number}.yaml",
            workdir={h1.name: payload, h2.name: payload, h4.name: tilde_payload},
            python={h3.name: payload},
            identity={h4.name: payload},
        )
        done = invoke(tmp_path, "check", "--hosts", str(fields), "--json", "--connect-timeout", "3", "--no-network")
        why = f"{payload!r} in {fields.name}: exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
        if "\n" in payload:  # a value must be a single line
            assert done.returncode == 2 and "must be a single line" in done.stderr, why
        else:
            assert done.returncode in (1, 4), why
            report = json.loads(done.stdout)
            assert set(report["hosts"]) == {h.name for h in cluster.hosts}
            carried.append(payload)
        assert _markers_everywhere(cluster) == [], f"{payload!r} executed"
    assert len(carried) == len(PAYLOADS) - 1  # every payload without a newline reached the hosts as data


def test_injection_payloads_in_environment_values_arrive_verbatim(cluster, tmp_path, monkeypatch):
    from mnft.hosts import inventory as inv_mod
    from mnft.hosts.command import Command
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))
    inv = inv_mod.load(cluster.write_inventory(tmp_path / "inventory.yaml"))
    payloads = [t.format(m=f"/tmp/{MARKER}") for t in PAYLOADS]
    with Fleet(inv, Timeouts(connect=10, command=30)) as fleet:
        for payload in payloads:
            results = fleet.run(Command.of("printenv", "MNFT_PAYLOAD", env={"MNFT_PAYLOAD": payload}, cwd="~/"))
            for result in results:
                assert result.ok, result
                assert result.stdout == payload + "\n"
    assert _markers_everywhere(cluster) == []


# ------------------------------------------------------------------------------------------------ network


def test_rendezvous_port_held_on_the_master_fails_naming_the_port(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    master = cluster.hosts[0]
    holder = cluster.popen(master, [cluster.python, "-c", (
        "import socket,time\n"
        "s=socket.socket(); s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(300)"
    )])
    try:
        wait_listening(cluster, master, 29500)
        inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
        code, report = check_json(tmp_path, inventory)
        assert code == 1, report
        assert report["port_free"] is False
        [problem] = [p for p in report["hosts"][master.name]["problems"] if p["field"] == "port"]
        assert "29500" in problem["message"] and "ss -ltnp" in problem["fix"]
        assert outcomes(report) == {h.name: ("failed" if h is master else "ok") for h in cluster.hosts}
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_firewall_drop_on_the_master_fails_the_peer_with_network(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    master, peer = cluster.hosts[0], cluster.hosts[1]
    table = "mnfttest"
    rules = (
        f"add table inet {table}\n"
        f"add chain inet {table} input {{ type filter hook input priority 0; policy accept; }}\n"
        f"add rule inet {table} input ip saddr {peer.address} tcp dport 29500 drop\n"
    )
    cluster.run(master, ["nft", "-f", "-"], input=rules)
    try:
        inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
        code, report = check_json(tmp_path, inventory)
        assert code == 1, report
        assert outcomes(report) == {h.name: ("failed" if h is peer else "ok") for h in cluster.hosts}
        assert report["hosts"][peer.name]["reach"]["ok"] is False
        [problem] = report["hosts"][peer.name]["problems"]
        assert problem["field"] == "network"
        assert f"{master.address}:29500" in problem["message"]
        assert "firewall" in problem["fix"]
    finally:
        cluster.run(master, ["nft", "delete", "table", "inet", table], check=False)
    assert table not in cluster.run(master, ["nft", "list", "tables"]).stdout
