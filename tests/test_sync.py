"""Sync, without a cluster: exclude rules, the local tree hash, target refusals, and planning with data
(trees in, exact rsync argv out). Nothing here reads the developer's home or ~/.ssh."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mnft.core.errors import ExitCode, InputError
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.inventory import parse
from mnft.sync import gitignore, mirror, rsync, source, targets

from mnft.onhost import treehash
KNOWN = ("/etc/ssh/ssh_known_hosts", "/ctl/.ssh/known_hosts", "/ctl/lab kh", "/ctl/.mnft/known_hosts")
SSH = rsync.SshSettings(KNOWN)
RULES_FILE = "/tmp/mnft-sync-x/excludes"
INJECTION = ["; rm -rf ~", "$(id)", "`id`", "a\nb", "it's", 'say "hi"', "sp ace", "-rf", "*", "a|b&c>d"]


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MNFT_HOME", str(home / ".mnft"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return home


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def inventory(text: str):
    return parse(text)


def one_host(**settings):
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in settings.items())
    return inventory(f"hosts:\n  h1: {{{body}}}\n").hosts[0]


# ------------------------------------------------------------------------------------------------ rules


@pytest.mark.parametrize(
    "pattern, path, is_dir, excluded",
    [
        ("__pycache__", "a/b/__pycache__", True, True),
        ("*.pyc", "a/b.pyc", False, True),
        ("*.pyc", "a/b.pyc/c", False, False),
        ("runs/", "runs", True, True),
        ("runs/", "runs", False, False),  # a file named runs is code
        ("runs/", "x/runs", True, True),
        ("/top", "top", False, True),
        ("/top", "x/top", False, False),
        ("a/b", "x/a/b", False, True),
        ("a/b", "xa/b", False, False),
        ("**/gen", "x/y/gen", True, True),
        ("*.egg-info", "mnft.egg-info", True, True),
        ("/lit\\[1\\].txt", "lit[1].txt", False, True),
        ("/back\\slash", "back\\slash", False, True),  # no wildcard: the backslash is literal, like rsync
    ],
)
def test_rules_follow_rsync_pattern_semantics(pattern, path, is_dir, excluded):
    assert treehash.Rules([pattern]).excluded(path, is_dir) is excluded


@pytest.mark.parametrize("name", ["plain.txt", "a[1].txt", "star*.txt", "q?.txt", "back\\slash*.txt", "sp ace/x"])
def test_escaped_literal_matches_exactly_that_path(name):
    rules = treehash.Rules([treehash.escape_literal(name)])
    assert rules.excluded(name, False)
    assert not rules.excluded(name + "x", False)
    assert not rules.excluded("sub/" + name, False)


def git_repo(root: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_git_decides_ignored_files_including_nested_gitignore_and_negation(tmp_path):
    src = git_repo(write(tmp_path / "src", {
        ".gitignore": "*.log\n!keep.log\nbuild/\ndocs/*.tmp\n",
        "pkg/.gitignore": "secret.txt\n",
        "pkg/code.py": "x", "pkg/secret.txt": "s", "pkg/sub/secret.txt": "s2",
        "a.log": "l", "keep.log": "k", "build/out.bin": "b", "docs/x.tmp": "t", "deep/docs/x.tmp": "kept",
        "runs/r1/log.txt": "r", "mod/__pycache__/m.cpython-311.pyc": "c", ".venv/bin/python": "p",
    }))
    rules, how = source.exclude_rules(src)
    assert how == "git"
    _, files = source.tree_hash(src, rules)
    # `docs/*.tmp` has a middle slash: git anchors it to the .gitignore's directory (rsync's parser would not)
    assert sorted(files) == [".gitignore", "deep/docs/x.tmp", "keep.log", "pkg/.gitignore", "pkg/code.py"]
    # the patterns themselves are the rules (first match wins, so git's last line comes first): a host's own
    # logs and builds are judged by them too
    assert rules[-4:] == ("/docs/*.tmp", "build/", "+ keep.log", "*.log")
    assert "/pkg/secret.txt" in rules and "/pkg/**/secret.txt" in rules


IGNORE_CORPUS = {
    ".gitignore": "*.log\n!keep.log\ncheckpoints/\n/top.txt\ndocs/*.tmp\na/**/z.bin\n**/gen/\nnotes/**\n\\#hash.txt\nsp\\ ace.txt\\ \n# comment\n\nlit[[]1].txt\nvendor\n!vendor/keep\n",
    "pkg/.gitignore": "secret.txt\n!important.log\n/only-here.txt\ndeep/*.cfg\n",
    "pkg/sub/.gitignore": "*.cfg\n!shipped.cfg\n",
}
CANDIDATES = [
    "x.log", "keep.log", "d/x.log", "d/keep.log", "checkpoints/step100.pt", "d/checkpoints/s.pt", "checkpoints.txt",
    "top.txt", "d/top.txt", "docs/a.tmp", "d/docs/a.tmp", "docs/d/a.tmp", "a/z.bin", "a/b/c/z.bin", "b/a/z.bin",
    "gen/out.c", "x/y/gen/out.c", "gen.c", "notes/n.md", "notes/d/n.md", "#hash.txt", "sp ace.txt ", "sp ace.txt",
    "lit[1].txt", "lit1.txt", "vendor/keep", "vendor/lib.py", "pkg/secret.txt", "pkg/q/secret.txt", "secret.txt",
    "pkg/important.log", "pkg/x/important.log", "important.log", "pkg/only-here.txt", "pkg/q/only-here.txt",
    "only-here.txt", "pkg/deep/a.cfg", "pkg/deep/q/a.cfg", "pkg/sub/a.cfg", "pkg/sub/shipped.cfg", "pkg/sub/q/b.cfg",
    "pkg/code.py", "code.py",
]


def test_translated_ignore_patterns_alone_decide_like_git(tmp_path):
    """The rules that judge a host's own files (which git never sees) must agree with git on every path."""
    src = git_repo(write(tmp_path / "src", {**IGNORE_CORPUS, **{rel: rel for rel in CANDIDATES}}))
    shipped = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=src, capture_output=True, check=True).stdout
    by_git = sorted(os.fsdecode(p) for p in shipped.split(b"\0") if p)
    _, _, patterns, _ = gitignore.git_view(src)
    assert sorted(source.tree_hash(src, (".git", *patterns))[1]) == by_git
    assert "x.log" not in by_git and "keep.log" in by_git and "pkg/important.log" in by_git  # the corpus bites


