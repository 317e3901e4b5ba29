"""The inventory: three formats, one precedence, strict errors that name the file, line, host and key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mnft import inventory
from mnft.errors import InputError

REPO = Path(__file__).resolve().parent.parent


def parse(text: str, name: str = "inv.yaml"):
    return inventory.parse(textwrap.dedent(text), Path(name))


def error_of(text: str) -> str:
    with pytest.raises(InputError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ mnft format


def test_mnft_hosts_keep_their_order_as_node_rank_and_take_vars_as_defaults():
    inv = parse(
        """
        vars: {user: train, slots: 8, iface: ib0}
        hosts:
          gpu2: {address: 10.0.0.2}
          gpu1: {address: 10.0.0.1, slots: 4}
        """
    )
    assert inv.format == "mnft"
    assert [(h.name, h.rank, h.slots, h.user, h.iface) for h in inv.hosts] == [
        ("gpu2", 0, 8, "train", "ib0"),
        ("gpu1", 1, 4, "train", "ib0"),
    ]
    assert inv.master.name == "gpu2"
    assert inv.world_size == 12


def test_the_inventory_may_name_the_master_and_a_known_hosts_file_relative_to_itself():
    inv = parse("master: b\nknown_hosts: keys/known\nhosts: {a: {}, b: {}}\n", "/lab/inv.yaml")
    assert inv.master.name == "b"
    assert inv.known_hosts == Path("/lab/keys/known")


def test_a_host_without_address_is_reached_by_its_name():
    inv = parse("hosts:\n  node7:\n")
    assert inv.hosts[0].address == "node7"
    assert inv.hosts[0].port is None and inv.hosts[0].user is None


def test_local_connection_needs_no_address():
    host = parse("hosts: {me: {connection: local}}").hosts[0]
    assert host.is_local and host.address == "localhost"


def test_the_embedded_default_inventory_is_this_machine_without_ssh():
    inv = inventory.load(REPO / "inventory" / "local.yaml")
    assert [h.connection for h in inv.hosts] == ["local"]


def test_the_example_inventory_is_valid():
    inv = inventory.load(REPO / "inventory" / "example.yaml")
    assert len(inv.hosts) >= 2


# ------------------------------------------------------------------------------------------ ansible


ANSIBLE = """
all:
  vars:
    ansible_user: lab
    slots: 8
    ansible_python_interpreter: /usr/bin/python3
    mnft_master: node02
    backup_target: nas    # another tool's variable: kept aside, not an error
  children:
    gpu:
      vars: {ansible_port: 2222, iface: ib0}
      hosts:
        node[01:03]:
      children:
        big:
          vars: {slots: 16}
          hosts:
            node03: {ansible_host: 10.1.0.3}
    cpu:
      hosts:
        helper: {ansible_host: 10.1.0.9, ansible_connection: local}
