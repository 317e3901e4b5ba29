"""The inventory: four formats, one precedence, strict errors that name the file, line, host and key."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.hosts import ansible, inventory, settings

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


def test_the_embedded_inventorys_hosts_run_the_python_running_mnft(tmp_path, monkeypatch):
    """Issue 45: `/opt/mnft/bin/python -m invoke train` without the venv activated ran `python3` from PATH (no
    torch). Without --hosts, or --hosts naming the embedded file through the checkout's link, the hosts run
    sys.executable; any other inventory keeps python3 on the host's PATH."""
    import sys

    from mnft.cli.tasks import _inventory

    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "home"))  # no provision record of this machine's
    assert [h.python for h in _inventory(None).hosts] == [sys.executable]
    assert [h.python for h in _inventory(str(REPO / "inventory" / "local.yaml")).hosts] == [sys.executable]
    mine = tmp_path / "mine.yaml"
    mine.write_text((REPO / "inventory" / "local.yaml").read_text())
    assert [h.python for h in _inventory(str(mine)).hosts] == ["python3"]


@pytest.mark.parametrize("text", ["hosts: {me: {connection: local, python: /opt/py/bin/python3}}\n",
                                  "vars: {python: /opt/py/bin/python3}\nhosts: {me: {connection: local}}\n",
                                  "all: {hosts: {me: {ansible_connection: local, ansible_python_interpreter: /opt/py/bin/python3}}}\n"])
def test_a_python_the_inventory_names_wins_over_the_default_it_is_read_with(text):
    assert inventory.parse(text, python="/usr/bin/mnft-python").hosts[0].python == "/opt/py/bin/python3"


@pytest.mark.parametrize("text", ["hosts: {me: {connection: local}}\n", "all: {hosts: {me: {ansible_connection: local}}}\n",
                                  "[lab]\nme ansible_connection=local\n", "me slots=2\n"])
def test_every_format_reads_the_default_python_for_hosts_that_name_none(text):
    assert inventory.parse(text, python="/usr/bin/mnft-python").hosts[0].python == "/usr/bin/mnft-python"
    assert inventory.parse(text).hosts[0].python == "python3"


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
    assert ansible.expand_host_pattern(pattern) == names


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


@pytest.mark.parametrize("slots", [0, -2, 1.5, "eight", 99999999999999999999, 1025])
def test_non_positive_or_non_integer_slots_are_refused(slots):
    msg = error_of(f"hosts:\n  a: {{slots: {slots!r}}}\n".replace("'", '"'))
    assert "host 'a': key 'slots'" in msg and "must be a whole number" in msg


def test_unknown_connection_type_is_refused():
    msg = error_of("hosts:\n  a: {connection: telnet}\n")
    assert "host 'a': key 'connection': unknown connection type 'telnet' (use one of: ssh, local)" in msg


def test_master_must_be_one_of_the_hosts():
    assert "key 'master': 'nod1' is not a host of this inventory (did you mean 'node1'?)" in error_of("master: nod1\nhosts: {node1: {}, node2: {}}\n")


def test_paths_with_shell_metacharacters_are_kept_as_data():
    inv = parse("hosts:\n  a:\n    identity: 'x; touch /tmp/pwned'\n    workdir: '$(id)/`id`'\n")
    assert inv.hosts[0].identity == "x; touch /tmp/pwned" and inv.hosts[0].workdir == "$(id)/`id`"


@pytest.mark.parametrize("user", ["x; touch /tmp/pwned", "-oProxyCommand=id", "a b", "lab # comment", "$(id)", "x'y"])
def test_a_user_that_is_not_a_login_name_is_refused(user):
    # the user becomes `User` in the ~/.ssh/config setup writes on every host and the user of user@host
    assert "key 'user'" in error_of(f"hosts:\n  a:\n    user: {json.dumps(user)}\n") and "not a login name" in error_of(
        f"hosts:\n  a:\n    user: {json.dumps(user)}\n")


@pytest.mark.parametrize("user", ["root", "lab-user", "j.doe", "svc_train", "jdoe@LAB.EXAMPLE.ORG", "machine$", "1001"])
def test_real_login_names_pass(user):
    assert parse(f"hosts:\n  a:\n    user: {json.dumps(user)}\n").hosts[0].user == user


def test_multi_line_values_and_option_like_addresses_are_refused():
    assert "must be a single line" in error_of('hosts:\n  a: {user: "x\\ny"}\n')
    assert "must not start with '-'" in error_of('hosts:\n  a: {address: "-oProxyCommand=id"}\n')


