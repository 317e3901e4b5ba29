"""Setup steps planned from data: facts in, changes and remote ops out. No host, no SSH, no real ~/.ssh."""

from __future__ import annotations

import hashlib
import subprocess
from collections import Counter

import pytest

from mnft.setup.steps import authorized_keys as ak
from mnft.setup.steps import admin_group, blocks, firewall, hosts_file, kernel_log, mesh, reserved_ports
from mnft.setup.steps.base import Param, check_value

CONTROLLER = ("ssh-ed25519", "AAAAC3NzaC1lZDI1NTE5AAAAIHmmG8d00K67NVM4V28ABcNoqg7v++t1D2xVakQTFag2")
OTHER_KEY = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 alice@laptop"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file(text: str | None, mode: int = 0o600) -> dict:
    if text is None:
        return {"exists": False}
    return {"exists": True, "is_dir": False, "text": text, "mode": mode, "uid": 1000, "sha256": sha(text)}


def applied(text: str, plan) -> str:
    """The file text after the plan's last write op (what the host would hold)."""
    for op in plan.ops:
        if op["op"] == "write":
            text = op["text"]
        elif op["op"] == "remove":
            text = ""
    return text


def ak_facts(text: str | None, home_mode: int = 0o755, ssh_mode: int = 0o700, file_mode: int = 0o600, uid: int = 1000, owner: int = 1000) -> dict:
    stats = {"~": {"exists": True, "mode": home_mode, "uid": owner, "is_dir": True},
             "~/.ssh": {"exists": True, "mode": ssh_mode, "uid": owner, "is_dir": True},
             "~/.ssh/authorized_keys": {"exists": text is not None, "mode": file_mode, "uid": owner}}
    return {"env": {"uid": uid, "user": "lab", "home": "/home/lab"}, "stats": stats, "file": file(text, file_mode)}


# ---------------------------------------------------------------------------------------------- blocks


B = blocks.Block("# BEGIN x", "# END x")


def test_block_after_an_unterminated_last_line_is_flagged_and_undo_gives_the_bytes_back():
    new = blocks.set_block("a\nb", B, ["1"])
    assert new == "a\nb\n" + blocks.EOL_ADDED + "\n# BEGIN x\n1\n# END x\n"
    assert blocks.set_block(new, B, ["2"]) == "a\nb\n" + blocks.EOL_ADDED + "\n# BEGIN x\n2\n# END x\n"
    assert blocks.remove_block(new, B) == "a\nb"
    # someone appended after mnft's block: their line needs the newline, only the flag goes
    assert blocks.remove_block(new + "c\n", B) == "a\nb\nc\n"


def test_marked_lines_after_an_unterminated_last_line_are_undone_byte_for_byte():
    owns_a, owns_b = (lambda r: r == "a"), (lambda r: r == "b")
    one = blocks.set_marked_lines("x y", {"a": "k1 mnft:a"}, owns_a)
    assert one == "x y\n" + blocks.EOL_ADDED + "\nk1 mnft:a\n"
    two = blocks.set_marked_lines(one, {"b": "k2 mnft:b"}, owns_b)
    assert blocks.set_marked_lines(one, {"a": "k1 mnft:a"}, owns_a) == one  # idempotent
    without_a = blocks.set_marked_lines(two, {}, owns_a)
    assert without_a == "x y\n" + blocks.EOL_ADDED + "\nk2 mnft:b\n"  # b's line still needs the newline
    assert blocks.set_marked_lines(without_a, {}, owns_b) == "x y"
    assert blocks.set_marked_lines(one + "z\n", {}, owns_a) == "x y\nz\n"


def test_block_is_replaced_where_it_is_and_the_rest_survives_byte_for_byte():
    text = "a\r\n# BEGIN x\nold\n# END x\nz  \n"
    assert blocks.set_block(text, B, ["new"]) == "a\r\n# BEGIN x\nnew\n# END x\nz  \n"
    assert blocks.remove_block(blocks.set_block(text, B, ["new"]), B) == "a\r\nz  \n"


def test_block_begin_without_end_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="no '# END x'"):
        blocks.set_block("# BEGIN x\nstuff\n", B, [])


def test_marked_lines_keep_other_lines_in_place_and_replace_their_own():
    text = "one\nk1 mnft:a\ntwo\nk0 mnft:b\n"
    out = blocks.set_marked_lines(text, {"a": "k2 mnft:a", "c": "k3 mnft:c"}, lambda r: r in ("a", "c"))
    assert out == "one\nk2 mnft:a\ntwo\nk0 mnft:b\nk3 mnft:c\n"


def test_a_commented_line_is_never_mnfts():
    assert blocks.line_role("# ssh-ed25519 AAA mnft:controller:1") is None
    assert blocks.line_role('from="1.2.3.4" ssh-ed25519 AAA mnft:mesh:h1') == "mesh:h1"


# ---------------------------------------------------------------------------------------------- authorized_keys


def test_controller_key_is_appended_with_a_marker_and_other_lines_survive():
    original = f"{OTHER_KEY}\r\ncommand=\"echo hi\" ssh-ed25519 AAAAOTHER bob"  # CRLF, no final newline
    plan = ak.plan_host(ak_facts(original), CONTROLLER)
    role, line = ak.controller_line(*CONTROLLER)
    new = applied(original, plan)
    assert new == original + "\n" + blocks.EOL_ADDED + "\n" + line + "\n"
    assert line.endswith(f" mnft:{role}")
    assert applied(new, ak.plan_undo(ak_facts(new), CONTROLLER)) == original
    write = plan.ops[-1]
    assert write["mode"] == 0o600 and write["dir_mode"] == 0o700 and write["expect_sha256"] == sha(original)