def test_rsync_and_the_hash_apply_the_translated_rules_alike(tmp_path):
    """Host-only files: rsync --delete removes exactly those the hash counts, and keeps those it leaves out."""
    src = git_repo(write(tmp_path / "src", {**IGNORE_CORPUS, "code.py": "c"}))
    rules, _ = source.exclude_rules(src)
    dst = write(tmp_path / "dst", {rel: "host only" for rel in CANDIDATES})
    counted = set(source.tree_hash(dst, rules)[1]) - {"code.py"}
    rules_file = tmp_path / "rules"
    rules_file.write_bytes(rsync.rules_file_bytes(rules))
    subprocess.run(["rsync", "-a", "--delete", "--from0", f"--filter=merge {rules_file}", f"{src}/", f"{dst}/"], check=True)
    survivors = {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()}
    assert survivors == {rel for rel in CANDIDATES if rel not in counted} | set(IGNORE_CORPUS) | {"code.py"}
    assert source.tree_hash(dst, rules) == source.tree_hash(src, rules)


def test_a_tracked_file_that_matches_an_ignore_pattern_is_still_shipped(tmp_path):
    src = git_repo(write(tmp_path / "src", {".gitignore": "*.log\nbuild/\n", "fixture.log": "tracked", "build/keep.txt": "k", "a.py": "a"}))
    subprocess.run(["git", "add", "-f", "fixture.log", "build/keep.txt"], cwd=src, check=True)
    (src / "build" / "junk.o").write_text("j")
    (src / "other.log").write_text("o")
    rules, _ = source.exclude_rules(src)
    assert sorted(source.tree_hash(src, rules)[1]) == [".gitignore", "a.py", "build/keep.txt", "fixture.log"]
    assert "+ /fixture.log" in rules and "+ /build/" in rules


def test_gitignore_applies_to_a_tree_outside_any_repository(tmp_path):
    src = write(tmp_path / "plain", {".gitignore": "*.ckpt\n", "train.py": "x", "big.ckpt": "w"})
    rules, how = source.exclude_rules(src)
    assert how == "git (no repository)"
    assert sorted(source.tree_hash(src, rules)[1]) == [".gitignore", "train.py"]


def test_extra_excludes_are_added_and_checked(tmp_path):
    src = git_repo(write(tmp_path / "src", {"a.py": "x", "notes/n.md": "n"}))
    rules, _ = source.exclude_rules(src, ["notes/"])
    assert sorted(source.tree_hash(src, rules)[1]) == ["a.py"]
    with pytest.raises(InputError):
        source.exclude_rules(src, ["bad\npattern"])


# ------------------------------------------------------------------------------------------------ tree hash


def test_tree_hash_is_paths_sizes_and_content(tmp_path):
    a = write(tmp_path / "a", {"x.py": "one", "d/y.py": "two"})
    b = write(tmp_path / "b", {"d/y.py": "two", "x.py": "one"})
    da, fa = source.tree_hash(a, ())
    db, fb = source.tree_hash(b, ())
    assert da == db and fa == fb
    assert fa["x.py"][0] == 3 and len(fa["x.py"][1]) == 64
    (b / "x.py").write_text("uno")  # same size, other content
    assert source.tree_hash(b, ())[0] != da
    os.rename(b / "x.py", b / "z.py")
    assert source.tree_hash(b, ())[0] != da


def test_tree_hash_counts_symlinks_as_links_and_skips_excluded_dirs(tmp_path):
    root = write(tmp_path / "t", {"real.py": "r", "runs/out.txt": "o"})
    os.symlink("real.py", root / "link.py")
    os.symlink("/nonexistent/dir", root / "dangling")
    _, files = source.tree_hash(root, source.ALWAYS_EXCLUDES)
    assert sorted(files) == ["dangling", "link.py", "real.py"]
    assert files["link.py"][0] == len("real.py")


def test_cache_does_not_hide_a_modification(tmp_path):
    root = write(tmp_path / "t", {"x.py": "aaaa"})
    cache = str(tmp_path / "cache.json")
    first = treehash.tree_hash(root, (), cache)
    assert json.loads(Path(cache).read_text())["files"]["x.py"][4] == first[1]["x.py"][1]
    st = os.stat(root / "x.py")
    (root / "x.py").write_text("bbbb")
    os.utime(root / "x.py", ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only ctime tells
    assert treehash.tree_hash(root, (), cache)[0] != first[0]


def treehash_on_host(*argv: str, stdin: str) -> dict:
    """The tree-hash entry as a host runs it: its payload, then the rules, on stdin."""
    from mnft.hosts import pyrun

    done = subprocess.run([os.sys.executable, "-c", pyrun.BOOTSTRAP, *argv], input=pyrun.payload("treehash") + stdin.encode(),
                          capture_output=True, check=True)
    return json.loads(done.stdout.decode())


def test_treehash_script_reads_rules_from_stdin_and_reports_home(tmp_path):
    root = write(tmp_path / "t", {"x.py": "x", "y.pyc": "y"})
    stdin = json.dumps(["*.pyc"]) + "\n"
    data = treehash_on_host(str(root), "--cache", str(tmp_path / "c.json"), stdin=stdin)
    assert data["exists"] and list(data["files"]) == ["x.py"]
    assert data["home"] == os.path.realpath(os.environ["HOME"])
    assert data["rsync"] == "" and data["refused"] is None  # not asked: no rsync check
    wants = treehash_on_host(str(root), "--expect", "0" * 64, stdin=stdin)
    assert wants["rsync"] and wants["rsync"][0].isdigit()  # differs from what the controller expects: rsync will run
    same = treehash_on_host(str(root), "--expect", data["digest"], stdin=stdin)
    assert same["rsync"] == "" and same["files"] is None  # identical: no rsync will run, no list is needed
    missing = treehash_on_host(str(tmp_path / "nope"), "--if-exists", stdin="[]\n")
    assert missing["exists"] is False and missing["files"] is None


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("target", ["", "  ", "/", "//", "/./", "~", "~/", "~/.", "~/x/..", "~/../other", "/root", "/home/alice",
                                    "/home/alice/", "/Users/bob", "/etc", "/usr", "mnft", "./mnft", "~bob/mnft", "~/a\nb"])
def test_dangerous_targets_are_refused(target):
    assert targets.target_problem(target) is not None


@pytest.mark.parametrize("target", ["~/mnft", "~/.cache/mnft/work", "/data/mnft", "/home/alice/mnft", "/srv/lab/mnft", "~/with space/$(id)"])
def test_own_directories_are_accepted(target):
    assert targets.target_problem(target) is None


class ExplodingFleet:
    def __getattr__(self, name):
        raise AssertionError("a host was touched before the pre-flight finished")


def test_preflight_refuses_before_any_host_is_touched(tmp_path):
    src = write(tmp_path / "src", {"a.py": "x"})
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2, workdir: '~/'}\n  h3: {address: 10.0.0.3, workdir: /}\n")
    with pytest.raises(InputError) as exc:
        mirror.sync_code(inv, src, fleet=ExplodingFleet(), progress=False)
    assert exc.value.exit_code == ExitCode.BAD_INPUT
    assert "'h2'" in str(exc.value) and "'h3'" in str(exc.value) and "'h1'" not in str(exc.value)