# ------------------------------------------------------------------------------------------ printed as data


MARKUP = ["a[/b]", "[bold]x", "[gpu01]:2222", "[red]oops[/red]"]


def test_invoke_inventory_prints_values_that_look_like_markup_verbatim(capsys):
    from mnft.hosts import report

    hosts = tuple(
        settings.Host(name=name, rank=rank, address="localhost", user="u", connection="local", workdir=f"~/w{name}", python=name)
        for rank, name in enumerate(MARKUP)
    )
    inv = settings.Inventory(Path("in[/x]v.yaml"), "mnft", hosts, MARKUP[0], ignored={MARKUP[1]: ("[/c]",)})
    report.print_inventory(inv, as_json=False)  # rich would raise MarkupError on "a[/b]" if it read it as markup
    out = capsys.readouterr().out
    for name in MARKUP:
        assert name in out
        assert f"~/w{name}" in out
    assert "in[/x]v.yaml" in out and "[/c]" in out


def test_check_and_trust_tables_print_names_and_errors_verbatim(capsys):
    from mnft.check.findings import CheckReport, Problem
    from mnft.check.report import print_check
    from mnft.hosts.fleet import HostResult, Status
    from mnft.hosts.hostkeys import TrustResult
    from mnft.hosts.report import print_trust

    hosts = tuple(settings.Host(name=name, rank=rank, address="localhost", connection="local") for rank, name in enumerate(MARKUP))
    inv = settings.Inventory(None, "mnft", hosts, MARKUP[0])
    outcomes = {h.name: HostResult(h.name, Status.UNREACHABLE, error=f"no route to {h.name}") for h in hosts}
    rep = CheckReport(inv, outcomes, {}, problems=[Problem("[bold]x", "disk", "full at [/tmp]", "free [b]space")])
    print_check(rep, as_json=False)
    print_trust([TrustResult("[gpu01]:2222", "[gpu01]:2222", "ssh-ed25519", "SHA256:x", "recorded")], as_json=False)
    out = capsys.readouterr().out
    for name in MARKUP:
        assert f"no route to {name}" in out
    assert "[bold]x: disk: full at [/tmp]" in out and "free [b]space" in out
    assert out.count("[gpu01]:2222") >= 3


# ------------------------------------------------------------------------------------------ names that reach configs


@pytest.mark.parametrize("name", ["web*", "gpu?", "!bad", "a b", "it's", 'q"uote', "-oProxyCommand=x", "a;b", "$(id)", "a\tb", "node[01", ""])
def test_host_names_that_are_not_host_names_are_refused(name):
    # a host name becomes a `Host` line of ssh_config and a name in /etc/hosts: a pattern or a payload must not
    msg = error_of(f"hosts:\n  {json.dumps(name)}: {{}}\n")
    assert msg.startswith("inv.yaml:2: host ") and "not a valid host name" in msg


def test_valid_host_names_and_addresses_pass():
    inv = parse("hosts:\n  gpu-01.lab_x: {address: fe80::1%eth0}\n  n2: {address: 10.0.0.2}\n  N3: {address: node3.example.org}\n")
    assert [h.address for h in inv.hosts] == ["fe80::1%eth0", "10.0.0.2", "node3.example.org"]


@pytest.mark.parametrize("address", ["a b", "$(touch x)", "x;y", "h*"])
def test_an_address_that_is_not_a_host_or_ip_is_refused(address):
    msg = error_of(f'hosts:\n  a:\n    address: "{address}"\n')
    assert msg.startswith("inv.yaml:3: host 'a': key 'address'") and "not a host name or IP address" in msg


@pytest.mark.parametrize("iface", ["eth0;flush ruleset", "a b", "$(id)", "x\"y", "sixteen-chars-xx", "eth0}"])
def test_an_iface_that_is_not_an_interface_name_is_refused(iface):
    # the interface goes into an nftables ruleset loaded as root
    msg = error_of(f"hosts:\n  a:\n    slots: 1\n    iface: '{iface}'\n")
    assert msg.startswith("inv.yaml:4: host 'a': key 'iface'") and "not a network interface name" in msg


@pytest.mark.parametrize("iface", ["eth0", "enp65s0f1np1", "ib0", "bond0.100", "veth1@if7", "br-lab:1"])
def test_real_interface_names_pass(iface):
    assert parse(f"hosts:\n  a: {{iface: '{iface}'}}\n").hosts[0].iface == iface


# ------------------------------------------------------------------------------------------ a lab's Ansible inventory as it is