def test_controller_key_second_plan_is_empty():
    first = applied("", ak.plan_host(ak_facts(""), CONTROLLER))
    assert ak.plan_host(ak_facts(first), CONTROLLER).empty


def test_controller_key_already_authorized_by_someone_else_is_left_alone():
    text = f"{CONTROLLER[0]} {CONTROLLER[1]} admin@laptop\n"
    plan = ak.plan_host(ak_facts(text), CONTROLLER)
    assert plan.empty and "already authorized" in plan.notes[0]


def test_missing_authorized_keys_is_created_0600_in_a_0700_dir():
    plan = ak.plan_host(ak_facts(None), CONTROLLER)
    assert plan.ops[-1]["expect_sha256"] is None and plan.ops[-1]["mode"] == 0o600


def test_loose_ssh_dir_and_file_modes_are_fixed():
    text = applied("", ak.plan_host(ak_facts(""), CONTROLLER))
    plan = ak.plan_host(ak_facts(text, ssh_mode=0o755, file_mode=0o644), CONTROLLER)
    assert plan.changes == ["chmod 0700 ~/.ssh (was 0755)", "chmod 0600 ~/.ssh/authorized_keys (was 0644)"]


@pytest.mark.parametrize("home_mode", [0o775, 0o757])
def test_a_home_sshd_strictmodes_would_refuse_fails_with_the_fix(home_mode):
    plan = ak.plan_host(ak_facts("", home_mode=home_mode), CONTROLLER)
    assert plan.error and "StrictModes" in plan.error and "chmod go-w /home/lab" in plan.error and not plan.ops


def test_an_ssh_dir_owned_by_someone_else_fails():
    facts = ak_facts("")
    facts["stats"]["~/.ssh"]["uid"] = 4242
    assert "owned by uid 4242" in ak.plan_host(facts, CONTROLLER).error


def test_undo_removes_only_mnfts_controller_line():
    original = f"{OTHER_KEY}\n"
    with_ours = applied(original, ak.plan_host(ak_facts(original), CONTROLLER))
    other_controller = "ssh-ed25519 AAAAOTHERCONTROLLER mnft:controller:abcdefabcdef\n"
    undone = applied(with_ours + other_controller, ak.plan_undo(ak_facts(with_ours + other_controller), CONTROLLER))
    assert undone == original + other_controller


def test_bad_public_key_file_is_input_error():
    from mnft.core.errors import InputError

    with pytest.raises(InputError, match="not an OpenSSH public key"):
        ak.parse_public_key("-----BEGIN OPENSSH PRIVATE KEY-----\n", "id")
    assert ak.parse_public_key(" ".join(CONTROLLER) + " me@x\n", "id") == CONTROLLER


# ---------------------------------------------------------------------------------------------- mesh


def nodes(**overrides) -> list[mesh.Node]:
    out = [
        mesh.Node("h1", "10.0.0.11", mesh_key="ssh-ed25519 AAAAK1", host_key="ssh-ed25519 AAAAH1"),
        mesh.Node("h2", "10.0.0.12", mesh_key="ssh-ed25519 AAAAK2", host_key="ssh-ed25519 AAAAH2"),
    ]
    return [mesh.Node(**{**n.__dict__, **overrides.get(n.name, {})}) for n in out]


def mesh_files(ak_text="", kh=None, cfg=None) -> dict:
    return {"authorized_keys": file(ak_text), "known_hosts": file(kh), "config": file(cfg), "pub": file("ssh-ed25519 AAAAK1 mnft-mesh@h1\n"),
            "record": file(None), "private": {"exists": True}}


def test_mesh_keys_are_authorized_only_from_the_cluster_addresses():
    lines = mesh.authorized_lines(nodes(), restrict_from=True)
    assert lines == {
        "mesh:h1": 'from="10.0.0.11,10.0.0.12" ssh-ed25519 AAAAK1 mnft:mesh:h1',
        "mesh:h2": 'from="10.0.0.11,10.0.0.12" ssh-ed25519 AAAAK2 mnft:mesh:h2',
    }
    assert mesh.authorized_lines(nodes(), restrict_from=False)["mesh:h1"] == "ssh-ed25519 AAAAK1 mnft:mesh:h1"


def test_known_hosts_use_the_keys_the_controller_read_under_name_and_address():
    ns = nodes(h2={"port": 2222, "aliases": ("node2.lab",)})
    assert mesh.known_hosts_lines(ns, None) == [
        "h1,10.0.0.11 ssh-ed25519 AAAAH1",
        "[h2]:2222,[10.0.0.12]:2222,[node2.lab]:2222 ssh-ed25519 AAAAH2",
    ]


def test_a_node_not_reached_keeps_its_lines_and_the_others_are_updated():
    first = mesh.plan_node(mesh_files(OTHER_KEY + "\n"), nodes(), "~/.ssh/mnft_mesh_ed25519", True)
    ak_text = applied(OTHER_KEY + "\n", _only(first, mesh.AUTHORIZED_KEYS))
    kh_text = applied("", _only(first, mesh.KNOWN_HOSTS))
    down = nodes(h2={"mesh_key": None, "host_key": None})
    again = mesh.plan_node(mesh_files(ak_text, kh_text, applied("", _only(first, mesh.SSH_CONFIG))), down, "~/.ssh/mnft_mesh_ed25519", True)
    assert again.changes == []  # h2's authorization and host key stay as they were
    assert "h2" in " ".join(again.notes)


