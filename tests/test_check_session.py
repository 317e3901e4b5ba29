"""check's one command per host: the probe's session mode (run in a child Python exactly as the controller runs it)
and its controller side (mnft.check.session), on `connection: local` hosts; the pure pieces with data."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mnft.onhost import probe
from mnft.check.findings import CheckOptions
from mnft.check.gather import connect_request, gather
from mnft.check.session import ran_result, session_command
from mnft.hosts import connection, payload, pyrun
from mnft.hosts.fleet import Fleet, Status
from mnft.hosts.inventory import parse
from mnft.sync import mirror
from mnft.sync.source import read_local


def start_session(workdir: Path, *requests: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "session", "--workdir", str(workdir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.buffer.write(pyrun.payload("probe") + "".join(json.dumps(r) + "\n" for r in requests).encode())
    proc.stdin.flush()
    return proc


def ask(proc: subprocess.Popen, request: dict) -> dict:
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_session_gives_the_facts_first_then_answers_each_request_in_order(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "a.py").write_text("a")
    run = pyrun.run_request("treehash", [str(tmp_path / "w"), "--if-exists"], "[]\n")
    proc = start_session(tmp_path / "w", {"run": run})  # sent with the probe: answered once the facts are out
    try:
        facts = json.loads(proc.stdout.readline())["facts"]
        assert facts["probe_version"] == probe.PROBE_VERSION and isinstance(facts["clock"], float)
        assert facts["disk"]["workdir"] == str(tmp_path / "w")
        ran = json.loads(proc.stdout.readline())["ran"]
        assert ran["exit_code"] == 0 and ran["error"] is None
        tree = json.loads(ran["stdout"])
        assert tree["exists"] is True and list(tree["files"]) == ["a.py"]
        listening = ask(proc, {"listen": {"port": 0, "seconds": 20, "bind": "127.0.0.1"}})["listen"]
        assert listening["ok"] is True
        port = listening["port"]
        reach = ask(proc, {"connect": {"host": "127.0.0.1", "port": port, "timeout": 2, "bind": "127.0.0.1"}})["connect"]
        assert reach["ok"] is True and reach["reply_ok"] is True and reach["local"] == "127.0.0.1"
        assert ask(proc, {"listen": {"port": 0, "seconds": 20}})["listen"] == {"ok": False, "error": f"already listening on port {port}"}
        assert not port_is_free(port)
        proc.stdin.close()  # the controller is done: the listener stops, the probe ends
        assert proc.wait(timeout=5) == 0
        assert proc.stdout.read() == "" and proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
    assert port_is_free(port)  # the connecting side closed first: nothing left in TIME_WAIT on the port


def test_a_session_refuses_a_port_in_use_and_takes_the_next(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_session(tmp_path)
        try:
            assert "facts" in json.loads(proc.stdout.readline())
            assert ask(proc, {"listen": {"port": port, "seconds": 20, "bind": "127.0.0.1"}}) == {"listen": {"ok": False, "error": "address in use"}}
            assert ask(proc, {"listen": {"port": 0, "seconds": 20, "bind": "127.0.0.1"}})["listen"]["ok"] is True
        finally:
            proc.stdin.close()
            proc.wait(timeout=5)


@pytest.mark.parametrize("request_, answer", [
    ({"bogus": {}}, {"error": "a request names one of run, listen, connect, with an object"}),
    ({"listen": {"port": 1}, "connect": {}}, {"error": "a request names one of run, listen, connect, with an object"}),
    ({"listen": "80"}, {"error": "a request names one of run, listen, connect, with an object"}),
    ({"listen": {"port": 70000, "seconds": 5}}, {"listen": {"ok": False, "error": "a bad request: port out of range: '70000'"}}),
    ({"listen": {"port": 1, "seconds": "nan"}}, {"listen": {"ok": False, "error": "a bad request: seconds out of range: 'nan'"}}),
    ({"connect": {"host": "h", "port": 0, "timeout": 1}}, {"connect": {"ok": False, "error": "a bad request: port out of range: '0'"}}),
    ({"connect": {"host": ["h"], "port": 1, "timeout": 1}}, {"connect": {"ok": False, "error": "a bad request: host must be an address, not ['h']"}}),
    ({"connect": {"host": "h", "port": True, "timeout": 1}}, {"connect": {"ok": False, "error": "a bad request: port must be a number, not True"}}),
    ({"connect": {"host": "h", "port": 1, "timeout": 1, "bind": 5}}, {"connect": {"ok": False, "error": "a bad request: bind must be an address, not 5"}}),
])
def test_a_bad_request_is_answered_with_why_and_the_session_goes_on(request_, answer):
    assert probe.answer(request_, probe._Listener()) == answer


def test_a_request_that_is_not_json_ends_the_session_with_one_line(tmp_path):
    proc = start_session(tmp_path)
    proc.stdin.write("{not json\n")
    proc.stdin.close()
    lines = proc.stdout.read().splitlines()
    assert proc.wait(timeout=5) == 0
    assert "facts" in json.loads(lines[0])
    assert json.loads(lines[1])["error"].startswith("a request the probe cannot read: ")


def entry_request(source: str, argv=(), stdin: str = "", compiles: bool = True) -> dict:
    """A run request of an ad-hoc host entry `x` (its main is the source's)."""
    import base64
    import marshal

    code = marshal.dumps(compile(source, "x", "exec", dont_inherit=True)) if compiles else b""
    data = payload.pack("x", {"x": (source.encode(), code)})
    return {"payload": base64.b64encode(data).decode(), "argv": list(argv), "stdin": stdin}


def test_a_script_runs_in_the_probe_as_pyrun_runs_it_and_the_probe_keeps_its_own_streams():
    before = sys.stdout, sys.stdin, sys.argv
    ran = probe.run_script(entry_request("import sys\ndef main(argv):\n    print(argv, sys.argv[1:], sys.stdin.read())\n    return 3\n",
                                         ["a", "b c"], "rules"))
    assert (sys.stdout, sys.stdin, sys.argv) == before
    assert ran["exit_code"] == 3 and ran["stdout"] == "['a', 'b c'] ['a', 'b c'] rules\n" and ran["error"] is None
    assert probe.run_script(entry_request("def main(argv):\n    raise RuntimeError('boom')\n"))["exit_code"] == 1
    assert probe.run_script(entry_request("def main(argv):\n    raise RuntimeError('boom')\n"))["error"] == "boom"
    assert probe.run_script(entry_request("import sys\ndef main(argv):\n    sys.exit()\n"))["exit_code"] == 0
    broken = probe.run_script(entry_request("def (", compiles=False))
    assert broken["exit_code"] == 1 and broken["error"].startswith("SyntaxError")
    assert probe.run_script({"argv": []})["error"] == "the run request: KeyError: 'payload'"


# ------------------------------------------------------------------------------------------------ pure pieces


def test_a_run_answer_becomes_the_result_its_own_round_trip_would_have_given():
    ok = ran_result("h1", {"exit_code": 0, "stdout": '{"x": 1}\n', "stderr": "", "error": None}, None)
    assert ok.status is Status.OK and ok.stdout == '{"x": 1}\n'
    failed = ran_result("h1", {"exit_code": 2, "stdout": "", "stderr": "usage: treehash.py ROOT\n", "error": None}, None)
    assert failed.status is Status.FAILED and failed.exit_code == 2 and failed.error == "exit code 2: usage: treehash.py ROOT"
    raised = ran_result("h1", {"exit_code": 1, "stdout": "", "stderr": "", "error": "boom"}, None)
    assert raised.error == "exit code 1: boom"
    assert ran_result("h1", {"exit_code": None, "error": "the run request: KeyError: 'source'"}, None).error == "the run request: KeyError: 'source'"
    assert ran_result("h1", {"exit_code": True}, None).status is Status.FAILED  # a hostile answer is a failure, never a crash
    missing = ran_result("h1", None, "no answer from the host within 60s")
    assert missing.status is Status.FAILED and missing.error == "no answer from the host within 60s"


def test_a_connect_names_the_master_and_binds_only_where_the_host_names_its_interface():
    inv = parse("hosts:\n  h1: {address: 10.0.0.1, iface: eth1}\n  h2: {address: 10.0.0.2}\n")
    facts = {"interfaces": [{"name": "eth1", "up": True, "ipv4": ["10.1.0.5/24"]}]}
    assert connect_request(inv.host("h1"), facts, "10.1.0.1", 29500, 3.0) == {"host": "10.1.0.1", "port": 29500, "timeout": 3.0, "bind": "10.1.0.5"}
    assert connect_request(inv.host("h2"), facts, "10.1.0.1", 29500, 3.0)["bind"] is None


def test_the_session_runs_on_the_hosts_python_with_site_and_arguments_quoted():
    inv = parse("hosts:\n  h1: {address: 10.0.0.1, workdir: '/srv/my work; $(id)'}\n")
    argv = session_command(inv.host("h1"), ["peft", "torch"]).argv
    assert argv[0] == "python3" and "-S" not in argv  # site: the torch `import torch` would load
    assert argv[-5:] == ("session", "--workdir", "/srv/my work; $(id)", "--modules", "peft,torch")
    assert "'/srv/my work; $(id)'" in session_command(inv.host("h1")).render()


def test_the_code_request_is_the_tree_hash_check_ran_apart_and_the_mark_request_hashes_nothing(tmp_path):
    (tmp_path / "a.py").write_text("a")
    inv = parse("hosts:\n  h1: {address: 10.0.0.1, workdir: /w/h1, data_dir: /d/h1}\n")
    local = read_local(tmp_path, ())
    entry, args, stdin = mirror.code_request(inv.host("h1"), local, mark="n0nce", names=["h1", "h2"])
    assert entry == "treehash" and stdin == mirror.rules_line(local.rules)
    assert args == ["/w/h1", "--other", "/d/h1", "--mark", "n0nce.h1", "--names", "h1,h2", "--if-exists"]
    assert args == mirror.hash_args(inv.host("h1"), "/w/h1", if_exists=True, other="/d/h1", mark="n0nce", names=["h1", "h2"])
    assert mirror.mark_request(inv.host("h1"), "/w/h1", "n0nce", ["h1", "h2"])[1:] == (
        ["/w/h1", "--mark", "n0nce.h1", "--only", "--names", "h1,h2"], "")


def test_a_hosts_code_entry_from_its_tree_hash(tmp_path):
    (tmp_path / "a.py").write_text("a")
    local = read_local(tmp_path, ())
    ok = ran_result("h1", {"exit_code": 0, "stdout": "{}"}, None)
    same = mirror.RemoteTree("/w", "/root", True, local.digest, dict(local.files))
    assert mirror.code_of(local, ok, same) == {"hash": local.digest, "exists": True, "matches": True, "local_hash": local.digest, "differing": [],
                                               "source": str(local.root)}
    other = mirror.RemoteTree("/w", "/root", True, "f" * 64, {"a.py": (2, "0" * 64)})
    entry = mirror.code_of(local, ok, other)
    assert entry["matches"] is False and entry["differing"]
    absent = mirror.RemoteTree("/w", "/root", False, None, {})
    assert mirror.code_of(local, ok, absent)["exists"] is False and mirror.code_of(local, ok, absent)["matches"] is None
    assert mirror.code_of(local, ok, mirror.RemoteTree("/", "/root", True, None, {}))["error"].startswith("workdir refused: ")
    failed = ran_result("h1", None, "no answer from the host within 60s")
    assert mirror.code_of(local, failed, None) == mirror.code_unknown("no answer from the host within 60s")


# ------------------------------------------------------------------------------------------------ the whole check, local hosts


def test_check_runs_one_command_per_host_for_facts_code_marks_and_the_network_test(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    (tmp_path / "w1").mkdir()
    (tmp_path / "w1" / "train.py").write_text("print(1)\n")  # h1 and h3 share it and hold the code; h2 has none
    py = json.dumps(sys.executable)
    inv = parse("hosts:\n" + "".join(f"  {name}: {{connection: local, workdir: '{tmp_path}/{wd}', python: {py}, iface: lo}}\n"
                                     for name, wd in (("h1", "w1"), ("h2", "w2"), ("h3", "w1"))))
    started = []
    real = connection.LocalConnection.start
    monkeypatch.setattr(connection.LocalConnection, "start", lambda self, command, lines=True: started.append(self.host.name) or real(self, command, lines))
    taken = socket.socket()  # the rendezvous port is taken on the master: the next one is tested instead
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with Fleet(inv) as fleet:
            report = gather(fleet, CheckOptions(code_src=str(src), port=port, find_free_port=True, port_search=20))
    finally:
        taken.close()
    assert sorted(started) == ["h1", "h2", "h3"]  # one command each: facts, code hash, marks, listen and connect
    assert all(report.outcomes[n].status is Status.OK for n in ("h1", "h2", "h3"))
    assert set(report.facts) == set(report.skew) == {"h1", "h2", "h3"}
    assert report.code["h1"]["matches"] is True and report.code["h3"]["matches"] is True
    assert report.code["h2"]["exists"] is False
    assert report.shared == {"h1": ("h1", "h3"), "h3": ("h1", "h3")}
    assert report.master_addr == "127.0.0.1" and report.port_free is True and port < report.port <= port + 20
    assert {n: (r.ok, r.source, r.iface) for n, r in report.reach.items()} == {n: (True, "127.0.0.1", "lo") for n in ("h1", "h2", "h3")}
    assert port_is_free(report.port)  # the listener is gone once check returns: train's rendezvous takes the port next


def two_sharing_hosts(tmp_path: Path):
    (tmp_path / "w").mkdir()
    py = json.dumps(sys.executable)
    return parse("hosts:\n" + "".join(f"  {name}: {{connection: local, workdir: '{tmp_path}/w', python: {py}, iface: lo}}\n" for name in ("h1", "h2")))


def counted_starts(monkeypatch) -> list[str]:
    started: list[str] = []
    real = connection.LocalConnection.start
    monkeypatch.setattr(connection.LocalConnection, "start", lambda self, command, lines=True: started.append(self.host.name) or real(self, command, lines))
    return started


def test_without_the_code_hash_the_marks_still_ride_on_the_one_command(tmp_path, monkeypatch):
    inv = two_sharing_hosts(tmp_path)
    started = counted_starts(monkeypatch)
    with Fleet(inv) as fleet:
        report = gather(fleet, CheckOptions(code=False, network=False))
    assert sorted(started) == ["h1", "h2"]
    assert report.code == {} and report.shared == {"h1": ("h1", "h2"), "h2": ("h1", "h2")}


def test_a_local_tree_that_cannot_be_read_leaves_every_hosts_code_unknown_and_still_finds_who_shares(tmp_path, monkeypatch):
    inv = two_sharing_hosts(tmp_path)
    started = counted_starts(monkeypatch)
    with Fleet(inv) as fleet:
        report = gather(fleet, CheckOptions(code_src="/", network=False))  # the root: refused as a source
    assert sorted(started) == ["h1", "h2"]
    assert {n: (c["hash"], c["error"].startswith("source ")) for n, c in report.code.items()} == {"h1": (None, True), "h2": (None, True)}
    assert report.shared == {"h1": ("h1", "h2"), "h2": ("h1", "h2")}


def test_a_host_whose_probe_cannot_start_fails_alone_and_the_others_are_checked(tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    py = json.dumps(sys.executable)
    inv = parse(f"hosts:\n  h1: {{connection: local, workdir: '{tmp_path}/w', python: {py}, iface: lo}}\n"
                f"  h2: {{connection: local, workdir: '{tmp_path}/w2', python: /nonexistent/python3, iface: lo}}\n")
    with Fleet(inv) as fleet:
        report = gather(fleet, CheckOptions(code=False))
    assert report.outcomes["h1"].status is Status.OK and report.outcomes["h2"].status is Status.FAILED
    assert report.outcomes["h2"].error.startswith("exit code 127")
    assert set(report.facts) == {"h1"} and report.reach["h1"].ok is True and "h2" not in report.reach