"""


def test_ansible_inventory_expands_ranges_and_applies_all_parent_child_host_precedence():
    inv = parse(ANSIBLE)
    assert inv.format == "ansible"
    by = {h.name: h for h in inv.hosts}
    assert [h.name for h in inv.hosts] == ["node01", "node02", "node03", "helper"]
    assert by["node01"].slots == 8 and by["node01"].port == 2222 and by["node01"].iface == "ib0"
    assert by["node03"].slots == 16  # child group beats parent group
    assert by["node03"].address == "10.1.0.3"  # host var beats everything
    assert by["node01"].address == "node01"
    assert by["node02"].user == "lab" and by["node02"].python == "/usr/bin/python3"
    assert by["helper"].connection == "local"
    assert inv.master.name == "node02"
    assert inv.ignored["node01"] == ("backup_target",)


def test_ansible_top_level_groups_without_all_are_read():
    inv = parse("gpus:\n  hosts:\n    a:\n    b:\n")
    assert inv.format == "ansible" and [h.name for h in inv.hosts] == ["a", "b"]


@pytest.mark.parametrize(
    "pattern, names",
    [
        ("node[01:03]", ["node01", "node02", "node03"]),
        ("n[1:10:4]", ["n1", "n5", "n9"]),
        ("rack[a:b]-n[1:2]", ["racka-n1", "racka-n2", "rackb-n1", "rackb-n2"]),
        ("plain", ["plain"]),
    ],
)
def test_host_ranges_expand_like_ansible(pattern, names):
    assert inventory.expand_host_pattern(pattern) == names


def test_ansible_typo_of_an_mnft_key_is_an_error_not_a_silent_default():
    msg = error_of("all:\n  hosts:\n    a:\n      slot: 8\n")
    assert "host 'a'" in msg and "'slot'" in msg and "did you mean 'slots'" in msg


def test_ansible_group_with_unknown_structure_key_is_refused():
    msg = error_of("all:\n  host:\n    a:\n")
    assert "group 'all'" in msg and "'host'" in msg and "did you mean 'hosts'" in msg


# ------------------------------------------------------------------------------------------ hostfile


def test_deepspeed_hostfile():
    inv = parse("# lab\nworker-1 slots=8\nworker-2 slots=4  # smaller\n\n", "hostfile")
    assert inv.format == "hostfile"
    assert [(h.name, h.slots, h.address) for h in inv.hosts] == [("worker-1", 8, "worker-1"), ("worker-2", 4, "worker-2")]


def test_hostfile_errors_name_the_line():
    with pytest.raises(InputError, match=r"hostfile:3: host 'b': duplicate host \(first on line 2\)"):
        parse("# x\nb slots=1\nb slots=2\n", "hostfile")
    with pytest.raises(InputError, match=r"hostfile:1: host 'a': unknown key 'slot' \(did you mean 'slots'\?\)"):
        parse("a slot=2\n", "hostfile")
    with pytest.raises(InputError, match=r"hostfile:1: .* 'slots': 'x' is not a whole number"):
        parse("a slots=x\n", "hostfile")


# ------------------------------------------------------------------------------------------ bad input


def test_missing_file_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.yaml: inventory file not found"):
        inventory.load(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_file_and_line():
    msg = error_of("hosts:\n  a: {address: 1.2.3.4\n  b: {}\n")
    assert msg.startswith("inv.yaml:3: YAML syntax error")


@pytest.mark.parametrize("text", ["", "# nothing\n", "hosts: {}\n", "hosts:\n", "all:\n  hosts: {}\n"])
def test_empty_inventory_is_refused(text):
    assert "inventory is empty" in error_of(text)


def test_duplicate_host_in_yaml_is_refused_with_its_line():
    msg = error_of("hosts:\n  a: {}\n  b: {}\n  a: {slots: 2}\n")
    assert msg == "inv.yaml:4: duplicate key 'a' (a host or setting is listed twice)"


def test_two_names_for_the_same_machine_are_refused():
    msg = error_of("hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.1}\n")
    assert "host 'b': duplicate host: same address, port and user as 'a'" in msg


def test_unknown_key_is_refused_with_a_suggestion_and_line():
    msg = error_of("hosts:\n  a:\n    adress: 10.0.0.1\n")
    assert msg == "inv.yaml:3: host 'a': unknown key 'adress' (did you mean 'address'?)"
    assert "unknown top-level key 'host' (did you mean 'hosts'?)" in error_of("host:\n  a: {}\n")
    assert "vars: unknown key 'slot' (did you mean 'slots'?)" in error_of("vars: {slot: 2}\nhosts: {a: {}}\n")


@pytest.mark.parametrize("port", [0, 70000, "ssh", -1, True])
def test_bad_port_is_refused(port):
    msg = error_of(f"hosts:\n  a: {{port: {port!r}}}\n".replace("'", '"'))
    assert "host 'a'" in msg and "'port'" in msg and "is not a port number" in msg


@pytest.mark.parametrize("slots", [0, -2, 1.5, "eight"])
def test_non_positive_or_non_integer_slots_are_refused(slots):
    msg = error_of(f"hosts:\n  a: {{slots: {slots!r}}}\n".replace("'", '"'))
    assert "host 'a': key 'slots'" in msg and "must be a whole number" in msg


def test_unknown_connection_type_is_refused():
    msg = error_of("hosts:\n  a: {connection: telnet}\n")
    assert "host 'a': key 'connection': unknown connection type 'telnet' (use one of: ssh, local)" in msg


def test_master_must_be_one_of_the_hosts():
    assert "key 'master': 'nod1' is not a host of this inventory (did you mean 'node1'?)" in error_of("master: nod1\nhosts: {node1: {}, node2: {}}\n")


def test_values_with_shell_metacharacters_are_kept_as_data():
    inv = parse("hosts:\n  a:\n    user: 'x; touch /tmp/pwned'\n    workdir: '$(id)/`id`'\n")
    assert inv.hosts[0].user == "x; touch /tmp/pwned" and inv.hosts[0].workdir == "$(id)/`id`"


def test_multi_line_values_and_option_like_addresses_are_refused():
    assert "must be a single line" in error_of('hosts:\n  a: {user: "x\\ny"}\n')
    assert "must not start with '-'" in error_of('hosts:\n  a: {address: "-oProxyCommand=id"}\n')


# ------------------------------------------------------------------------------------------ printed as data


MARKUP = ["a[/b]", "[bold]x", "[gpu01]:2222", "[red]oops[/red]"]


def test_invoke_inventory_prints_values_that_look_like_markup_verbatim(capsys):
    from mnft import report

    hosts = tuple(
        inventory.Host(name=name, rank=rank, address="localhost", user="u", connection="local", workdir=f"~/w{name}", python=name)
        for rank, name in enumerate(MARKUP)
    )
    inv = inventory.Inventory(Path("in[/x]v.yaml"), "mnft", hosts, MARKUP[0], ignored={MARKUP[1]: ("[/c]",)})
    report.print_inventory(inv, as_json=False)  # rich would raise MarkupError on "a[/b]" if it read it as markup
    out = capsys.readouterr().out
    for name in MARKUP:
        assert name in out
        assert f"~/w{name}" in out
    assert "in[/x]v.yaml" in out and "[/c]" in out


def test_check_and_trust_tables_print_names_and_errors_verbatim(capsys):
    from mnft import report
    from mnft.check import CheckReport, Problem
    from mnft.fleet import HostResult, Status
    from mnft.hostkeys import TrustResult

    hosts = tuple(inventory.Host(name=name, rank=rank, address="localhost", connection="local") for rank, name in enumerate(MARKUP))
    inv = inventory.Inventory(None, "mnft", hosts, MARKUP[0])
    outcomes = {h.name: HostResult(h.name, Status.UNREACHABLE, error=f"no route to {h.name}") for h in hosts}
    rep = CheckReport(inv, outcomes, {}, problems=[Problem("[bold]x", "disk", "full at [/tmp]", "free [b]space")])
    report.print_check(rep, as_json=False)
    report.print_trust([TrustResult("[gpu01]:2222", "[gpu01]:2222", "ssh-ed25519", "SHA256:x", "recorded")], as_json=False)
    out = capsys.readouterr().out
    for name in MARKUP:
        assert f"no route to {name}" in out
    assert "[bold]x: disk: full at [/tmp]" in out and "free [b]space" in out
    assert out.count("[gpu01]:2222") >= 3