def test_a_node_whose_address_is_unknown_keeps_its_config_stanza_and_known_hosts_lines():
    first = mesh.plan_node(mesh_files(), nodes(), "~/.ssh/mnft_mesh_ed25519", True)
    kh_text, cfg_text = applied("", _only(first, mesh.KNOWN_HOSTS)), applied("", _only(first, mesh.SSH_CONFIG))
    unknown = nodes(h2={"address": None, "mesh_key": None, "host_key": None})
    again = mesh.plan_node(mesh_files("", kh_text, cfg_text), unknown, "~/.ssh/mnft_mesh_ed25519", True)
    assert not any(op["path"] in (mesh.KNOWN_HOSTS, mesh.SSH_CONFIG) for op in again.ops)
    assert mesh.authorized_lines(unknown, True) == {"mesh:h1": 'from="10.0.0.11" ssh-ed25519 AAAAK1 mnft:mesh:h1'}


def test_a_local_node_gets_every_host_key_of_this_machine(tmp_path):
    (tmp_path / "ssh_host_ed25519_key.pub").write_text("ssh-ed25519 AAAAED root@box\n")
    (tmp_path / "ssh_host_rsa_key.pub").write_text("ssh-rsa AAAARSA root@box\n")
    (tmp_path / "ssh_host_rsa_key").write_text("PRIVATE")
    keys = mesh.local_host_keys(str(tmp_path))
    assert keys == "ssh-ed25519 AAAAED\nssh-rsa AAAARSA"
    assert mesh.known_hosts_lines(nodes(h2={"host_key": keys}), None)[1:] == ["h2,10.0.0.12 ssh-ed25519 AAAAED", "h2,10.0.0.12 ssh-rsa AAAARSA"]
    assert mesh.local_host_keys(str(tmp_path / "none")) is None


def test_a_node_without_host_key_is_named_in_the_plan_notes():
    plan = mesh.plan_node(mesh_files(), nodes(h2={"host_key": None}), "~/.ssh/mnft_mesh_ed25519", True)
    assert any("h2" in n and "not part of the mesh's known_hosts" in n for n in plan.notes)


def test_hosts_block_keeps_the_line_of_a_node_whose_address_is_unknown():
    text = applied(DEBIAN, hosts_file.plan_host(file(DEBIAN, 0o644), NAMES, "/etc/hosts"))
    plan = hosts_file.plan_host(file(text, 0o644), {"h1": "10.0.0.11", "h2": None, "h3": "10.0.0.13"}, "/etc/hosts")
    assert hosts_file.BLOCK.body(applied(text, plan)) == ["10.0.0.11\th1", "10.0.0.12\th2", "10.0.0.13\th3"]
    fresh = hosts_file.plan_host(file(DEBIAN, 0o644), {"h1": "10.0.0.11", "h2": None}, "/etc/hosts")
    assert hosts_file.BLOCK.body(applied(DEBIAN, fresh)) == ["10.0.0.11\th1"]


def _only(plan, path):
    class P:
        ops = [op for op in plan.ops if op["path"] == path]

    return P


def test_mesh_plan_is_idempotent_and_undo_restores_the_files():
    original_ak, original_kh, original_cfg = OTHER_KEY + "\n", "gw ssh-ed25519 AAAAGW\n", "Host *\n    ServerAliveInterval 30\n"
    plan = mesh.plan_node(mesh_files(original_ak, original_kh, original_cfg), nodes(), "~/.ssh/mnft_mesh_ed25519", True)
    new = {p: applied(t, _only(plan, p)) for p, t in ((mesh.AUTHORIZED_KEYS, original_ak), (mesh.KNOWN_HOSTS, original_kh), (mesh.SSH_CONFIG, original_cfg))}
    assert new[mesh.SSH_CONFIG].startswith(original_cfg)  # appended: never captures the user's own options
    assert "    IdentityFile ~/.ssh/mnft_mesh_ed25519\n" in new[mesh.SSH_CONFIG]
    files = mesh_files(new[mesh.AUTHORIZED_KEYS], new[mesh.KNOWN_HOSTS], new[mesh.SSH_CONFIG])
    assert mesh.plan_node(files, nodes(), "~/.ssh/mnft_mesh_ed25519", True).empty
    files["record"] = file(RECORD_KEY)
    undo = mesh.plan_node_undo(files, "~/.ssh/mnft_mesh_ed25519")
    assert applied(new[mesh.AUTHORIZED_KEYS], _only(undo, mesh.AUTHORIZED_KEYS)) == original_ak
    assert applied(new[mesh.KNOWN_HOSTS], _only(undo, mesh.KNOWN_HOSTS)) == original_kh
    assert applied(new[mesh.SSH_CONFIG], _only(undo, mesh.SSH_CONFIG)) == original_cfg
    assert {"op": "remove", "path": "~/.ssh/mnft_mesh_ed25519"} in undo.ops


RECORD_KEY = "# mnft setup made this\ngenerated: key\nssh-ed25519 AAAAK1\n"
RECORD_PUB = "# mnft setup made this\ngenerated: pub\nssh-ed25519 AAAAK1\n"
KEY = "~/.ssh/mnft_mesh_ed25519"


def removed(plan) -> list[str]:
    return [op["path"] for op in plan.ops if op["op"] == "remove"]