def test_preflight_refuses_overlapping_workdir_and_data_dir_and_a_missing_source(tmp_path):
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1, workdir: ~/mnft, data_dir: ~/mnft/data}\n")
    with pytest.raises(InputError, match="overlap"):
        targets.preflight(inv, tmp_path)
    with pytest.raises(InputError, match="not a directory"):
        targets.preflight(inventory("hosts:\n  h1: {address: 10.0.0.1}\n"), tmp_path / "missing")


def test_local_target_inside_the_source_is_refused(tmp_path):
    src = write(tmp_path / "src", {"a.py": "x"})
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: {src / 'copy'}}}\n")
    with pytest.raises(InputError, match="overlap"):
        targets.preflight(inv, src)


@pytest.mark.parametrize("link_to, why", [("/", "resolves to /"), ("HOME", "home directory"), ("HOME/..", "contains the home"),
                                          ("/etc", "system directory /etc"), ("/usr/share", "inside the system directory /usr"),
                                          ("HOME/.ssh", "inside"), ("/var", "system directory /var")])
def test_the_probe_refuses_a_dangerous_real_target_before_walking_anything(link_to, why, private_home, tmp_path, monkeypatch):
    (private_home / ".ssh").mkdir(exist_ok=True)
    workdir = tmp_path / "workdir"
    os.symlink(link_to.replace("HOME", str(private_home)), workdir)
    monkeypatch.setattr(treehash, "tree_hash", lambda *a, **k: pytest.fail("the probe walked a refused target"))
    out = treehash.report(str(workdir), [])
    assert why in out["refused"] and out["files"] is None
    tree = mirror.RemoteTree.from_json(out)
    assert why in targets.remote_refusal(tree.root, tree.home, tree.refused)


def test_the_probe_refuses_a_workdir_that_overlaps_the_data_dir_by_real_path(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "work")  # different names, one directory
    assert "overlap" in treehash.report(str(tmp_path / "work"), [], other=str(tmp_path / "data"))["refused"]
    assert "overlap" in treehash.report(str(tmp_path / "data" / "sub"), [], other=str(tmp_path / "data"))["refused"]
    assert treehash.report(str(tmp_path / "elsewhere"), [], other=str(tmp_path / "data"), if_exists=True)["refused"] is None


def test_a_refusal_found_on_a_host_is_bad_input_like_one_found_before(tmp_path, private_home):
    src = write(tmp_path / "src", {"a.py": "a"})
    os.symlink(private_home, tmp_path / "link")
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{tmp_path}/link', data_dir: '{tmp_path}/d'}}\n")
    report = mirror.sync_code(inv, src, progress=False)
    assert report.hosts["me"].status == "refused" and "home directory" in report.hosts["me"].error
    assert report.exit_code() == ExitCode.BAD_INPUT
    assert not (private_home / "a.py").exists()  # nothing landed in the home


@pytest.mark.parametrize(
    "root, home, refused",
    [("/", "/root", True), ("/root", "/root", True), ("/home", "/home/al", True), ("/root/mnft", "/root", False), ("/data/x", "/root", False)],
)
def test_host_side_refusal_uses_real_paths(root, home, refused):
    assert (targets.remote_refusal(root, home) is not None) is refused


# ------------------------------------------------------------------------------------------------ rendering


def test_ssh_command_verifies_host_keys_like_mnft():
    host = one_host(address="10.0.0.1", port=2222, user="lab", identity="/keys/id ed")
    assert rsync.ssh_command(host, SSH) == (
        "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes "
        "-o 'UserKnownHostsFile=/etc/ssh/ssh_known_hosts /ctl/.ssh/known_hosts \"/ctl/lab kh\" /ctl/.mnft/known_hosts' "
        "-o GlobalKnownHostsFile=/etc/ssh/ssh_known_hosts -o VerifyHostKeyDNS=no -o KnownHostsCommand=none "
        "-o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4 "
        "-p 2222 -l lab -i '/keys/id ed' -o IdentitiesOnly=yes"
    )


def test_ssh_paths_keep_a_literal_percent_and_old_openssh_gets_no_knownhostscommand():
    host = one_host(address="10.0.0.1", identity="/keys/100%id")
    command = rsync.ssh_command(host, rsync.SshSettings(("/kh/50%known",), clear_known_hosts_command=False))
    assert "-o UserKnownHostsFile=/kh/50%%known " in command and "-i /keys/100%%id " in command
    assert "KnownHostsCommand" not in command and "-o VerifyHostKeyDNS=no" in command


def test_the_rendered_ssh_options_are_what_openssh_applies_over_a_hostile_ssh_config(tmp_path):
    """~/.ssh/config may not re-enable DNS keys, add a KnownHostsCommand or lose a `%` in mnft's paths."""
    import shlex

    config = tmp_path / "config"
    config.write_text("Host *\n  VerifyHostKeyDNS yes\n  KnownHostsCommand /bin/echo trust-me\n  StrictHostKeyChecking no\n")
    settings = rsync.SshSettings((str(tmp_path / "k%h"),), clear_known_hosts_command=rsync.ssh_accepts("KnownHostsCommand=none"))
    words = shlex.split(rsync.ssh_command(one_host(address="10.0.0.1"), settings))
    shown = subprocess.run([words[0], "-G", "-F", str(config), *words[1:], "10.0.0.1"], capture_output=True, text=True, check=True).stdout
    assert "verifyhostkeydns false" in shown and "stricthostkeychecking true" in shown
    assert f"userknownhostsfile {tmp_path}/k%h" in shown
    if settings.clear_known_hosts_command:
        assert "knownhostscommand" not in shown