LAB_ANSIBLE = """\
all:
  vars:
    ansible_user: ops
    ansible_become: true
    ansible_become_method: sudo
    ansible_become_user: root
    ansible_become_pass: "{{ vault_sudo }}"
    ansible_become_exe: sudo
    ansible_become_flags: -H -S
    ansible_ssh_common_args: -o StrictHostKeyChecking=yes
    ansible_ssh_extra_args: -o ServerAliveInterval=30
    ansible_connection_timeout: 30
    ansible_shell_type: sh
    ansible_winrm_transport: ntlm
  hosts:
    gpu01:
      ansible_private_key_file: ~/.ssh/lab_ed25519
      ansible_ssh_pass: not-used
      ansible_hostname: gpu01.lab
    gpu02:
      ansible_ssh_host: 10.2.0.2
      ansible_ssh_user: legacy
      ansible_ssh_port: 2202
      ansible_ssh_private_key_file: ~/.ssh/other
    gpu03:2222:
      ansible_host: 10.2.0.3
      ansible_perl_interpreter: /usr/bin/perl
"""


def test_an_ansible_inventory_with_real_ansible_variables_works_unchanged():
    inv = parse(LAB_ANSIBLE)
    by = {h.name: h for h in inv.hosts}
    assert list(by) == ["gpu01", "gpu02", "gpu03"]
    assert by["gpu01"].identity == "~/.ssh/lab_ed25519"  # ansible_private_key_file is Ansible's alias
    assert by["gpu01"].user == "ops" and by["gpu01"].become is True
    assert (by["gpu02"].address, by["gpu02"].user, by["gpu02"].port, by["gpu02"].identity) == ("10.2.0.2", "legacy", 2202, "~/.ssh/other")
    assert (by["gpu03"].address, by["gpu03"].port) == ("10.2.0.3", 2222)  # `name:port` as Ansible reads it
    ignored = inv.ignored["gpu01"]
    for var in ("ansible_become_method", "ansible_become_user", "ansible_become_pass", "ansible_ssh_common_args", "ansible_ssh_pass", "ansible_hostname", "ansible_connection_timeout"):
        assert var in ignored  # accepted and shown by `invoke inventory` as not used by mnft


@pytest.mark.parametrize(
    "var, meant",
    [("ansible_prot", "ansible_port"), ("ansible_usr", "ansible_user"), ("ansible_python_interpeter", "ansible_python_interpreter"), ("slot", "slots"), ("mnft_iface_name", "mnft_iface")],
)
def test_ansible_near_misses_of_the_names_mnft_reads_are_refused(var, meant):
    msg = error_of(f"all:\n  hosts:\n    a:\n      {var}: 1\n")
    assert msg.startswith("inv.yaml:4: host 'a'") and f"unknown key {var!r} (did you mean {meant!r}?)" in msg


def test_ansible_bad_values_name_the_line_that_set_them():
    assert error_of("all:\n  vars:\n    slots: 0\n  hosts:\n    a:\n").startswith("inv.yaml:3: host 'a': key 'slots'")
    assert error_of("all:\n  hosts:\n    a:\n    b:\n      ansible_port: 70000\n").startswith("inv.yaml:5: host 'b': key 'port': 70000 is not a port number")
    assert error_of("all:\n  hosts:\n    a:\n      ansible_connection: winrm\n").startswith("inv.yaml:4: host 'a': key 'connection': unknown connection type 'winrm'")


def test_hostfile_bad_slots_name_the_line():
    with pytest.raises(InputError, match=r"^hostfile:2: host 'b': key 'slots': 0 must be a whole number"):
        parse("a slots=1\nb slots=0\n", "hostfile")
    with pytest.raises(InputError, match=r"^hostfile:2: host 'n1': write 'slots=N' with no spaces around '='"):
        parse("# lab\nn1 slots = 8\n", "hostfile")
    with pytest.raises(InputError, match=r"^hostfile:1: host 'n\*': not a valid host name"):
        parse("n* slots=2\n", "hostfile")


# ------------------------------------------------------------------------------------------ ~/.ssh/config


@pytest.fixture
def ssh_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))
    return home


