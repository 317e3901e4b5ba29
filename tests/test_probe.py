"""The host probe, run in a child Python exactly as the controller runs it (source on stdin)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mnft.hosts import pyrun
from mnft.onhost import facts


FACT_KEYS = {
    "probe_version", "hostname", "fqdn", "os", "kernel", "arch", "python", "torch", "nccl", "cudnn", "nvidia",
    "cpu_count", "memory", "disk", "interfaces", "clock", "rsync", "dists", "timings", "errors",
}

GPU_CSV = """\
0, NVIDIA A100-SXM4-80GB, GPU-aaaa-0000, 81920, 1234, 550.54.15
1, NVIDIA A100-SXM4-80GB, GPU-bbbb-1111, 81920, [N/A], 550.54.15
"""
APPS_CSV = """\
GPU-aaaa-0000, 4242, /usr/bin/python3, 1200
GPU-aaaa-0000, 4343, python, 34
"""
BANNER = "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |\n"


def run_stdin(*args: str, env: dict | None = None, timeout: float = 20) -> subprocess.CompletedProcess:
    """The probe as a host runs it: `python -c BOOTSTRAP ARGS`, its payload on stdin (then stdin ends)."""
    done = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, *args], input=pyrun.payload("probe"), capture_output=True, env=env,
                          timeout=timeout)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def facts_of(workdir: Path, env: dict | None = None) -> dict:
    done = run_stdin("facts", "--workdir", str(workdir), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def env_with(path: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=path, **extra)
    return env


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(stream, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no line within %.1f s" % timeout
    return stream.readline()


# ------------------------------------------------------------------------------------------------ facts


def test_facts_is_one_json_object_with_every_key(tmp_path):
    facts = facts_of(tmp_path)
    assert set(facts) == FACT_KEYS
    assert facts["probe_version"] == 1
    assert facts["errors"] == {}
    assert set(facts["os"]) == {"id", "version", "pretty"}
    assert facts["python"] == {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3]}
    assert set(facts["torch"]) == {"version", "cuda", "git_version", "location", "source"}
    assert set(facts["nvidia"]) == {"driver", "cuda_driver", "gpus"}
    assert facts["cpu_count"] == os.cpu_count()
    assert 0 < facts["memory"]["available_bytes"] <= facts["memory"]["total_bytes"]
    assert facts["disk"]["path"] == str(tmp_path)
    assert 0 <= facts["disk"]["free_bytes"] <= facts["disk"]["total_bytes"]
    lo = [i for i in facts["interfaces"] if i["name"] == "lo"]
    assert lo and "127.0.0.1/8" in lo[0]["ipv4"] and lo[0]["up"] is True
    assert abs(facts["clock"] - time.time()) < 30
    assert set(facts["timings"]) == {"total_s", "torch_s"}
    assert facts["timings"]["total_s"] < 3


def test_torch_version_and_cuda_come_from_the_version_py_import_torch_would_load(tmp_path):
    torch = facts_of(tmp_path)["torch"]
    import torch as real  # the test may import it: the probe must not

    assert torch["version"] == real.__version__ and torch["cuda"] == real.version.cuda
    assert torch["git_version"] == real.version.git_version
    assert torch["source"] == "version.py"
    assert Path(torch["location"]) == Path(real.__file__).parent


def _dist_info(site: Path, version: str) -> None:
    dist = site / f"torch-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def test_a_stale_torch_dist_info_earlier_on_the_path_does_not_fool_the_probe(tmp_path):
    # pip leftovers: metadata for torch 1.0.0 first on sys.path, but no package there; import torch loads the real one
    _dist_info(tmp_path / "stale", "1.0.0")
    torch = facts_of(tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path / "stale")))["torch"]
    assert torch["version"] == importlib.metadata.version("torch") != "1.0.0"


def test_the_torch_package_first_on_the_path_is_the_one_reported(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise SystemExit('the probe must not import torch')\n")
    (site / "torch" / "version.py").write_text("__version__ = '9.9.9+cu118'\ncuda: Optional[str] = '11.8'\ngit_version = 'abc'\n")
    torch = facts_of(tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))["torch"]
    assert (torch["version"], torch["cuda"], torch["location"], torch["source"]) == ("9.9.9+cu118", "11.8", str(site / "torch"), "version.py")


def test_without_version_py_the_version_comes_from_metadata(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    _dist_info(site, "2.0.1")
    torch = facts_of(tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))["torch"]
    assert (torch["version"], torch["cuda"], torch["source"]) == ("2.0.1", None, "metadata")


def test_facts_never_imports_torch(tmp_path):
    child = textwrap.dedent(f"""
        import sys
        from mnft.onhost import probe as module
        rc = module.main(["facts", "--workdir", {str(tmp_path)!r}])
        sys.exit(3 if "torch" in sys.modules else rc)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["torch"]["version"]