def test_undo_never_deletes_a_key_mnft_did_not_generate():
    files = mesh_files()
    files["pub"] = file("ssh-ed25519 AAAA alice@laptop\n")
    assert removed(mesh.plan_node_undo(files, KEY)) == []  # no record: not mnft's, whatever its comment says
    files["pub"] = file("ssh-ed25519 AAAAK1 mnft-mesh@h1\n")
    assert removed(mesh.plan_node_undo(files, KEY)) == []


def test_undo_of_a_pub_mnft_derived_from_someone_elses_private_key_keeps_the_private_key():
    files = mesh_files()
    files["record"] = file(RECORD_PUB)
    plan = mesh.plan_node_undo(files, KEY)
    assert removed(plan) == [KEY + ".pub", KEY + mesh.KEY_RECORD]
    assert "stays" in plan.changes[-1]


def test_undo_keeps_a_key_replaced_since_mnft_generated_it():
    files = mesh_files()
    files["record"] = file(RECORD_KEY)
    files["pub"] = file("ssh-ed25519 AAAANEW alice@laptop\n")
    plan = mesh.plan_node_undo(files, KEY)
    assert removed(plan) == [KEY + mesh.KEY_RECORD] and "kept" in plan.notes[0]


def test_keygen_records_what_it_made_and_never_claims_a_private_key_it_found(tmp_path):
    from mnft.onhost import setuphost

    mine = tmp_path / "mine"
    out = setuphost.op_keygen({"path": str(mine), "comment": "mnft-mesh@h1"})
    assert out["generated"] and mesh.generated_record((tmp_path / ("mine" + mesh.KEY_RECORD)).read_text()) == ("key", out["public"].split()[1])
    theirs = tmp_path / "theirs"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice", "-f", str(theirs)], check=True)
    (tmp_path / "theirs.pub").unlink()
    out = setuphost.op_keygen({"path": str(theirs), "comment": "mnft-mesh@h1"})
    assert not out["generated"] and out["wrote_pub"]
    assert mesh.generated_record((tmp_path / ("theirs" + mesh.KEY_RECORD)).read_text())[0] == "pub"
    files = {**mesh_files(), "pub": file((tmp_path / "theirs.pub").read_text()), "record": file((tmp_path / ("theirs" + mesh.KEY_RECORD)).read_text())}
    assert str(theirs) not in removed(mesh.plan_node_undo(files, str(theirs)))


def test_a_file_holding_only_mnfts_block_is_deleted_on_undo():
    cfg = "".join(mesh.CONFIG_BLOCK.render(["Host h1"]))
    undo = mesh.plan_node_undo({**mesh_files(cfg=cfg), "pub": file(None)}, "k")
    assert {"op": "remove", "path": mesh.SSH_CONFIG, "expect_sha256": sha(cfg)} in undo.ops


def test_a_verification_hop_is_strict_batch_ssh_to_the_peer():
    assert mesh.hop_argv("h2") == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10", "h2", "true"]


def test_verification_is_a_ring_by_default_and_every_pair_paced_with_all():
    names = [f"h{i}" for i in range(1, 65)]
    ring = mesh.verify_batches(names, True)
    assert ring == [[(f"h{i}", f"h{i % 64 + 1}") for i in range(1, 65)]]  # one batch: each node sends one, receives one
    assert mesh.verify_batches(names, "ring") == ring
    every = mesh.verify_batches(names, "all")
    pairs = [pair for batch in every for pair in batch]
    assert sorted(pairs) == sorted((a, b) for a in names for b in names if a != b)
    assert len(every) == 8  # 63 rounds, 8 per batch
    for batch in every:  # no sshd receives more than 8 at once, no node runs more than 8 at once
        assert max(Counter(r for _, r in batch).values()) <= 8 and max(Counter(s for s, _ in batch).values()) <= 8


def test_verify_takes_true_false_ring_or_all():
    assert [mesh.validate({"verify": v}) for v in (True, False, "ring", "all")] == [None] * 4
    assert mesh.validate({"verify": "every"}) == "key 'verify': 'every' is not one of true, false, ring, all"


def verified_files(ns, key_file="~/.ssh/mnft_mesh_ed25519", restrict_from=True) -> dict:
    """A node's files as a correct apply leaves them."""
    ak = "".join(line + "\n" for line in mesh.authorized_lines(ns, restrict_from).values())
    kh = "".join(mesh.KNOWN_BLOCK.render(mesh.known_hosts_lines(ns, None)))
    cfg = "".join(mesh.CONFIG_BLOCK.render(mesh.config_lines(ns, key_file)))
    return {"authorized_keys": file(ak), "known_hosts": file(kh), "config": file(cfg)}


def test_a_nodes_files_after_apply_prove_its_half_of_every_pair():
    ns = nodes()
    routes = mesh.route_sources("10.0.0.12 dev eth0 src 10.0.0.11 uid 0 \\    cache \n")
    assert routes == {"10.0.0.12": "10.0.0.11"}
    assert mesh.check_files("h1", verified_files(ns), ns, "~/.ssh/mnft_mesh_ed25519", True, routes) == []


def test_a_nodes_files_missing_a_peer_name_what_is_missing():
    ns = nodes()
    files = verified_files(ns)
    files["authorized_keys"] = file("")
    files["known_hosts"] = file("h2 ssh-ed25519 AAAAOTHER\n")
    files["config"] = file(None)
    problems = mesh.check_files("h1", files, ns, "~/.ssh/mnft_mesh_ed25519", True, {})
    assert problems == ["~/.ssh/authorized_keys lacks the mesh key of h2", "~/.ssh/known_hosts lacks the host key of h2",
                        "~/.ssh/config lacks mnft's stanza for h2"]