def test_ssh_config_supplies_what_the_inventory_leaves_out(ssh_home):
    from mnft.hosts import report

    (ssh_home / ".ssh" / "config").write_text(
        "Host gpu01\n  HostName 10.3.0.1\n  User lab\n  Port 2201\n  IdentityFile ~/.ssh/lab_key\n"
        "Host gpu02\n  HostName 10.3.0.2\n  User lab\n  Port 2202\n"
    )
    inv = parse("hosts:\n  gpu01: {}\n  gpu02: {user: me, port: 22, identity: /keys/mine}\n")
    rows = {row["name"]: row for row in report.effective_settings(inv)}
    assert (rows["gpu01"]["address"], rows["gpu01"]["port"], rows["gpu01"]["user"]) == ("10.3.0.1", 2201, "lab")
    assert rows["gpu01"]["identity"] == str(ssh_home / ".ssh" / "lab_key")
    # what the inventory says wins over ~/.ssh/config
    assert (rows["gpu02"]["address"], rows["gpu02"]["port"], rows["gpu02"]["user"], rows["gpu02"]["identity"]) == ("10.3.0.2", 22, "me", "/keys/mine")


def test_two_aliases_for_one_machine_in_ssh_config_are_refused_before_any_connection(ssh_home):
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet

    (ssh_home / ".ssh" / "config").write_text("Host a b\n  HostName 10.3.0.9\n  User lab\n")
    inv = parse("hosts:\n  a: {}\n  b: {}\n")
    with pytest.raises(InputError, match=r"^inv.yaml: host 'b': duplicate host: ~/.ssh/config sends it to lab@10.3.0.9:22 like 'a'$"):
        Fleet(inv, Timeouts(connect=1))


@pytest.mark.parametrize("doc, message", [
    ('hosts:\n  "h1\\n":\n    address: 10.0.0.1\n', "not a valid host name"),  # passed re.match(...$) before
    ('hosts:\n  h1:\n    address: "10.0.0.1\\n"\n', "must be a single line without control characters"),
    ('hosts:\n  h1:\n    user: "root\\nProxyCommand x"\n', "must be a single line without control characters"),
    ('hosts:\n  h1:\n    workdir: "/srv/mnft\\u001b[2J"\n', "must be a single line without control characters"),
    ('hosts:\n  h1:\n    iface: "eth0\\n"\n', "must be a single line without control characters"),
])
def test_a_value_is_validated_whole_a_trailing_newline_or_control_character_is_refused(doc, message):
    with pytest.raises(InputError, match=message):
        inventory.parse(doc)


# ------------------------------------------------------------------------------------------ Ansible INI

INI_DATA = REPO / "tests" / "data" / "ansible-ini"
ANSIBLE_READ = json.loads((INI_DATA / "expected.json").read_text())  # how ansible-core read each file (make.py)
GOOD_INI = sorted(p.name for p in INI_DATA.glob("*.ini") if not p.name.startswith(("bad-", "strict-")))


def first_appearance(text: str, names: list[str]) -> list[str]:
    """The hosts in the order their first line names them (ranges by their line)."""
    def line_of(name):
        for number, line in enumerate(text.splitlines()):
            word = line.split("#")[0].split()[:1]
            if word and not word[0].startswith("[") and name in ansible.expand_host_pattern(ansible._split_host_port(word[0])[0]):
                return number
        raise AssertionError(name)
    return sorted(names, key=line_of)


@pytest.mark.parametrize("name", GOOD_INI)
def test_an_ini_inventory_from_ansibles_documentation_is_read_as_ansible_reads_it(name):
    from mnft.hosts import ansible_ini

    text = (INI_DATA / name).read_text()
    doc, first_seen = ansible_ini.to_document(text, name)
    raw, _ = ansible.hostvars(doc, name, first_seen)
    expected = ANSIBLE_READ[name]
    assert sorted(h for h, _, _ in raw) == sorted(expected["list_hosts"])
    # every host's variables, merged with Ansible's precedence, typed as Ansible types them (literals on host lines
    # and in :vars sections, a comment kept in a :vars value that is not a literal)
    assert {h: dict(merged) for h, merged, _ in raw} == {h: expected["hostvars"].get(h, {}) for h in expected["list_hosts"]}
    # node_rank order: first appearance in the file (Ansible's own --list-hosts goes breadth first through groups)
    assert [h for h, _, _ in raw] == first_appearance(text, expected["list_hosts"])
    inv = inventory.parse(text, Path(name))
    assert inv.format == "ansible-ini" and [h.name for h in inv.hosts] == [h for h, _, _ in raw]


def test_a_lab_ini_inventory_gives_mnft_its_settings():
    inv = inventory.load(INI_DATA / "lab.ini")
    by = {h.name: h for h in inv.hosts}
    assert [h.name for h in inv.hosts] == ["node01", "node02", "node03", "node04", "node05", "login"]
    assert inv.master_name == "node02" and inv.rendezvous_port == 29600
    assert by["node01"].user == "train" and by["node01"].slots == 8 and by["node01"].iface == "ib0"
    assert by["node01"].python == "/opt/conda/bin/python" and by["node01"].identity == "/home/train/.ssh/id_ed25519"
    assert by["node05"].address == "10.0.0.15" and by["node05"].port == 2222 and by["node05"].become
    assert by["login"].is_local and by["login"].spare and by["login"].slots == 1
    assert inv.ignored["node01"] == ("backup_target",)