def test_missing_workdir_measures_its_nearest_existing_ancestor(tmp_path):
    disk = facts_of(tmp_path / "not" / "yet" / "made")["disk"]
    assert disk["path"] == str(tmp_path)
    assert disk["workdir"] == str(tmp_path / "not" / "yet" / "made")


def test_workdir_tilde_is_expanded_on_the_host(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    assert facts_of(Path("~/runs/exp1"), env=env)["disk"]["path"] == str(tmp_path)


def fake_nvidia_smi(bin_dir: Path) -> None:
    script = bin_dir / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in
          --query-gpu=*) cat <<'EOF'
        {textwrap.indent(GPU_CSV, "        ").strip()}
        EOF
          ;;
          --query-compute-apps=*) cat <<'EOF'
        {textwrap.indent(APPS_CSV, "        ").strip()}
        EOF
          ;;
          *) printf '%s' '{BANNER.strip()}'; echo ;;
        esac
        """).replace("\n        ", "\n"))
    script.chmod(0o755)


def test_fake_nvidia_smi_yields_gpus_with_their_processes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_nvidia_smi(bin_dir)
    facts = facts_of(tmp_path, env=env_with(f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))
    assert facts["errors"] == {}
    nvidia = facts["nvidia"]
    assert nvidia["driver"] == "550.54.15"
    assert nvidia["cuda_driver"] == "12.4"  # no libcuda here: read from nvidia-smi's banner
    assert nvidia["gpus"] == [
        {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-aaaa-0000", "memory_total_mib": 81920,
         "memory_used_mib": 1234, "processes": [
             {"pid": 4242, "name": "/usr/bin/python3", "used_mib": 1200},
             {"pid": 4343, "name": "python", "used_mib": 34}]},
        {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-bbbb-1111", "memory_total_mib": 81920,
         "memory_used_mib": None, "processes": []},
    ]


def test_failing_nvidia_smi_is_an_error_not_a_crash(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\nexit 9\n")
    script.chmod(0o755)
    facts = facts_of(tmp_path, env=env_with(f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))
    assert facts["nvidia"] == {"driver": None, "cuda_driver": None, "gpus": []}
    assert "exited with 9: NVIDIA-SMI has failed" in facts["errors"]["nvidia"]


def test_without_nvidia_smi_or_ip_driver_is_null_and_nothing_is_an_error(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    facts = facts_of(tmp_path, env=env_with(str(empty)))
    assert facts["nvidia"] == {"driver": None, "cuda_driver": None, "gpus": []}
    assert facts["rsync"] is None
    assert facts["errors"] == {}
    # no `ip` on PATH either: interfaces come from the ioctl fallback
    lo = [i for i in facts["interfaces"] if i["name"] == "lo"]
    assert lo == [{"name": "lo", "up": True, "ipv4": ["127.0.0.1/8"]}]


def fake_dist(site: Path, dirname: str, version: str) -> None:
    dist = site / dirname
    dist.mkdir(parents=True)
    name = dirname.split("-")[0].replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nNCCL\n")


def test_nccl_and_cudnn_versions_come_from_nvidia_distributions_on_sys_path(tmp_path):
    site = tmp_path / "site"
    fake_dist(site, "nvidia_nccl_cu12-2.21.5.dist-info", "2.21.5")
    fake_dist(site, "nvidia_cudnn_cu12-9.1.0.70.dist-info", "9.1.0.70")
    facts = facts_of(tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert facts["nccl"] == "2.21.5"
    assert facts["cudnn"] == "9.1.0.70"


def test_no_nvidia_distributions_means_null_versions(tmp_path):
    facts = facts_of(tmp_path)
    assert facts["nccl"] is None and facts["cudnn"] is None


def test_ip_json_parsing_keeps_links_without_ipv4_and_needs_a_carrier_for_up():
    text = json.dumps([
        {"ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"],
         "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8},
                       {"family": "inet6", "local": "::1", "prefixlen": 128}]},
        {},
        {"ifname": "eth1", "flags": ["BROADCAST", "NO-CARRIER", "UP"],
         "addr_info": [{"family": "inet", "local": "10.0.0.2", "prefixlen": 24},
                       {"family": "inet", "local": "10.0.0.3", "prefixlen": 24}]},
        {"ifname": "ib0", "flags": ["UP", "LOWER_UP"], "addr_info": []},
    ])
    assert facts._parse_ip_json(text) == [
        {"name": "lo", "up": True, "ipv4": ["127.0.0.1/8"]},
        {"name": "eth1", "up": False, "ipv4": ["10.0.0.2/24", "10.0.0.3/24"]},
        {"name": "ib0", "up": True, "ipv4": []},
    ]


def test_source_is_python38_syntax_and_imports_only_the_stdlib():
    from mnft.hosts import payload

    for name in payload.closure("probe"):  # every module the probe's payload carries
        tree = ast.parse(Path(payload.HOST_PACKAGE, f"{name}.py").read_text(), feature_version=(3, 8))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, name


# ------------------------------------------------------------------------------------------------ network


def start_listener(port: int, *, via_stdin: bool = False, seconds: str = "20") -> subprocess.Popen:
    argv = [sys.executable, "-c", pyrun.BOOTSTRAP, "listen", str(port), seconds, "--bind", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.buffer.write(pyrun.payload("probe"))
    proc.stdin.flush()
    if via_stdin:
        proc.stdin.close()
    return proc


def connect(port: int, timeout: str = "2", *extra: str) -> dict:
    done = run_stdin("connect", "127.0.0.1", str(port), timeout, *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_listen_connect_round_trip_and_closing_stdin_stops_the_listener():
    port = free_tcp_port()
    proc = start_listener(port)
    try:
        assert json.loads(read_line(proc.stdout, 5)) == {"ok": True, "port": port}
        for _ in range(2):
            reach = connect(port, "2", "--bind", "127.0.0.1")
            assert reach["ok"] is True and reach["reply_ok"] is True and reach["error"] is None
            assert reach["local"] == "127.0.0.1" and 0 <= reach["seconds"] < 2
        proc.stdin.close()
        assert proc.wait(timeout=2) == 0
        assert proc.stdout.read() == ""  # nothing after the ok line
    finally:
        proc.kill()
        proc.wait()
    # the client closed first, so the port is not left in TIME_WAIT on the listener's side
    assert json.loads(run_stdin("free-port", str(port), "--bind", "127.0.0.1").stdout) == {"free": True, "error": None}


def test_listener_started_through_the_controller_bootstrap_stops_when_stdin_closes():
    from mnft.hosts import pyrun

    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "listen", str(port), "20", "--bind", "127.0.0.1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(pyrun.payload("probe"))
        proc.stdin.flush()
        assert json.loads(read_line(proc.stdout, 5)) == {"ok": True, "port": port}
        assert connect(port)["reply_ok"] is True
        proc.stdin.close()
        assert proc.wait(timeout=2) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_listener_whose_stdin_was_the_source_stops_when_its_reader_goes_away():
    # its stdin ended right after the payload: EOF there means nothing, so the listener keeps
    # serving, and stops when the SSH channel (its stdout's reader) goes away.
    port = free_tcp_port()
    proc = start_listener(port, via_stdin=True)
    try:
        assert json.loads(read_line(proc.stdout, 5))["ok"] is True
        assert connect(port)["reply_ok"] is True
        assert proc.poll() is None
        proc.stdout.close()
        assert proc.wait(timeout=2) == 0
    finally:
        proc.kill()
        proc.wait()


def test_listener_stops_by_itself_after_seconds():
    port = free_tcp_port()
    proc = start_listener(port, seconds="0.3")
    try:
        assert json.loads(read_line(proc.stdout, 5))["ok"] is True
        assert proc.wait(timeout=3) == 0
    finally:
        proc.kill()
        proc.wait()


def test_listen_on_a_port_in_use_reports_it_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_stdin("listen", str(port), "20", "--bind", "127.0.0.1", timeout=5)
        free = run_stdin("free-port", str(port), "--bind", "127.0.0.1", timeout=5)
    assert done.returncode == 0
    assert json.loads(done.stdout) == {"ok": False, "error": "address in use"}
    assert json.loads(free.stdout) == {"free": False, "error": "address in use"}


def test_connect_to_a_closed_port_fails_within_the_timeout():
    reach = connect(free_tcp_port(), "1")
    assert reach["ok"] is False and reach["reply_ok"] is False
    assert reach["error"] == "connection refused"
    assert reach["seconds"] < 1


def test_connect_to_something_that_never_replies_times_out_on_the_reply():
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever accepts or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        reach = connect(silent.getsockname()[1], "0.5")
    assert reach["ok"] is True and reach["reply_ok"] is False
    assert reach["error"] == "no reply: timed out"
    assert 0.4 < reach["seconds"] < 1.5


def test_connect_from_an_address_not_on_this_host_is_an_error():
    reach = connect(free_tcp_port(), "1", "--bind", "192.0.2.254")
    assert reach["ok"] is False and reach["error"]


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["facts", "extra"], ["facts", "--bind", "x"], ["facts", "--workdir"],
    ["listen", "80"], ["listen", "http", "5"], ["listen", "70000", "5"], ["listen", "80", "nan"],
    ["connect", "h", "0", "1"], ["free-port"],
])
def test_malformed_command_line_exits_2_with_a_message_on_stderr(argv):
    done = run_stdin(*argv, timeout=10)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("probe: ")