def test_a_peer_not_reached_this_run_keeps_its_lines_and_is_not_checked():
    ns = nodes() + [mesh.Node("h3", "10.0.0.13", mesh_key="ssh-ed25519 AAAAK3", host_key="ssh-ed25519 AAAAH3")]
    files = verified_files(ns)  # from= lists h3's address too, as the previous run wrote it
    down = [n if n.name != "h3" else mesh.Node("h3", "10.0.0.13", mesh_key="ssh-ed25519 AAAAK3") for n in ns]
    assert mesh.check_files("h1", files, down, "~/.ssh/mnft_mesh_ed25519", True, {}, peers={"h1", "h2"}) == []


def test_a_route_to_a_peer_from_an_address_outside_from_is_named():
    ns = nodes()
    routes = mesh.route_sources("10.0.0.12 via 192.168.1.1 dev eno1 src 192.168.1.5 uid 0 \\    cache \n")
    problems = mesh.check_files("h1", verified_files(ns), ns, "~/.ssh/mnft_mesh_ed25519", True, routes)
    assert problems == ["its routes reach h2 from 192.168.1.5, an address the mesh's from= does not list "
                        "(set 'iface' to the cluster interface in the inventory)"]
    assert mesh.check_files("h1", verified_files(ns, restrict_from=False), ns, "~/.ssh/mnft_mesh_ed25519", False, routes) == []


# ---------------------------------------------------------------------------------------------- hosts_file


NAMES = {"h1": "10.0.0.11", "h2": "10.0.0.12"}
DEBIAN = "127.0.0.1\tlocalhost\n127.0.1.1\th1.lab h1\n\n# The following lines are desirable for IPv6\n::1 localhost ip6-localhost\n"


def test_hosts_block_goes_before_a_loopback_line_naming_a_node():
    plan = hosts_file.plan_host(file(DEBIAN, 0o644), NAMES, "/etc/hosts")
    new = applied(DEBIAN, plan)
    assert new.startswith("127.0.0.1\tlocalhost\n# BEGIN mnft cluster hosts")
    assert "10.0.0.11\th1\n10.0.0.12\th2\n# END mnft cluster hosts\n127.0.1.1\th1.lab h1\n" in new
    assert blocks.remove_block(new, hosts_file.BLOCK) == DEBIAN
    assert any("127.0.1.1" in n for n in plan.notes)


def test_hosts_block_without_conflicts_is_appended_and_idempotent():
    text = "127.0.0.1 localhost\n10.9.9.9 nas  # by hand"
    new = applied(text, hosts_file.plan_host(file(text, 0o644), NAMES, "/etc/hosts"))
    assert new.startswith(text + "\n" + blocks.EOL_ADDED + "\n# BEGIN mnft")
    assert hosts_file.plan_host(file(new, 0o644), NAMES, "/etc/hosts").empty
    assert applied(new, hosts_file.plan_undo(file(new, 0o644), "/etc/hosts")) == text


# ---------------------------------------------------------------------------------------------- firewall


FW_PARAMS = {"allow_from": (), "open_ports": (), "manager": "auto", "revert_after": 30.0, "probe_timeout": 10.0}


def test_firewall_table_accepts_peers_and_ssh_and_drops_other_new_tcp():
    body = firewall.table_body("eth0", ["10.0.0.11", "10.0.0.12"], 22, (29500,), ("10.0.0.1/32",), (8888,))
    assert body == (
        "\tset peers {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.11, 10.0.0.12 }\n\t}\n\n"
        "\tchain input {\n\t\ttype filter hook input priority filter - 10; policy accept;\n"
        '\t\tiifname != "eth0" accept\n'
        "\t\tct state established,related accept\n"
        "\t\ttcp dport 22 accept\n"
        "\t\tip saddr @peers accept\n"
        "\t\tip saddr 10.0.0.1 tcp dport 29500 accept\n"  # as nft lists it: one element bare, /32 as the address
        "\t\ttcp dport 8888 accept\n"
        "\t\tmeta l4proto tcp ct state new drop\n"
        "\t}\n"
    )
    rules = firewall.ruleset(body)
    assert rules.startswith("table inet mnft\ndelete table inet mnft\ntable inet mnft {\n")  # one transaction
    assert f"sha256={firewall.digest(body)}" in rules


def test_firewall_is_ok_when_the_table_carries_the_same_digest():
    plan = firewall.plan_host({"table": None}, iface="eth0", peers=["10.0.0.11"], ssh_port=22, params=FW_PARAMS, rendezvous_ports=(29500,))
    assert plan.changes and plan.data["revert"] == firewall.DELETE
    listed = plan.data["rules"].split("delete table inet mnft\n", 1)[1]
    again = firewall.plan_host({"table": listed}, iface="eth0", peers=["10.0.0.11"], ssh_port=22, params=FW_PARAMS, rendezvous_ports=(29500,))
    assert again.empty
    flushed = listed.split("\t\tiifname")[0] + "\t}\n}\n"  # `nft flush chain inet mnft input`: same comment, no rules
    again = firewall.plan_host({"table": flushed}, iface="eth0", peers=["10.0.0.11"], ssh_port=22, params=FW_PARAMS, rendezvous_ports=(29500,))
    assert again.changes[0].startswith("re-apply")
    wrapped = listed.replace("10.0.0.11 }", "10.0.0.11,\n\t\t\t     10.0.0.12 }")  # nft wraps long element lists
    assert firewall.plan_host({"table": wrapped}, iface="eth0", peers=["10.0.0.11", "10.0.0.12"], ssh_port=22, params=FW_PARAMS,
                              rendezvous_ports=(29500,)).changes  # different digest
    moved = firewall.plan_host({"table": listed}, iface="eth0", peers=["10.0.0.11", "10.0.0.13"], ssh_port=22, params=FW_PARAMS, rendezvous_ports=(29500,))
    assert moved.changes[0].startswith("replace") and moved.data["revert"] == firewall.DELETE + listed