def test_ssh_command_leaves_port_and_key_to_ssh_config_and_logs_in_as_fabric_does(tmp_path, monkeypatch):
    """The login, unset in the inventory, is the one Fabric dials (~/.ssh/config's User, else the controller's login
    as getpass reads it): OpenSSH's own default is the local uid's name, and rsync then wrote into another user's home
    (a second member's sync "differed after the sync", her wheels went to /root/mnft-env.d)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LOGNAME", "ann")
    host = one_host(address="gpu1")
    command = rsync.ssh_command(host, rsync.SshSettings(("/k",)))
    assert command.endswith("-o ServerAliveCountMax=4 -l ann")
    assert " -p " not in command and " -i " not in command
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host gpu1\n  User ann_lab\n")
    assert rsync.ssh_command(host, rsync.SshSettings(("/k",))).endswith(" -l ann_lab")


def test_ssh_command_refuses_known_hosts_paths_it_cannot_quote():
    with pytest.raises(InputError):
        rsync.ssh_command(one_host(address="a"), rsync.SshSettings(('/x"y',)))


def test_rsync_argv_is_exact():
    host = one_host(address="10.0.0.1", user="root", port=22)
    assert rsync.rsync_argv(host, Path("/repo"), "~/mnft", RULES_FILE, rsync.SshSettings(("/k",))) == (
        "rsync", "-a", "-s", "--mkpath", "--from0", f"--filter=merge {RULES_FILE}", "--timeout=120", "--stats",
        "--out-format=%i %l %n", "--delete",
        "-e", "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=/k "
              "-o GlobalKnownHostsFile=/etc/ssh/ssh_known_hosts -o VerifyHostKeyDNS=no -o KnownHostsCommand=none "
              "-o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4 -p 22 -l root",
        "/repo/", "10.0.0.1:mnft/",
    )


def test_local_host_gets_a_local_rsync_without_ssh(private_home):
    host = inventory("hosts:\n  me: {connection: local, workdir: ~/.cache/mnft/work}\n").hosts[0]
    argv = rsync.rsync_argv(host, Path("/repo"), host.workdir, RULES_FILE, SSH, delete=False)
    assert "-e" not in argv and "--delete" not in argv
    assert argv[-2:] == ("/repo/", f"{private_home}/.cache/mnft/work/")


@pytest.mark.parametrize("payload", INJECTION)
def test_metacharacters_in_paths_stay_one_argument(payload):
    if "\n" in payload:
        return  # refused as a target (control character): covered above
    host = one_host(address="10.0.0.1")
    target = f"/data/{payload}/w"
    argv = rsync.rsync_argv(host, Path(f"/src/{payload}"), target, RULES_FILE, SSH)
    assert argv[-2] == f"/src/{payload}/"
    assert argv[-1] == f"10.0.0.1:/data/{payload}/w/"
    assert "-s" in argv  # the remote path reaches rsync through the protocol, never a shell


def test_remote_spec_brackets_ipv6_and_keeps_absolute_paths():
    assert rsync.remote_spec(one_host(address="fe80::1"), "/w") == "[fe80::1]:/w/"
    assert rsync.remote_spec(one_host(address="h"), "~/a//b/") == "h:a/b/"


def test_rules_file_is_nul_separated_so_any_path_fits():
    assert rsync.rules_file_bytes(["runs/", "/a\nb", "+ /keep.log"]) == b"- runs/\0- /a\nb\0+ /keep.log\0"


# ------------------------------------------------------------------------------------------------ planning


def local_tree(files: dict[str, tuple[int, str]]) -> source.LocalTree:
    return source.LocalTree(Path("/repo"), ("runs/",), treehash.digest_of(files), files, "git")


def read_ok(name: str, files: dict | None, root: str = "/root/mnft", home: str = "/root", placed: dict | None = None) -> tuple[HostResult, mirror.RemoteTree]:
    """A host's tree as its hash read it; placed: the record of what mnft placed there (None: none)."""
    exists = files is not None
    tree = mirror.RemoteTree(root, home, exists, treehash.digest_of(files) if exists else None, files or {}, placed=placed)
    return HostResult(name, Status.OK), tree


FOUR = "hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n  h3: {address: 10.0.0.3}\n  h4: {address: 10.0.0.4}\n"


def test_plan_from_data():
    files = {"a.py": (1, "a" * 64), "b.py": (2, "b" * 64)}
    local = local_tree(files)
    was = {"a.py": (1, "a" * 64), "b.py": (2, "c" * 64), "old.py": (3, "d" * 64)}  # what mnft placed last time
    remote = {
        "h1": read_ok("h1", dict(files), placed=dict(files)),  # identical, and recorded: nothing to do
        "h2": read_ok("h2", None),  # no workdir yet
        "h3": read_ok("h3", dict(was), placed=dict(was)),  # the last sync's tree, as mnft left it
        "h4": (HostResult("h4", Status.UNREACHABLE, error="connection refused by 10.0.0.4"), None),
    }
    plans = {p.host: p for p in mirror.plan(inventory(FOUR), local, remote, kind="code", rules_file=RULES_FILE, ssh=SSH)}
    assert plans["h1"].action == "none" and plans["h1"].argv == ()
    assert plans["h2"].action == "rsync" and plans["h2"].difference.send == ("a.py", "b.py") and plans["h2"].bytes_to_send == 3
    assert plans["h2"].argv[-1] == "10.0.0.2:mnft/"
    # b.py is replaced (mnft's, unchanged); old.py, which the source dropped, is removed by the record, never by rsync
    assert plans["h3"].difference == mirror.Difference(("b.py",), ("old.py",))
    assert plans["h3"].placement == mirror.Placement((), (("old.py", 3, "d" * 64),), ())
    assert "--delete" not in plans["h3"].argv
    # b.py differs with the same size: rsync's size+mtime quick check could skip it, so contents are compared
    assert "--checksum" in plans["h3"].argv and "--checksum" not in plans["h2"].argv
    assert plans["h4"].action == "skip" and "refused" in plans["h4"].reason


def test_a_sync_never_removes_or_replaces_what_mnft_did_not_place():
    """A run's checkpoint in a repository whose .gitignore does not name it, a person's notes, a file mnft placed and
    a run then changed: none is removed; a source file whose path is taken by such a file is a conflict, named,
    nothing written on that host; --force replaces it. Identical files are adopted without a conflict."""
    local = local_tree({"train.py": (5, "t" * 64), "ckpts/model.pt": (7, "n" * 64), "same.txt": (1, "s" * 64)})
    placed = {"train.py": (5, "t" * 64), "cfg.yaml": (4, "c" * 64), "gone.py": (3, "g" * 64)}
    there = {"train.py": (5, "t" * 64), "ckpts/model.pt": (9, "r" * 64), "notes.txt": (2, "p" * 64), "same.txt": (1, "s" * 64),
             "cfg.yaml": (4, "C" * 64), "gone.py": (3, "g" * 64)}
    where = mirror.placement(local.files, there, placed)
    assert where.conflicts == ("ckpts/model.pt",)  # the run's file, in the way of a new source file
    assert where.remove == (("gone.py", 3, "g" * 64),)  # mnft's, dropped by the source, unchanged
    assert where.kept == ("cfg.yaml",)  # mnft's, dropped by the source, but changed on the host: kept
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1}\n")
    remote = {"h1": read_ok("h1", there, placed=placed)}
    (p,) = mirror.plan(inv, local, remote, kind="code", rules_file=RULES_FILE, ssh=SSH)
    assert p.action == "conflict" and p.argv == () and "ckpts/model.pt" in p.reason and "nothing was written" in p.reason
    (forced,) = mirror.plan(inv, local, remote, kind="code", rules_file=RULES_FILE, ssh=SSH, force=True)
    assert forced.action == "rsync" and forced.difference.send == ("ckpts/model.pt",) and "--delete" not in forced.argv
    # no record at all (a workdir an older mnft mirrored): nothing there is mnft's, files equal to the source's are fine
    assert mirror.placement(local.files, there, None) == mirror.Placement(("ckpts/model.pt",), (), ())
    # --no-delete: not even mnft's own dropped files are removed
    (kept,) = mirror.plan(inv, local, {"h1": read_ok("h1", {"train.py": (5, "t" * 64), "gone.py": (3, "g" * 64)}, placed=placed)},
                          kind="code", rules_file=RULES_FILE, ssh=SSH, delete=False)
    assert kept.placement.remove == () and kept.action == "rsync"