def test_groups_nested_in_ini_follow_the_yaml_forms_precedence():
    inv = parse("""\
        [gpu]
        n1 slots=2
        n2
        [gpu:vars]
        slots=4
        ansible_user=gpu
        [lab:children]
        gpu
        [lab:vars]
        slots=8
        ansible_user=lab
        ansible_port=2200
        [all:vars]
        ansible_port=22
        """, "hosts.ini")
    by = {h.name: h for h in inv.hosts}
    assert (by["n1"].slots, by["n2"].slots) == (2, 4)  # host > child group > parent group > all
    assert by["n1"].user == "gpu" and by["n1"].port == 2200


@pytest.mark.parametrize("name", sorted(p.name for p in INI_DATA.glob("bad-*.ini")))
def test_an_ini_inventory_ansible_refuses_is_refused_with_its_line(name):
    assert "error" in ANSIBLE_READ[name]  # Ansible refuses it too
    with pytest.raises(InputError) as info:
        inventory.load(INI_DATA / name)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{INI_DATA / name}:")


def test_an_empty_range_ansible_would_read_as_no_host_is_refused():
    assert "www03.example.com" not in json.dumps(ANSIBLE_READ["strict-empty-range.ini"])  # Ansible: silently none
    with pytest.raises(InputError, match=r"strict-empty-range.ini:2: host 'www\[3:1\].example.com': empty host range"):
        inventory.load(INI_DATA / "strict-empty-range.ini")


@pytest.mark.parametrize("text, message", [
    ("[gpu]\nn1 slot=8\n", r"hosts.ini:2: host 'n1': unknown key 'slot' \(did you mean 'slots'\?\)"),
    ("[gpu]\nn1\n[gpu:vars]\nmnft_slotz=8\n", r"hosts.ini:4: group 'gpu': unknown key 'mnft_slotz'"),
    ("[gpu]\nn1 ansible_port=99999\n", r"hosts.ini:2: host 'n1': key 'port': 99999 is not a port number"),
    ("[gpu]\nn1\n[gpu:vars]\nansible_user=lab # the lab account\n",
     r"hosts.ini:4: .*'lab # the lab account' is not a login name .*comment after a value in a \[group:vars\]"),
    ("[gpu]\nn1 ansible_host=\"'n1\\n'\"\n", r"hosts.ini:2: host 'n1': key 'address': 'n1.n' must be a single line"),
    ("[gpu]\nnode[1:1000000000]\n", r"hosts.ini:2: host 'node\[1:1000000000\]': expands to more than 4096 hosts"),
    ("[gpu]\nn1 ansible_port=" + "9" * 5000 + "\n", r"hosts.ini:2: key 'ansible_port': an integer of 5000 characters"),
    ("[gpu]\nn1 'bad name'\n", r"hosts.ini:2: host 'n1': expected key=value"),
])
def test_ini_values_get_the_yaml_forms_errors_and_limits(text, message):
    with pytest.raises(InputError, match=message) as info:
        inventory.parse(text, Path("hosts.ini"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, fmt", [
    ("[gpu]\nn1\n", "ansible-ini"),
    ("n1 ansible_host=10.0.0.1 ansible_user=lab\nn2 ansible_host=10.0.0.2\n", "ansible-ini"),  # no section
    ("n1 slots=8\nn2 slots=8\n", "hostfile"),
    ("all:\n  hosts:\n    n1:\n", "ansible"),
    ("hosts:\n  n1: {}\n", "mnft"),
])
def test_the_format_is_told_from_the_content(text, fmt):
    assert inventory.parse(text, Path("inv")).format == fmt


def test_a_hosts_device_is_cpu_or_gpu_or_what_it_has():

    inv = inventory.parse("hosts:\n  a: {address: 10.0.0.1, device: cpu}\n  b: {address: 10.0.0.2}\n")
    assert [h.device for h in inv.hosts] == ["cpu", None]
    with pytest.raises(InputError, match=r"key 'device': 'tpu' is not a device \(use one of: gpu, cpu; leave it out for what the host has\)"):
        inventory.parse("hosts:\n  a: {address: 10.0.0.1, device: tpu}\n")