def test_firewall_refuses_when_ufw_manages_the_host_and_says_what_to_run():
    plan = firewall.plan_host({"table": None, "ufw": True}, iface="eth0", peers=["10.0.0.11"], ssh_port=22, params=FW_PARAMS, rendezvous_ports=(29500,))
    assert "ufw allow from 10.0.0.11" in plan.error and not plan.changes
    forced = firewall.plan_host({"table": None, "ufw": True}, iface="eth0", peers=["10.0.0.11"], ssh_port=22,
                                params={**FW_PARAMS, "manager": "nftables"}, rendezvous_ports=(29500,))
    assert forced.changes


def test_firewall_undo_deletes_only_its_table():
    assert firewall.plan_undo({"table": None}).empty
    plan = firewall.plan_undo({"table": "table inet mnft {\n}\n"})
    assert plan.ops == [{"op": "run", "argv": ["nft", "-f", "-"], "input": "table inet mnft\ndelete table inet mnft\n", "check": True}]


def test_probe_timeout_must_be_below_revert_after():
    assert "below revert_after" in firewall.validate({**FW_PARAMS, "probe_timeout": 30.0})


# ---------------------------------------------------------------------------------------------- reserved ports


def test_port_lists_parse_and_fold():
    assert reserved_ports.parse_ports("8080,29500-29502\n") == {8080, 29500, 29501, 29502}
    assert reserved_ports.render_ports({1, 2, 3, 7, 9, 10}) == "1-3,7,9-10"


def test_reserved_ports_keep_others_and_undo_removes_only_mnfts():
    facts = {"reserved": "8080\n", "range": "1024 65000\n", "record": None, "persisted": None}
    plan = reserved_ports.plan_host(facts, (29500,), persist=False)
    assert {"op": "sysctl", "path": reserved_ports.SYSCTL, "value": "8080,29500"} in plan.ops
    after = {"reserved": "8080,29500\n", "range": "1024 65000\n", "record": "29500\n", "persisted": None}
    assert reserved_ports.plan_host(after, (29500,), persist=False).empty
    undo = reserved_ports.plan_undo(after)
    assert {"op": "sysctl", "path": reserved_ports.SYSCTL, "value": "8080"} in undo.ops


def test_a_port_reserved_before_mnft_is_not_unreserved():
    facts = {"reserved": "29500\n", "range": "1024 65000\n", "record": None, "persisted": None}
    assert reserved_ports.plan_host(facts, (29500,), persist=False).empty
    assert reserved_ports.plan_undo(facts).empty


def test_reserved_ports_touch_etc_only_when_persist_is_asked_for():
    assert reserved_ports.PARAMS["persist"].default is False
    facts = {"reserved": "8080\n", "range": "1024 65000\n", "record": None, "persisted": None}
    assert not any(op.get("path") == reserved_ports.PERSIST for op in reserved_ports.plan_host(facts, (29500,), persist=False).ops)
    plan = reserved_ports.plan_host(facts, (29500,), persist=True)
    persisted = next(op["text"] for op in plan.ops if op.get("path") == reserved_ports.PERSIST)
    assert "# ports added by mnft: 29500\n" in persisted and "ip_local_reserved_ports = 8080,29500\n" in persisted


def test_after_a_reboot_undo_takes_mnfts_ports_from_the_persisted_file():
    persisted = reserved_ports.persisted_text({8080, 29500}, {29500})
    rebooted = {"reserved": "8080,29500\n", "range": "1024 65000\n", "record": None, "persisted": persisted}  # no /run record
    assert reserved_ports.plan_host(rebooted, (29500,), persist=True).empty
    undo = reserved_ports.plan_undo(rebooted)
    assert {"op": "sysctl", "path": reserved_ports.SYSCTL, "value": "8080"} in undo.ops
    assert {"op": "remove", "path": reserved_ports.PERSIST} in undo.ops


# ---------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("kind,value", [("port", 0), ("port", "22"), ("bool", "yes"), ("number", -1), ("str", "a\nb"), ("cidrs", ["10.0.0.0/33"])])
def test_parameter_types_are_strict(kind, value):
    with pytest.raises(ValueError):
        check_value(Param(kind, None, ""), value)


# ---------------------------------------------------------------------------------------------- the armed revert (host side)


FAKE_NFT = """#!/bin/sh
dir=$(dirname "$0")
case "$1" in -c) exit 0;; esac
case "$2" in *.apply.nft) echo applied >> "$dir/log"; exit 0;; esac
touch "$dir/reverting"
while [ ! -e "$dir/release" ]; do sleep 0.02; done
echo reverted >> "$dir/log"
"""


@pytest.fixture
def fake_nft(tmp_path, monkeypatch):
    from mnft.onhost import setuphost

    monkeypatch.setattr(setuphost, "STATE_DIR", str(tmp_path / "state"))
    nft = tmp_path / "nft"
    nft.write_text(FAKE_NFT)
    nft.chmod(0o755)
    return nft


def _wait_for(path, what: str) -> None:
    import time

    for _ in range(3000):  # a bound so a broken sleeper fails the test instead of hanging it; not a timing assertion
        if path.exists():
            return
        time.sleep(0.01)
    pytest.fail(f"{what} never happened")