def test_a_snapshot_is_mirrored_exactly_read_only_and_hard_linked_from_the_ones_beside_it():
    local = local_tree({"a.py": (1, "a" * 64)})
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1}\n")
    remote = {"h1": read_ok("h1", None, root="/root/mnft/.mnft/code/0123456789abcdef")}
    (p,) = mirror.plan(inv, local, remote, kind="snapshot", rules_file=RULES_FILE, ssh=SSH, targets={"h1": "~/mnft/.mnft/code/0123456789abcdef"},
                       link_dest={"h1": ["/root/mnft/.mnft/code/fedcba9876543210"]})
    assert p.action == "rsync" and "--delete" in p.argv and "--chmod=Fa-w" in p.argv
    assert "--link-dest=/root/mnft/.mnft/code/fedcba9876543210" in p.argv
    assert p.argv[-1] == "10.0.0.1:mnft/.mnft/code/0123456789abcdef/"
    with pytest.raises(InputError, match="not an absolute path"):
        mirror.plan(inv, local, remote, kind="snapshot", rules_file=RULES_FILE, ssh=SSH, link_dest={"h1": ["relative/dir"]})


def test_plan_refuses_a_target_that_resolves_to_the_home():
    local = local_tree({"a.py": (1, "a" * 64)})
    remote = {"h1": read_ok("h1", {}, root="/root", home="/root")}
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1, workdir: ~/link-to-home}\n")
    (p,) = mirror.plan(inv, local, remote, kind="code", rules_file=RULES_FILE, ssh=SSH)
    assert p.action == "refuse" and "home directory" in p.reason


def test_data_on_a_shared_filesystem_is_written_once_and_verified_by_the_others():
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1, shared_fs: true}\n  h2: {address: 10.0.0.2, shared_fs: true}\n  h3: {address: 10.0.0.3}\n")
    local = local_tree({"d.bin": (5, "e" * 64)})
    remote = {n: read_ok(n, None, root="/root/mnft-data") for n in ("h1", "h2", "h3")}
    plans = {p.host: p for p in mirror.plan(inv, local, remote, kind="data", rules_file=RULES_FILE, ssh=SSH)}
    assert [plans[n].action for n in ("h1", "h2", "h3")] == ["rsync", "verify", "rsync"]
    assert plans["h1"].argv[-1] == "10.0.0.1:mnft-data/"


def test_a_shared_host_without_rsync_only_verifies_and_a_shared_host_with_rsync_writes_the_copy():
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1, shared_fs: true}\n  h2: {address: 10.0.0.2, shared_fs: true}\n")
    local = local_tree({"d.bin": (5, "e" * 64)})
    _, tree = read_ok("h1", None, root="/root/mnft-data")
    remote = {"h1": (HostResult("h1", Status.OK), mirror.RemoteTree(tree.root, tree.home, False, None, {}, rsync=None)),
              "h2": (HostResult("h2", Status.OK), mirror.RemoteTree(tree.root, tree.home, False, None, {}, rsync="3.2.7"))}
    plans = {p.host: p for p in mirror.plan(inv, local, remote, kind="data", rules_file=RULES_FILE, ssh=SSH)}
    assert (plans["h1"].action, plans["h2"].action) == ("verify", "rsync")
    assert "the copy of h2" in plans["h1"].reason


def test_a_host_without_rsync_fails_with_the_cause_and_an_old_rsync_gets_no_mkpath():
    local = local_tree({"a.py": (1, "a" * 64)})
    _, tree = read_ok("h1", None)
    remote = {"h1": (HostResult("h1", Status.OK), mirror.RemoteTree(tree.root, tree.home, False, None, {}, rsync=None)),
              "h2": (HostResult("h2", Status.OK), mirror.RemoteTree(tree.root, tree.home, False, None, {}, rsync="3.1.3")),
              "h3": (HostResult("h3", Status.OK), mirror.RemoteTree(tree.root, tree.home, False, None, {}, rsync="3.2.7"))}
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n  h3: {address: 10.0.0.3}\n")
    plans = {p.host: p for p in mirror.plan(inv, local, remote, kind="code", rules_file=RULES_FILE, ssh=SSH)}
    assert plans["h1"].action == "fail" and "rsync is not installed on h1" in plans["h1"].reason
    assert "--mkpath" not in plans["h2"].argv and "--mkpath" in plans["h3"].argv


def test_when_one_shared_host_already_holds_the_data_no_other_shared_host_gets_a_copy():
    inv = inventory("hosts:\n  h1: {address: 10.0.0.1, shared_fs: true}\n  h2: {address: 10.0.0.2, shared_fs: true}\n  h3: {address: 10.0.0.3}\n")
    files = {"d.bin": (5, "e" * 64)}
    local = local_tree(files)
    remote = {"h1": read_ok("h1", dict(files), root="/root/mnft-data", placed=dict(files)), "h2": read_ok("h2", None, root="/root/mnft-data"),
              "h3": read_ok("h3", None, root="/root/mnft-data")}
    plans = {p.host: p for p in mirror.plan(inv, local, remote, kind="data", rules_file=RULES_FILE, ssh=SSH)}
    assert [plans[n].action for n in ("h1", "h2", "h3")] == ["none", "verify", "rsync"]  # h2 lost the mount: no copy of its own


def shared_pair(tmp_path, b_dir: str):
    return inventory(f"hosts:\n  a: {{connection: local, workdir: '{tmp_path}/wa', data_dir: '{tmp_path}/shared', shared_fs: true}}\n"
                     f"  b: {{connection: local, workdir: '{tmp_path}/wb', data_dir: '{b_dir}', shared_fs: true}}\n")


