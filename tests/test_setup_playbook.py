"""Playbook loading and validation, step selection, become, cluster addresses, reports: no host is contacted."""

from __future__ import annotations

from pathlib import Path

import pytest

from mnft.core.errors import ExitCode, InputError
from mnft.hosts import inventory
from mnft.hosts.command import Command
from mnft.hosts.settings import Inventory
from mnft.setup import playbook as pb
from mnft.setup.steps.base import CHANGED, FAILED, OK, UNREACHABLE, Become, Outcome

REPO = Path(__file__).resolve().parent.parent
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHmmG8d00K67NVM4V28ABcNoqg7v++t1D2xVakQTFag2 ctl@x\n"


def parse(text: str) -> pb.Playbook:
    return pb.parse(text, Path("book.yaml"))


def error_of(text: str) -> str:
    with pytest.raises(InputError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message and message.startswith("book.yaml")
    return message


def test_the_shipped_playbook_is_valid_and_ordered():
    book = pb.load(REPO / "playbooks" / "setup.yaml")
    assert [s.step for s in book.steps] == ["authorized_keys", "mesh", "hosts_file", "firewall", "reserved_ports", "kernel_log", "admin_group"]
    assert book.steps[3].params["revert_after"] == 30.0 and book.steps[3].params["allow_from"] == ()


def test_unknown_step_names_step_index_and_suggests():
    assert error_of("- name: fw\n  firewal: {}\n") == "book.yaml: step 1 (fw): unknown step 'firewal' (did you mean 'firewall'?)"


def test_unknown_parameter_names_the_key_and_suggests():
    message = error_of("- authorized_keys: {}\n- name: Firewall\n  firewall:\n    ssh_prot: 22\n")
    assert message == "book.yaml: step 2 (Firewall): key 'ssh_prot': unknown parameter (did you mean 'ssh_port'?)"


@pytest.mark.parametrize("body,expected", [
    ("firewall:\n    ssh_port: '22'", "key 'ssh_port': expected a whole number"),
    ("firewall:\n    revert_after: 0", "key 'revert_after': expected a positive number"),
    ("firewall:\n    allow_from: [nowhere]", "key 'allow_from': 'nowhere' is not an IPv4"),
    ("mesh:\n    verify: 'yes'", "key 'verify': 'yes' is not one of true, false, ring, all"),
    ("mesh:\n    verify: 3", "key 'verify': expected one line of text"),
    ("firewall:\n    manager: ufw", "key 'manager': 'ufw' is not one of"),
    ("firewall: [1]", "the parameters of 'firewall' must be a mapping"),
    ("mesh: {}\n  hosts_file: {}", "one step per entry"),
])
def test_bad_parameters_are_one_line_errors(body, expected):
    assert expected in error_of(f"- {body}\n")


@pytest.mark.parametrize("text,expected", [("", "lists no step"), ("steps: []\n", "is a list of steps"), ("- 3\n", "step 1: expected a mapping"),
                                           ("- name: x\n", "names no step"), ("- mesh: {}\n  mesh: {}\n", "duplicate key")])
def test_malformed_playbooks(text, expected):
    assert expected in error_of(text)


def test_only_selects_by_step_name_or_tag_and_rejects_unknown():
    book = pb.load(REPO / "playbooks" / "setup.yaml")
    assert [s.step for s in book.select(["trust"])] == ["authorized_keys", "mesh"]
    assert [s.step for s in book.select(["firewall"])] == ["firewall"]
    assert [s.step for s in book.select(["Host names in /etc/hosts"])] == ["hosts_file"]
    with pytest.raises(InputError, match="did you mean 'firewall'"):
        book.select(["firewal"])


def inv(tmp_path: Path, **extra) -> Inventory:
    identity = tmp_path / "id_ed25519"
    (tmp_path / "id_ed25519.pub").write_text(KEY)
    text = f"vars:\n  identity: {identity}\nhosts:\n  h1:\n    address: 10.0.0.11\n  h2:\n    address: 10.0.0.12\n"
    return inventory.parse(text, tmp_path / "inv.yaml")


def test_a_missing_controller_key_is_bad_input_before_any_connection(tmp_path, monkeypatch):
    monkeypatch.setattr(pb, "Fleet", lambda *a, **k: pytest.fail("connected despite bad input"))
    book = parse(f"- authorized_keys:\n    key: {tmp_path / 'nope.pub'}\n- firewall: {{}}\n")
    with pytest.raises(InputError) as info:
        pb.run(inv(tmp_path), book)
    assert str(info.value).startswith("book.yaml: step 1 (authorized_keys): ") and "nope.pub" in str(info.value)
    assert info.value.exit_code == ExitCode.BAD_INPUT


def test_controller_key_defaults_to_the_hosts_identity_pub(tmp_path):
    book = parse("- authorized_keys: {}\n")
    [step] = pb.prepare(book, book.steps, inv(tmp_path))
    assert step.params["keys"]["h1"] == tuple(KEY.split()[:2])


# ---------------------------------------------------------------------------------------------- become


def test_become_wraps_in_sudo_sh_c_and_keeps_the_password_off_the_command_line():
    cmd = Command.of("python3", "-c", "print('$(id)')")
    secret = "s3cr3t; rm -rf /"
    become = Become("password", secret)
    wrapped = become.wrap(cmd).render()
    assert wrapped == "sudo -k -S -p '' sh -c " + "'python3 -c '\"'\"'print('\"'\"'\"'\"'\"'\"'\"'\"'$(id)'\"'\"'\"'\"'\"'\"'\"'\"')'\"'\"''"
    assert secret not in wrapped and secret not in repr(become)
    assert become.stdin_prefix() == (secret + "\n").encode()
    assert Become("nopasswd").wrap(cmd).render().startswith("sudo -n sh -c ")
    assert Become().wrap(cmd) == cmd and Become().stdin_prefix() == b""


def test_become_asks_the_password_once_and_only_when_sudo_needs_it(tmp_path):
    text = "hosts:\n  a: {become: true}\n  b: {become: true}\n  c: {become: true}\n  d: {}\n  e: {}\n"
    i = inventory.parse(text)
    env = lambda uid: {"uid": uid, "user": "root" if uid == 0 else "lab", "home": "/h"}  # noqa: E731
    facts = {"a": {"env": env(1000), "sudo_n": False}, "b": {"env": env(1000), "sudo_n": True}, "c": {"env": env(1000), "sudo_n": False},
             "d": {"env": env(0), "sudo_n": False}, "e": {"env": env(1000), "sudo_n": False}}
    asked = []
    become, no_root = pb._become(i, facts, lambda: asked.append(1) or "pw")
    assert asked == [1]
    assert become["a"] == Become("password", "pw") and become["c"].mode == "password"
    assert become["b"].mode == "nopasswd" and become["d"] == Become()
    assert "set become: true for e" in no_root["e"]
    assert pb._become(i, {"b": facts["b"]}, lambda: pytest.fail("asked"))[0]["b"].mode == "nopasswd"


# ---------------------------------------------------------------------------------------------- addresses


def host(text: str):
    return inventory.parse(text).hosts[0]


def test_cluster_address_is_the_iface_address_else_the_inventory_literal():
    nics = {"lo": ["127.0.0.1"], "eth0": ["192.168.1.5"], "ib0": ["10.10.0.5"]}
    assert pb.cluster_address(host("hosts:\n  n1: {address: 192.168.1.5, iface: ib0}\n"), nics, lambda n: None) == ("10.10.0.5", "ib0")
    assert pb.cluster_address(host("hosts:\n  n1: {address: 192.168.1.5}\n"), nics, lambda n: None) == ("192.168.1.5", "eth0")
    assert pb.cluster_address(host("hosts:\n  n1: {address: 192.168.1.5}\n"), None, lambda n: None) == ("192.168.1.5", None)
    assert pb.cluster_address(host("hosts:\n  n1: {address: n1.lab}\n"), nics, lambda n: "192.168.1.5") == ("192.168.1.5", "eth0")
    # not reached: the address on ib0 is unknown, and the management address is not a stand-in for it
    assert pb.cluster_address(host("hosts:\n  n1: {address: 192.168.1.5, iface: ib0}\n"), None, lambda n: None) == (None, "ib0")


THREE = "vars: {iface: ib0}\nhosts:\n  n1: {address: 192.168.1.1}\n  n2: {address: 192.168.1.2}\n  n3: {address: 192.168.1.3}\n"
OLD_BLOCK = ("127.0.0.1 localhost\n# BEGIN mnft cluster hosts (managed by mnft setup; remove with: invoke setup --undo)\n"
             "10.10.0.1\tn1\n10.10.0.2\tn2\n10.10.0.3\tn3\n# END mnft cluster hosts\n")


def reached(*names: str) -> dict:
    return {n: {"interfaces": {"ib0": [f"10.10.0.{n[1:]}"]}, "etc_hosts": OLD_BLOCK} for n in names}


def test_an_unreached_host_keeps_its_previous_cluster_address_never_its_management_one():
    inv = inventory.parse(THREE)
    facts = reached("n1", "n2")
    previous = pb.previous_addresses(f["etc_hosts"] for f in facts.values())
    addresses, ifaces, missing, notes = pb.addresses_of(inv, facts, previous, lambda n: None)
    assert addresses == {"n1": "10.10.0.1", "n2": "10.10.0.2", "n3": "10.10.0.3"} and missing == []
    assert ifaces["n3"] == "ib0" and "n3 was not reached" in notes[0] and "10.10.0.3" in notes[0]


def test_an_unreached_host_without_a_previous_entry_is_left_out_not_guessed():
    inv = inventory.parse(THREE)
    facts = {n: {**f, "etc_hosts": "127.0.0.1 localhost\n"} for n, f in reached("n1", "n2").items()}
    addresses, _, missing, notes = pb.addresses_of(inv, facts, pb.previous_addresses(f["etc_hosts"] for f in facts.values()), lambda n: None)
    assert addresses == {"n1": "10.10.0.1", "n2": "10.10.0.2"} and missing == []  # not 192.168.1.3
    assert "n3 was not reached and its address on ib0 is unknown" in notes[0]


def test_a_reached_host_without_an_address_on_its_iface_is_bad_inventory():
    inv = inventory.parse(THREE)
    facts = reached("n1", "n2", "n3")
    facts["n3"] = {**facts["n3"], "interfaces": {"eth0": ["192.168.1.3"]}}
    assert pb.addresses_of(inv, facts, {}, lambda n: None)[2] == ["n3"]


# ---------------------------------------------------------------------------------------------- report


def test_exit_code_and_json_per_host_and_step(tmp_path, capsys):
    i = inv(tmp_path)
    book = parse("- authorized_keys: {}\n- mesh: {}\n")
    report = pb.SetupReport(i, list(book.steps))
    report.outcomes = {1: {"h1": Outcome(OK), "h2": Outcome(CHANGED, ["x"])}, 2: {"h1": Outcome(OK), "h2": Outcome(OK)}}
    assert report.exit_code() == ExitCode.OK and report.changed() == 1
    report.outcomes[2]["h1"] = Outcome(FAILED, error="boom")
    assert report.exit_code() == ExitCode.FAILED
    report.outcomes[2]["h2"] = Outcome(UNREACHABLE, error="no route")
    assert report.exit_code() == ExitCode.UNREACHABLE
    assert report.to_json()["hosts"]["h1"]["2. mesh"] == {"status": "failed", "changes": [], "error": "boom", "notes": []}
    pb.print_report(report, as_json=False)
    out = capsys.readouterr().out
    assert "h1 2. mesh: failed: boom" in out and "1 changed" in out