def test_a_cancel_that_comes_while_the_revert_runs_reports_reverted_not_cancelled(fake_nft, tmp_path):
    import threading

    from mnft.onhost import setuphost

    armed = setuphost.op_nft_guarded({"rules": "rules\n", "revert": "revert\n", "delay": 0, "nft": str(fake_nft)})
    _wait_for(tmp_path / "reverting", "the revert")  # the sleeper holds the lock and runs `nft -f <revert>`
    got = {}
    cancel = threading.Thread(target=lambda: got.update(setuphost.op_cancel_revert({"pid": armed["pid"], "token": armed["token"]})))
    cancel.start()
    (tmp_path / "release").touch()
    cancel.join(timeout=120)
    assert got == {"cancelled": False}  # the late probe's cancel must not claim the rules it checked are in place
    assert (tmp_path / "log").read_text() == "applied\nreverted\n"
    assert setuphost.op_wait_gone({"pid": armed["pid"], "token": armed["token"], "timeout": 60}) == {"gone": True}


def test_a_cancel_before_the_delay_disarms_the_revert_for_good(fake_nft, tmp_path):
    from mnft.onhost import setuphost

    armed = setuphost.op_nft_guarded({"rules": "rules\n", "revert": "revert\n", "delay": 600, "nft": str(fake_nft)})
    assert setuphost.op_cancel_revert({"pid": armed["pid"], "token": armed["token"]}) == {"cancelled": True}
    assert setuphost.op_wait_gone({"pid": armed["pid"], "token": armed["token"], "timeout": 60}) == {"gone": True}
    assert (tmp_path / "log").read_text() == "applied\n"
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == []
    assert setuphost.op_cancel_revert({"pid": armed["pid"], "token": armed["token"]}) == {"cancelled": False}


def test_the_host_script_refuses_to_edit_a_file_past_the_limit_naming_it(tmp_path):
    """A host file setup edits (authorized_keys, known_hosts, ~/.ssh/config, /etc/hosts) is read to at most
    HOST_FILE_BYTES on the host: a larger one is that host's error naming it, never a controller out of memory."""
    import json
    import subprocess
    import sys

    from mnft.core import limits
    from mnft.onhost import setuphost

    assert setuphost.MAX_READ_BYTES == limits.HOST_FILE_BYTES  # the host script cannot import mnft: one value, two places
    big, small = tmp_path / "authorized_keys", tmp_path / "config"
    with open(big, "wb") as f:
        f.truncate(limits.HOST_FILE_BYTES + 1)
    small.write_text("Host *\n")
    sysctl = "/proc/sys/net/ipv4/ip_local_port_range"  # the kernel refuses one large read of it (ENOMEM): chunks
    request = {"ops": [{"op": "read", "path": str(small)}, {"op": "read", "path": sysctl}, {"op": "read", "path": str(big)}]}
    from mnft.hosts import pyrun

    done = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP], input=pyrun.payload("setuphost") + (json.dumps(request) + "\n").encode(),
                          capture_output=True, timeout=30)
    [ok, proc, refused] = json.loads(done.stdout.decode())["results"]
    assert ok["text"] == "Host *\n" and proc["text"] == open(sysctl).read()
    assert refused == {"error": f"{big} is larger than 4 MiB: mnft edits files up to that size (trim it, or edit it by hand)"}


# ------------------------------------------------------------------------------------------------ kernel_log


def _kernel_facts(**given) -> dict:
    facts = {"restrict": "1", "reader_sha": None, "sudoers_sha": None, "python": True, "sudo": True, "checking": False, "driver": True,
             "unsafe": None}
    facts.update(given)
    return facts


def test_kernel_log_installs_the_reader_and_a_sudoers_rule_checked_by_visudo_before_it_is_put_in_place():
    plan = kernel_log.plan_host(_kernel_facts(), "ALL")
    assert [op.get("path") or op["argv"][0] for op in plan.ops] == [
        kernel_log.READER, kernel_log.CHECKING, kernel_log.VISUDO, kernel_log.SUDOERS, kernel_log.CHECKING]
    reader, checking, visudo, sudoers, _ = plan.ops
    assert reader["text"].startswith("#!/usr/bin/python3 -I\n") and reader["mode"] == 0o755 and reader["expect_sha256"] is None
    assert visudo == {"op": "run", "argv": [kernel_log.VISUDO, "-cf", kernel_log.CHECKING], "check": True}
    assert "." in kernel_log.CHECKING.rsplit("/", 1)[1]  # sudo never reads a sudoers.d file whose name has a dot
    assert checking["text"] == sudoers["text"] and sudoers["mode"] == 0o440
    assert sudoers["text"].splitlines()[-1] == f'ALL ALL=(root) NOPASSWD: {kernel_log.READER} ""'  # "": no arguments allowed
    assert sudoers["text"].splitlines()[-2] == f"Defaults!{kernel_log.READER} !syslog, !pam_session, !requiretty"
    assert plan.notes == [f"the lab's members read the driver's Xid lines through mnft's reader ({kernel_log.READER}, run by sudo: {kernel_log.SUDOERS})"]
    group = kernel_log.plan_host(_kernel_facts(), "%lab").ops[3]["text"]
    assert group.splitlines()[-1].startswith("%lab ALL=(root) NOPASSWD:")