def test_shared_data_is_written_once_then_only_verified_and_a_host_without_the_mount_fails(tmp_path):
    data = write(tmp_path / "dataset", {"shards/0.jsonl": "{}\n", "shards/1.jsonl": "[]\n"})
    inv = shared_pair(tmp_path, f"{tmp_path}/shared")  # both see one directory: a real shared filesystem
    first = mirror.sync_data(inv, data, progress=False)
    assert first.ok, first.summary()
    assert (first.hosts["a"].status, first.hosts["b"].status) == ("changed", "ok")
    assert first.hosts["b"].bytes_sent == 0 and first.hosts["b"].remote_hash == first.local_hash
    second = mirror.sync_data(inv, data, progress=False)
    assert {h.status for h in second.hosts.values()} == {"ok"}
    lost = shared_pair(tmp_path, f"{tmp_path}/mnt-gone/data")  # b's mount is gone: its path is empty
    report = mirror.sync_data(lost, data, progress=False)
    assert report.hosts["a"].status == "ok"
    assert report.hosts["b"].status == "failed" and report.exit_code() == ExitCode.FAILED
    assert f"host b does not see the shared data at {tmp_path}/mnt-gone/data" in report.hosts["b"].error
    assert not (tmp_path / "mnt-gone").exists()  # no private copy was made


def test_difference_names_changed_missing_and_extra_files():
    diff = mirror.difference({"a": (1, "x"), "b": (1, "y")}, {"a": (1, "z"), "c": (1, "w")})
    assert diff == mirror.Difference(("a", "b"), ("c",))
    assert diff.describe() == ["differs: a", "differs: b", "extra: c"]


# ------------------------------------------------------------------------------------------------ outcomes


@pytest.mark.parametrize(
    "code, stderr, status",
    [
        (0, "", "ok"),
        (255, "ssh: connect to host 10.0.0.9 port 22: Connection refused\nrsync: connection unexpectedly closed", "unreachable"),
        (255, "Host key verification failed.\r\nrsync: connection unexpectedly closed", "host-key-rejected"),
        (11, 'rsync: [receiver] write failed on "/w/big": No space left on device (28)\nrsync error: error in file IO (code 11)', "failed"),
        (23, 'rsync: [Receiver] mkstemp "/w/.x.abc" failed: Permission denied (13)\nrsync error: some files could not be transferred', "failed"),
        (None, "", "failed"),
        (12, "bash: line 1: rsync: command not found\nrsync: connection unexpectedly closed (0 bytes received so far) [sender]\n"
             "rsync error: error in rsync protocol data stream (code 12) at io.c(232)", "failed"),
        (12, "rsync: connection unexpectedly closed (118 bytes received so far) [sender]\nrsync error: error in rsync protocol data stream (code 12)", "failed"),
        (12, "ssh: connect to host 10.0.0.9 port 22: Connection timed out\nrsync: connection unexpectedly closed", "unreachable"),
    ],
)
def test_rsync_outcomes_are_classified(code, stderr, status):
    got, error = rsync.classify(code, stderr)
    assert got == status
    if status == "failed" and code == 12:
        assert "not installed" in error or "stopped" in error  # reached, then broke: never "unreachable"
    elif status == "failed" and code:
        assert "No space" in error or "Permission denied" in error


def test_stats_parsing_handles_thousands_separators():
    assert rsync.parse_stats("Number of files: 3\nTotal bytes sent: 1,234,567\nTotal bytes received: 35\n") == 1234567
    assert rsync.parse_stats("nothing") == 0


def test_report_exit_codes_and_json():
    hosts = {
        "h1": mirror.HostSync("h1", "ok", "~/mnft", remote_hash="d"),
        "h2": mirror.HostSync("h2", "failed", "~/mnft", remote_hash="e", differing=["differs: a.py"], error="differs after the sync: 1 file(s)"),
    }
    report = mirror.SyncReport("code", Path("/repo"), "d", 1, 1, hosts)
    assert report.exit_code() == ExitCode.FAILED and not report.ok
    data = report.to_json()
    assert data["hosts"]["h1"]["hash_match"] is True and data["hosts"]["h2"]["hash_match"] is False
    assert "h2: failed" in report.summary()
    hosts["h3"] = mirror.HostSync("h3", "unreachable", "~/mnft", error="no answer")
    assert report.exit_code() == ExitCode.UNREACHABLE


def test_local_host_sync_end_to_end_a_host_edit_is_a_conflict_and_force_repairs_it(tmp_path):
    src = git_repo(write(tmp_path / "src", {".gitignore": "*.log\n", "pkg/a.py": "a", "x.log": "l", "it's $(id).py": "q"}))
    dst = tmp_path / "dst"
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{dst}/w', data_dir: '{dst}/d'}}\n")
    first = mirror.sync_code(inv, src, progress=False)
    assert first.ok and first.hosts["me"].status == "changed" and first.hosts["me"].remote_hash == first.local_hash
    assert sorted(p.name for p in (dst / "w").iterdir()) == [".gitignore", ".mnft-checkout.json", "it's $(id).py", "pkg"]
    record = json.loads((dst / "w" / treehash.PLACED).read_text())
    assert record["digest"] == first.local_hash and sorted(record["files"]) == [".gitignore", "it's $(id).py", "pkg/a.py"]
    (dst / "w" / "runs").mkdir()
    (dst / "w" / "runs" / "keep.txt").write_text("outputs survive")
    assert mirror.sync_code(inv, src, progress=False).hosts["me"].status == "ok"
    (dst / "w" / "pkg" / "a.py").write_text("drift")  # a person's edit on the host
    (dst / "w" / "stray.py").write_text("s")  # a person's file
    dry = mirror.sync_code(inv, src, progress=False, dry_run=True).hosts["me"]
    assert (dry.status, dry.conflicts, dry.would_delete) == ("conflict", ["pkg/a.py"], [])
    refused = mirror.sync_code(inv, src, progress=False)
    assert refused.exit_code() == ExitCode.FAILED and "pkg/a.py" in refused.hosts["me"].error
    assert (dst / "w" / "pkg" / "a.py").read_text() == "drift"  # nothing written
    fixed = mirror.sync_code(inv, src, progress=False, force=True)
    assert fixed.hosts["me"].status == "changed" and fixed.ok
    assert (dst / "w" / "pkg" / "a.py").read_text() == "a" and (dst / "w" / "stray.py").read_text() == "s"
    assert (dst / "w" / "runs" / "keep.txt").exists()


def test_a_file_the_source_drops_is_removed_only_when_mnft_placed_it_and_nobody_changed_it(tmp_path):
    src = git_repo(write(tmp_path / "src", {"train.py": "t", "old.py": "o", "cfg.yaml": "c", "pkg/util.py": "u"}))
    dst = tmp_path / "dst"
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{dst}/w', data_dir: '{dst}/d'}}\n")
    assert mirror.sync_code(inv, src, progress=False).ok
    (dst / "w" / "cfg.yaml").write_text("changed on the host")
    for rel in ("old.py", "cfg.yaml", "pkg/util.py"):
        (src / rel).unlink()
    subprocess.run(["git", "-C", str(src), "add", "-A"], check=True, capture_output=True)
    dry = mirror.sync_code(inv, src, progress=False, dry_run=True).hosts["me"]
    assert (dry.would_delete, dry.kept) == (["old.py", "pkg/util.py"], ["cfg.yaml"])
    done = mirror.sync_code(inv, src, progress=False)
    assert done.ok and done.hosts["me"].files_deleted == 2 and done.hosts["me"].kept == ["cfg.yaml"]
    assert sorted(p.name for p in (dst / "w").iterdir()) == [".mnft-checkout.json", "cfg.yaml", "train.py"]  # pkg/ went with its file


def test_ignored_files_that_exist_only_on_the_host_survive_and_are_no_drift(tmp_path):
    """A host's checkpoints and logs match .gitignore: not deleted, not in its hash, not reported by check; files the
    .gitignore does not name survive too (mnft did not place them)."""
    src = git_repo(write(tmp_path / "src", {".gitignore": "*.log\ncheckpoints/\n", "train.py": "t", "pkg/.gitignore": "cache.db\n", "pkg/m.py": "m"}))
    dst = tmp_path / "dst"
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{dst}/w', data_dir: '{dst}/d'}}\n")
    assert mirror.sync_code(inv, src, progress=False).ok
    made = write(dst / "w", {"checkpoints/step100.pt": "weights", "train.log": "loss 1.0", "sub/deep/eval.log": "e", "pkg/cache.db": "c",
                             "ckpts/step_10/model.pt": "not in .gitignore"})
    dry = mirror.sync_code(inv, src, progress=False, dry_run=True).hosts["me"]
    assert (dry.status, dry.would_send, dry.would_delete) == ("ok", [], [])
    again = mirror.sync_code(inv, src, progress=False)
    assert again.hosts["me"].status == "ok" and again.ok
    for rel in ("checkpoints/step100.pt", "train.log", "sub/deep/eval.log", "pkg/cache.db", "ckpts/step_10/model.pt"):
        assert (made / rel).exists(), rel


# ------------------------------------------------------------------------------------------------ one source for sync, check and train


def test_the_default_source_is_the_repository_top_else_the_current_directory(tmp_path, monkeypatch):
    repo = git_repo(write(tmp_path / "proj", {"train.py": "t", "docs/index.md": "d"}))
    monkeypatch.chdir(repo / "docs")
    assert source.default_source() == repo
    assert source.code_source().root == repo
    monkeypatch.chdir(tmp_path)  # outside any repository: the current directory itself, never mnft's own checkout
    assert source.default_source() == tmp_path


def test_sync_from_a_subdirectory_mirrors_the_whole_project(tmp_path, monkeypatch):
    repo = git_repo(write(tmp_path / "proj", {"train.py": "t", "docs/index.md": "d"}))
    dst = tmp_path / "dst"
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{dst}/w', data_dir: '{dst}/d'}}\n")
    monkeypatch.chdir(repo / "docs")
    report = mirror.sync_code(inv, None, progress=False)
    assert report.ok and report.src == repo
    assert (dst / "w" / "train.py").exists() and (dst / "w" / "docs" / "index.md").exists()


@pytest.mark.parametrize("where", ["home", "root"])
def test_a_source_that_is_the_home_or_root_is_refused_before_any_walk(where, private_home, tmp_path):
    src = private_home if where == "home" else Path("/")
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{tmp_path}/w', data_dir: '{tmp_path}/d'}}\n")
    with pytest.raises(InputError, match="give the project directory"):
        mirror.sync_code(inv, src, progress=False)
    assert mirror.code_hashes(None, inv.hosts, src)[0]["me"]["error"].startswith("source ")


def test_configured_excludes_apply_to_sync_check_and_train_alike(tmp_path, private_home, monkeypatch):
    """invoke's mirror.exclude (here the user's ~/.invoke.yaml) reaches every caller, not only `invoke sync`."""
    (private_home / ".invoke.yaml").write_text("sync:\n  exclude: [notes/, '*.bak']\n")
    assert source.configured_excludes() == ("notes/", "*.bak")
    assert source.configured_excludes({"sync": {"exclude": ["x/"]}}) == ("x/",)  # a task's own config wins
    with pytest.raises(InputError, match="sync.exclude"):
        source.configured_excludes({"sync": {"exclude": "notes/"}})
    src = git_repo(write(tmp_path / "src", {"a.py": "a", "notes/n.md": "n", "old.bak": "b"}))
    dst = tmp_path / "dst"
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{dst}/w', data_dir: '{dst}/d'}}\n")
    report = mirror.sync_code(inv, src, progress=False)  # what train calls, with no excludes of its own
    assert report.ok and sorted(p.name for p in (dst / "w").iterdir()) == [treehash.PLACED, "a.py"]
    from mnft.hosts.fleet import Fleet

    with Fleet(inv) as fleet:
        hashes, _ = mirror.code_hashes(fleet, inv.hosts, src)  # what check calls
    assert hashes["me"]["matches"] is True and hashes["me"]["local_hash"] == report.local_hash


def test_a_data_sync_gets_the_timeout_it_is_given(tmp_path, monkeypatch):
    data = write(tmp_path / "data", {"d.bin": "x"})
    inv = inventory(f"hosts:\n  me: {{connection: local, workdir: '{tmp_path}/w', data_dir: '{tmp_path}/d'}}\n")
    seen = []
    real = rsync.run_rsync
    monkeypatch.setattr(mirror, "run_rsync", lambda argv, on_item=None, timeout=0: seen.append(timeout) or real(argv, on_item, timeout))
    assert mirror.sync_data(inv, data, progress=False, timeout=7200.0).ok
    assert seen == [7200.0]