def test_kernel_log_says_what_it_chose_and_changes_nothing_where_nothing_is_needed():
    import hashlib

    def sha(text):
        return hashlib.sha256(text.encode()).hexdigest()

    done = kernel_log.plan_host(_kernel_facts(reader_sha=sha(kernel_log.reader_text()), sudoers_sha=sha(kernel_log.sudoers_text("ALL"))), "ALL")
    assert done.empty and "through mnft's reader" in done.notes[0]
    open_log = kernel_log.plan_host(_kernel_facts(restrict="0"), "ALL")
    assert open_log.empty and open_log.notes == ["the kernel log is readable by every user (kernel.dmesg_restrict=0): nothing installed"]
    no_gpu = kernel_log.plan_host(_kernel_facts(driver=False), "ALL")
    assert no_gpu.empty and no_gpu.notes == ["no NVIDIA driver: no Xid lines to read, nothing installed"]
    assert kernel_log.plan_host(_kernel_facts(sudo=False), "ALL").error.startswith("sudo is not installed (/usr/bin/sudo): install it")
    assert kernel_log.plan_host(_kernel_facts(python=False), "ALL").error.startswith("/usr/bin/python3 is not there or not root's")
    assert kernel_log.validate({"users": "ALL, evil ALL=(ALL) ALL"}).startswith("key 'users'")
    staff = kernel_log.plan_host(_kernel_facts(unsafe="/usr/local"), "ALL")
    assert staff.error.startswith("/usr/local is not root's alone") and not staff.ops
    assert kernel_log._unsafe({"exists": True, "uid": 0, "mode": 0o2775}, False)  # Debian's old root:staff 2775
    assert not kernel_log._unsafe({"exists": True, "uid": 0, "mode": 0o777, "is_link": True}, False)  # a root's link: its target is checked
    assert kernel_log._unsafe({"exists": True, "uid": 0, "mode": 0o777, "is_link": True}, True)  # the reader never a link
    assert kernel_log._unsafe({"exists": True, "uid": 1000, "mode": 0o755}, False) and not kernel_log._unsafe({"exists": False}, False)
    assert kernel_log.validate({"users": "%lab"}) is None


def test_kernel_log_undo_removes_the_rule_then_the_reader_and_keeps_what_someone_changed():
    import hashlib

    rule = hashlib.sha256(kernel_log.sudoers_text("ALL").encode()).hexdigest()
    undo = kernel_log.plan_undo(_kernel_facts(reader_sha="edited", sudoers_sha=rule, checking=True), "ALL")
    assert undo.ops == [{"op": "remove", "path": kernel_log.SUDOERS, "expect_sha256": rule}, {"op": "remove", "path": kernel_log.CHECKING}]
    assert undo.notes == [f"{kernel_log.READER} is not what mnft writes (changed by someone, or another version's): kept"]
    reader = hashlib.sha256(kernel_log.reader_text().encode()).hexdigest()
    other = kernel_log.plan_undo(_kernel_facts(reader_sha=reader, sudoers_sha=rule), "%lab")  # undone with another users: than set up
    assert other.ops == []  # the rule stays (not what this undo would write), so the file it names stays too
    assert other.notes[1] == f"{kernel_log.READER} kept: the sudo rule beside it names it"


# ------------------------------------------------------------------------------------------------ admin_group


def _admin_facts(text=None, *, exists=True, root_only=True) -> dict:
    return {"text": text, "sha": None if text is None else "sha-of-it", "root_only": root_only, "group_exists": exists}


def test_admin_group_writes_the_group_root_only_and_says_which_group_each_host_names_when_none_is_given():
    plan = admin_group.plan_host(_admin_facts(), "labops")
    assert plan.changes == ["name group labops the admins in /etc/mnft/admin-group"]
    op, admit = plan.ops
    assert (op["path"], op["mode"], op["expect_sha256"]) == ("/etc/mnft/admin-group", 0o644, None)
    assert admit == {"op": "fit_drain", "was": None}  # a drain file root wrote before the group was named: the admins' too
    assert admin_group.named(op["text"]) == "labops" and op["text"].startswith(admin_group.MARK)
    assert admin_group.plan_host(_admin_facts(op["text"]), "labops").empty
    moved = admin_group.plan_host(_admin_facts(admin_group.file_text("ops")), "labops")
    assert moved.changes == ["name group labops the admins in /etc/mnft/admin-group (was ops)"]
    assert admin_group.plan_host(_admin_facts(), None).notes == ["the admins are root only (/etc/mnft/admin-group names no group)"]
    assert admin_group.plan_host(_admin_facts(admin_group.file_text("ops")), None).notes == ["the admins are root and group ops (/etc/mnft/admin-group)"]


def test_admin_group_refuses_a_group_the_host_lacks_and_a_file_someone_else_wrote():
    assert admin_group.plan_host(_admin_facts(exists=False), "labops").error.startswith("group labops does not exist on this host: create it (groupadd labops)")
    theirs = admin_group.plan_host(_admin_facts("wheel\n"), "labops")
    assert theirs.error.startswith("/etc/mnft/admin-group was not written by mnft (it names wheel)") and not theirs.ops
    assert admin_group.validate({"group": "x y"}).startswith("key 'group'") and admin_group.validate({"group": None}) is None
    assert admin_group.plan_undo(_admin_facts("wheel\n")).notes == ["/etc/mnft/admin-group was not written by mnft: kept"]
    undo = admin_group.plan_undo(_admin_facts(admin_group.file_text("labops")))
    assert undo.ops == [{"op": "remove", "path": "/etc/mnft/admin-group", "expect_sha256": "sha-of-it"}, {"op": "fit_drain", "was": "labops"}]