def test_the_progress_display_shows_files_and_bytes_per_host(tmp_path):
    """What a user watches during a sync: one line per host with its files done/total and bytes."""
    from rich.console import Console

    src = git_repo(write(tmp_path / "src", {"a.py": "a" * 3000, "pkg/b.py": "b" * 2000, "pkg/c.py": "c"}))
    inv = inventory(f"hosts:\n  gpu-left: {{connection: local, workdir: '{tmp_path}/l', data_dir: '{tmp_path}/ld'}}\n"
                    f"  gpu-right: {{connection: local, workdir: '{tmp_path}/r', data_dir: '{tmp_path}/rd'}}\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "a.py").write_text("a" * 3000)  # gpu-right already holds one file
    os.utime(tmp_path / "r" / "a.py", ns=(os.stat(src / "a.py").st_atime_ns, os.stat(src / "a.py").st_mtime_ns))
    shown = Console(record=True, width=120, force_terminal=False)
    report = mirror.sync_code(inv, src, progress=shown)
    assert report.ok
    text = shown.export_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("gpu-")}
    assert "3/3 files" in lines["gpu-left"] and "5.0/5.0 kB" in lines["gpu-left"]
    assert "2/2 files" in lines["gpu-right"] and "2.0/2.0 kB" in lines["gpu-right"]



# ---------------------------------------------------------------------------------------- shared-storage marks

def test_a_planted_link_at_the_marks_directory_is_never_followed(tmp_path):
    """Marks may sit in a shared mount others write into, and mnft often runs as root: a `.mnft-share` that is a
    link must not make it delete old files or write a mark elsewhere (it did both)."""
    import os
    import time

    from mnft.onhost import sharemarks

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "old-file").write_text("precious")
    old = time.time() - 3 * 86400
    os.utime(victim / "old-file", (old, old))
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / ".mnft-share").symlink_to(victim)
    assert sharemarks._mark(str(home / "work"), "n1.h1") is not None  # refused, with why
    assert sorted(p.name for p in victim.iterdir()) == ["old-file"]
    assert sharemarks.seen(str(home / "work"), "n1", ["h1"]) == []


def test_marks_are_kept_only_in_a_directory_nobody_else_can_write_and_never_read_through_a_link(tmp_path):
    import os

    from mnft.onhost import sharemarks

    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / ".mnft-share").mkdir(mode=0o777)
    os.chmod(home / ".mnft-share", 0o777)  # another user could plant marks or links in it
    assert "writable by others" in sharemarks._mark(str(home / "work"), "n1.h1")
    os.chmod(home / ".mnft-share", 0o700)
    assert sharemarks._mark(str(home / "work"), "n1.h1") is None
    assert oct((home / ".mnft-share" / "n1.h1").stat().st_mode & 0o777) == "0o600"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("work")  # what h2's mark would hold
    (home / ".mnft-share" / "n1.h2").symlink_to(elsewhere)
    assert sharemarks.seen(str(home / "work"), "n1", ["h1", "h2"]) == ["h1"]  # the link is not h2's mark
    (home / ".mnft-share" / "n2.h3").symlink_to(tmp_path / "victim-file")
    os.utime(home / ".mnft-share" / "n2.h3", (0, 0), follow_symlinks=False)
    (tmp_path / "victim-file").write_text("x")
    assert sharemarks._mark(str(home / "work"), "n3.h1") is None  # cleans up the old link, not its target
    assert (tmp_path / "victim-file").exists() and not (home / ".mnft-share" / "n2.h3").is_symlink()


def test_marks_beside_a_directory_inside_the_tree_are_neither_hashed_nor_sent(tmp_path):
    """A checkpoints directory within the synced tree (exp/ckpt) gets its marks beside it (exp/.mnft-share/):
    the next sync must not see them as a difference, nor delete them."""
    from mnft.sync import source

    (tmp_path / "exp" / ".mnft-share").mkdir(parents=True)
    (tmp_path / "exp" / ".mnft-share" / "n1.h1").write_text("ckpt")
    (tmp_path / "exp" / "train.py").write_text("x")
    assert sorted(source.tree_hash(tmp_path, source.ALWAYS_EXCLUDES)[1]) == ["exp/train.py"]


def test_a_sync_asks_who_shares_only_when_some_host_needs_the_tree():
    """Who writes and who verifies in a group of hosts sharing a directory matters only when a copy is needed: a
    no-op sync (every host holds the tree) skips that round-trip to every host."""
    from types import SimpleNamespace

    from mnft.sync.mirror import all_current

    def tree(digest, **kw):
        return SimpleNamespace(digest=digest, refused=kw.get("refused"), errors=kw.get("errors", {}))

    assert all_current({"h1": (None, tree("d")), "h2": (None, tree("d"))}, "d")
    assert not all_current({"h1": (None, tree("d")), "h2": (None, tree("old"))}, "d")
    assert not all_current({"h1": (None, tree("d")), "h2": (None, None)}, "d")  # unread: not known to hold it
    assert not all_current({"h1": (None, tree("d", errors={"x": "unreadable"}))}, "d")


def test_a_tree_of_hard_links_is_hashed_from_the_cache_of_the_tree_it_links_without_reading_a_file(tmp_path, monkeypatch):
    """A job's directory (hard links to its snapshot) and a new snapshot (hard links to the one before) cost the
    hash of their new files only: a file with the snapshot's inode, size, mtime and ctime is the snapshot's file."""
    snap, job = tmp_path / "snap", tmp_path / "job"
    write(snap, {"a.py": "a", "pkg/b.bin": "b" * 5000})
    for rel in ("a.py", "pkg/b.bin"):
        (snap / rel).chmod(0o444)  # a snapshot's files are read-only
    digest, _, _ = treehash.tree_hash(snap, (), str(tmp_path / "snap.cache"))
    for rel in ("a.py", "pkg/b.bin"):
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(snap / rel, job / rel)
    (job / "new.txt").write_text("written by the job")
    read = []
    real = treehash.sha256_file
    monkeypatch.setattr(treehash, "sha256_file", lambda path: read.append(os.path.basename(path)) or real(path))
    got, files, _ = treehash.tree_hash(job, (), str(tmp_path / "job.cache"), only={"a.py", "pkg/b.bin"}, also=[str(tmp_path / "snap.cache")])
    assert got == digest and read == []
    treehash.tree_hash(job, (), str(tmp_path / "job2.cache"), also=[str(tmp_path / "snap.cache")])
    assert read == ["new.txt"]  # only what the cache of the linked tree does not know
    os.utime(job / "a.py", ns=(1, 1))  # another mtime: not the file the other cache knows
    read.clear()
    treehash.tree_hash(job, (), None, only={"a.py"}, also=[str(tmp_path / "snap.cache")])
    assert read == ["a.py"]
    os.utime(job / "a.py", ns=(os.stat(snap / "pkg/b.bin").st_atime_ns, os.stat(snap / "pkg/b.bin").st_mtime_ns))
    (job / "pkg/b.bin").chmod(0o644)  # writable: whatever its inode and times say, it is read
    read.clear()
    treehash.tree_hash(job, (), None, only={"pkg/b.bin"}, also=[str(tmp_path / "snap.cache")])
    assert read == ["b.bin"]
