"""The simulated cluster (testbed), specified by what a multi-host test may rely on."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def ssh(cluster, host, argv, *, timeout=60, options=()):
    return subprocess.run(cluster.ssh_argv(host, argv, options=options), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def on_all(cluster, argv, hosts=None, **kw):
    hosts = hosts or cluster.hosts
    with ThreadPoolExecutor(len(hosts)) as pool:
        return dict(zip([h.name for h in hosts], pool.map(lambda h: ssh(cluster, h, argv, **kw), hosts)))


def tcp_banner(address: str, port: int = 22, timeout: float = 3) -> bytes:
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.settimeout(timeout)
        return s.recv(64)


# ------------------------------------------------------------------------------------------- reachability


def test_every_host_accepts_strict_batch_mode_openssh_with_the_known_hosts_file(cluster):
    results = on_all(cluster, ["hostname"])
    for name, proc in results.items():
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stdout.strip() == name


def test_ssh_argv_quotes_each_remote_word_once(cluster):
    payload = "a b; echo INJECTED $(id) `id` 'q\""
    proc = ssh(cluster, cluster.hosts[0], ["printf", "%s\n", payload])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == payload + "\n"


def test_each_host_serves_its_own_distinct_host_key(cluster):
    keys = [h.host_key_pub for h in cluster.hosts]
    assert len(set(keys)) == len(keys)
    known = cluster.known_hosts.read_text().splitlines()
    assert known == [f"{h.address} {h.host_key_pub}" for h in cluster.hosts]  # plain, not hashed
    for host in cluster.hosts:
        scan = subprocess.run(["ssh-keyscan", "-T", "5", "-t", "ed25519", host.address],
                              capture_output=True, text=True, timeout=20)
        assert scan.stdout.split(None, 1)[1].strip() == host.host_key_pub


def test_controller_key_is_authorized_with_strict_permissions(cluster):
    for host in cluster.hosts:
        ssh_dir = host.home / ".ssh"
        assert (ssh_dir.stat().st_mode & 0o777) == 0o700
        assert ((ssh_dir / "authorized_keys").stat().st_mode & 0o777) == 0o600
    assert (cluster.controller_key.stat().st_mode & 0o777) == 0o600


def test_homes_tmp_and_etc_hosts_are_private_to_each_host(cluster):
    h1, h2 = cluster.hosts[:2]
    marker = f"marker-{uuid.uuid4().hex}"
    proc = ssh(cluster, h1, ["sh", "-c", f"echo from-h1 > ~/{marker} && echo from-h1 > /tmp/{marker}"])
    assert proc.returncode == 0, proc.stderr
    assert (h1.home / marker).read_text() == "from-h1\n"
    assert (h1.root / "tmp" / marker).exists()
    assert not (h2.home / marker).exists()
    assert not Path("/root", marker).exists() and not Path("/tmp", marker).exists()
    assert ssh(cluster, h2, ["test", "-e", f"/root/{marker}"]).returncode == 1
    assert ssh(cluster, h2, ["test", "-e", f"/tmp/{marker}"]).returncode == 1
    # /etc/hosts is a per-host copy of the real one, plus the cluster's names
    hosts_file = ssh(cluster, h2, ["cat", "/etc/hosts"]).stdout
    assert Path("/etc/hosts").read_text().strip() in hosts_file
    assert f"{h1.address}\th1" in hosts_file


def test_run_enters_the_same_view_an_ssh_session_has(cluster):
    host = cluster.hosts[2]
    marker = f"run-{uuid.uuid4().hex}"
    assert ssh(cluster, host, ["touch", marker]).returncode == 0
    proc = cluster.run(host, ["sh", "-c", f'hostname; pwd; echo "$PATH"; ls ~/{marker}; ip -br -4 addr show eth0'])
    name, cwd, path, listed, addr = proc.stdout.splitlines()
    assert (name, cwd, listed) == (host.name, "/root", f"/root/{marker}")
    assert "/root/.pyenv" not in path  # no controller environment leaks in
    assert host.address in addr


def test_run_raises_with_output_on_failure(cluster):
    from testbed import ClusterCommandError

    with pytest.raises(ClusterCommandError) as info:
        cluster.run(cluster.hosts[0], ["sh", "-c", "echo oops >&2; exit 3"])
    assert info.value.returncode == 3 and "oops" in str(info.value)
    assert cluster.run(cluster.hosts[0], ["false"], check=False).returncode == 1


def test_cluster_python_runs_on_every_host_and_imports_torch(cluster):
    code = "import sys, torch; print(sys.executable, torch.__version__)"
    results = on_all(cluster, [cluster.python, "-c", code], timeout=120)
    for name, proc in results.items():
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stdout.split()[0] == cluster.python


def test_python_installation_is_read_only_inside_hosts(cluster):
    prefix = os.path.dirname(os.path.dirname(cluster.python))
    proc = ssh(cluster, cluster.hosts[0], ["touch", f"{prefix}/mnft-testbed-probe"])
    assert proc.returncode != 0 and "Read-only" in proc.stderr
    assert not os.path.exists(f"{prefix}/mnft-testbed-probe")


def test_hosts_reach_each_other_by_address(cluster):
    h1, h2 = cluster.hosts[:2]
    probe = f"exec 3<>/dev/tcp/{h2.address}/22 && head -c 7 <&3"
    assert cluster.run(h1, ["bash", "-c", probe]).stdout == "SSH-2.0"
    # and over ssh, by the names in /etc/hosts
    proc = ssh(cluster, h2, ["bash", "-c", "exec 3<>/dev/tcp/h1/22 && head -c 7 <&3"])
    assert proc.stdout == "SSH-2.0", proc.stderr


def test_outsider_reaches_hosts_but_is_in_no_inventory(cluster, tmp_path):
    out = cluster.outsider
    assert out is not None
    for host in cluster.hosts:
        probe = f"exec 3<>/dev/tcp/{host.address}/22 && head -c 7 <&3"
        assert cluster.run(out, ["bash", "-c", probe]).stdout == "SSH-2.0"
    inventory = cluster.write_inventory(tmp_path / "inv.yaml").read_text()
    assert out.address not in inventory
    assert out.address not in cluster.known_hosts.read_text()
    assert cluster.processes(out) == []


def test_controller_reaches_hosts_through_the_bridge(cluster):
    for host in cluster.hosts:
        assert tcp_banner(host.address).startswith(b"SSH-2.0")
    route = subprocess.run(["ip", "-4", "route", "get", cluster.hosts[0].address], capture_output=True, text=True)
    assert f"dev {cluster.bridge}" in route.stdout and f"src {cluster.bridge_address}" in route.stdout


# ------------------------------------------------------------------------------------------- breaking hosts


def test_regenerated_host_key_is_refused_by_strict_checking(healthy_cluster):
    cluster = healthy_cluster
    host = cluster.hosts[3]
    old = host.host_key_pub
    new = cluster.regenerate_host_key(host)
    assert new != old and host.host_key_pub == new
    proc = ssh(cluster, host, ["true"])
    assert proc.returncode == 255
    assert "Host key verification failed" in proc.stderr
    cluster.restore([host])
    assert ssh(cluster, host, ["true"]).returncode == 0


def test_stopped_sshd_refuses_connections_until_started(healthy_cluster):
    cluster = healthy_cluster
    host = cluster.hosts[2]
    cluster.stop_sshd(host)
    with pytest.raises(ConnectionRefusedError):
        tcp_banner(host.address)
    proc = ssh(cluster, host, ["true"])
    assert proc.returncode == 255 and "refused" in proc.stderr
    assert cluster.run(host, ["hostname"]).stdout.strip() == host.name  # the host itself is still up
    cluster.start_sshd(host)
    assert ssh(cluster, host, ["true"]).returncode == 0


def test_link_down_makes_host_unreachable_and_link_up_restores_it(healthy_cluster):
    cluster = healthy_cluster
    host = cluster.hosts[1]
    cluster.link_down(host)
    with pytest.raises(OSError) as info:  # silence (timeout) or no route: never "refused"
        tcp_banner(host.address, timeout=2)
    assert not isinstance(info.value, ConnectionRefusedError)
    proc = ssh(cluster, host, ["true"], options=["ConnectTimeout=2"])
    assert proc.returncode == 255
    cluster.link_up(host)
    deadline = time.monotonic() + 10
    while ssh(cluster, host, ["true"]).returncode != 0:
        assert time.monotonic() < deadline, "host did not come back after link_up"
        time.sleep(0.2)


def test_processes_lists_what_runs_on_a_host_but_not_its_sshd(healthy_cluster):
    cluster = healthy_cluster
    host = cluster.hosts[0]
    assert cluster.processes(host) == []
    proc = ssh(cluster, host, ["sh", "-c", "nohup sleep 300 >/dev/null 2>&1 & echo $!"])
    pid = int(proc.stdout)
    deadline = time.monotonic() + 10  # `$!` is known at the fork: the child is `sleep 300` once it has exec'd
    while (pid, "sleep 300") not in cluster.processes(host):
        assert time.monotonic() < deadline, cluster.processes(host)
        time.sleep(0.1)
    cluster.kill_strays(host)
    assert cluster.processes(host) == []


# ------------------------------------------------------------------------------------------- inventory


def test_write_inventory_emits_the_mnft_format(cluster, tmp_path):
    import yaml

    h1, h2 = cluster.hosts[:2]
    path = cluster.write_inventory(tmp_path / "inv.yaml", [h2, h1], python={"h2": "/root/fakepy"}, slots=2)
    doc = yaml.safe_load(path.read_text())
    assert list(doc) == ["known_hosts", "vars", "hosts"]
    assert doc["known_hosts"] == str(cluster.known_hosts)
    assert doc["vars"] == {
        "user": "root", "port": 22, "identity": str(cluster.controller_key), "python": cluster.python,
        "iface": "eth0", "workdir": "/root/mnft", "slots": 2, "connection": "ssh",
    }
    assert doc["hosts"] == {"h2": {"address": h2.address, "python": "/root/fakepy"}, "h1": {"address": h1.address}}
    with pytest.raises(ValueError):
        cluster.write_inventory(tmp_path / "bad.yaml", [h1], python={"h9": "x"})


def test_written_inventory_loads_with_mnft_inventory(cluster, tmp_path):
    inventory = pytest.importorskip("mnft.hosts.inventory")
    loaded = inventory.load(cluster.write_inventory(tmp_path / "inv.yaml"))
    assert [h.name for h in loaded.hosts] == [h.name for h in cluster.hosts]


# ------------------------------------------------------------------------------------------- torchrun


ALL_REDUCE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_torchrun_gloo_all_reduce_across_two_hosts(healthy_cluster):
    cluster = healthy_cluster
    hosts = cluster.hosts[:2]
    for host in hosts:
        (host.home / "allreduce.py").write_text(ALL_REDUCE)

    def launch(rank_host):
        rank, host = rank_host
        argv = ["env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1", cluster.python, "-m", "torch.distributed.run",
                "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}", f"--master_addr={hosts[0].address}",
                "--master_port=29500", "allreduce.py"]
        return ssh(cluster, host, argv, timeout=180)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(launch, enumerate(hosts)))
    for host, proc in zip(hosts, results):
        assert proc.returncode == 0, (host.name, proc.stdout, proc.stderr[-3000:])
    assert "rank=0 world=2 sum=3" in results[0].stdout
    assert "rank=1 world=2 sum=3" in results[1].stdout


# ------------------------------------------------------------------------------------------- lifecycle


def _leftovers(prefix: str) -> tuple[list[str], list[str]]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ([l for l in ns.splitlines() if l.startswith(prefix + "-")],
            [l for l in links.splitlines() if f" {prefix}-" in l])


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: its parent, maybe pid 1, just has not collected it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_teardown_leaves_no_namespace_link_or_process_and_is_idempotent(fresh_cluster_factory):
    fresh = fresh_cluster_factory(2, outsider=True)
    host = fresh.hosts[0]
    stray = int(ssh(fresh, host, ["sh", "-c", "nohup sleep 300 >/dev/null 2>&1 & echo $!"]).stdout)
    fresh.popen(fresh.outsider, ["sleep", "300"])
    outsiders: list[int] = []
    for _ in range(100):  # the child enters the namespace just after the fork: wait until it is there
        outsiders = [pid for pid, cmd in fresh.processes(fresh.outsider) if "sleep" in cmd]
        if outsiders:
            break
        time.sleep(0.05)
    pids = [stray, fresh.sshd_pid(host), fresh.sshd_pid(fresh.hosts[1]), *outsiders]
    assert all(_alive(p) for p in pids) and len(pids) == 4
    fresh.teardown()
    assert _leftovers(fresh.prefix) == ([], [])
    assert [p for p in pids if _alive(p)] == []
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    assert str(fresh.workdir) not in ps
    fresh.teardown()  # idempotent, silent


def test_an_address_of_a_cluster_already_gone_fails_at_once_instead_of_leaving_the_machine(testbed, fresh_cluster_factory):
    import socket

    fresh = fresh_cluster_factory(1)
    gone = fresh.hosts[0].address
    fresh.teardown()
    route = subprocess.run(["ip", "-4", "route", "get", gone], capture_output=True, text=True)
    assert route.returncode != 0 and "via" not in route.stdout  # never the default route
    with pytest.raises(OSError) as err:
        socket.create_connection((gone, 22), timeout=10)
    assert err.value.errno == errno.EINVAL  # dropped by the blackhole route at once, not a timeout
    assert testbed.RANGE_BLACKHOLE in subprocess.run(["ip", "-4", "route", "show", "type", "blackhole"], capture_output=True, text=True).stdout


def test_two_clusters_coexist_on_distinct_names_and_subnets(cluster, fresh_cluster_factory):
    fresh = fresh_cluster_factory(1)
    assert fresh.prefix != cluster.prefix and fresh.subnet != cluster.subnet
    assert ssh(fresh, fresh.hosts[0], ["hostname"]).stdout.strip() == "h1"
    assert ssh(cluster, cluster.hosts[0], ["hostname"]).returncode == 0


def test_a_prefix_in_use_is_refused_and_the_cluster_that_has_it_keeps_running(testbed, cluster, tmp_path):
    # a fresh cluster that drew the session cluster's prefix (random seeded by a test) once tore the session's down
    with pytest.raises(testbed.ClusterError, match="already exist"):
        testbed.Cluster.create(1, tmp_path / "twin", prefix=cluster.prefix)
    assert ssh(cluster, cluster.hosts[0], ["hostname"]).stdout.strip() == "h1"


def test_a_default_prefix_does_not_follow_a_seeded_random(testbed):
    import random

    def drawn():
        random.seed(42)
        return [testbed._default_prefix() for _ in range(5)]

    assert drawn() != drawn()


def test_cleanup_stale_removes_a_crashed_run_but_not_live_clusters(testbed, cluster, tmp_path):
    Cluster = testbed.Cluster

    prefix = "mnftz" + uuid.uuid4().hex[:4]
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from testbed import Cluster
        Cluster.create(2, Path({str(tmp_path)!r}), prefix={prefix!r})
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert Cluster.cleanup_stale() == []  # its creator still runs
        assert _leftovers(prefix) != ([], [])
    finally:
        child.kill()  # a crash: no teardown, no atexit
        child.wait()
    assert prefix in Cluster.cleanup_stale()
    assert _leftovers(prefix) == ([], [])
    assert ssh(cluster, cluster.hosts[0], ["true"]).returncode == 0  # the live session cluster is untouched


@pytest.mark.slow
@pytest.mark.parametrize("n_hosts", [4, 32])
def test_create_and_teardown_timing(testbed, tmp_path, n_hosts, capsys):
    Cluster = testbed.Cluster

    start = time.monotonic()
    built = Cluster.create(n_hosts, tmp_path, outsider=True)
    created = time.monotonic() - start
    try:
        last = built.hosts[-1]
        assert ssh(built, last, ["hostname"]).stdout.strip() == last.name
    finally:
        start = time.monotonic()
        built.teardown()
        removed = time.monotonic() - start
    with capsys.disabled():
        print(f"\n[testbed] {n_hosts} hosts: create {created:.2f}s, teardown {removed:.2f}s")
    assert _leftovers(built.prefix) == ([], [])


def test_prerequisites_fail_early_with_a_clear_reason_when_not_root(monkeypatch):
    import testbed

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(testbed.ClusterUnavailable, match="root"):
        testbed.check_prerequisites()
    with pytest.raises(testbed.ClusterUnavailable, match="root"):
        testbed.Cluster.create(1, Path("/nonexistent"))


def test_an_added_user_logs_in_and_gets_root_through_sudo_with_its_password_only(fresh_cluster_factory):
    import shutil

    if shutil.which("sudo") is None:
        pytest.skip("sudo is not installed on this machine")
    cluster = fresh_cluster_factory(1)
    host = cluster.hosts[0]
    passwd = Path("/etc/passwd").read_text()
    assert cluster.add_user("lab", password="pw two words", sudo=True) == "/tmp/home-lab"
    assert Path("/etc/passwd").read_text() == passwd  # the machine's own file is untouched
    who = subprocess.run(cluster.ssh_argv(host, ["id", "-un"], user="lab"), capture_output=True, text=True, timeout=30)
    assert who.stdout.strip() == "lab", who.stderr
    sudo = ["sudo", "-k", "-S", "-p", "", "id", "-u"]
    good = subprocess.run(cluster.ssh_argv(host, sudo, user="lab"), input="pw two words\n", capture_output=True, text=True, timeout=30)
    assert good.stdout.strip() == "0", good.stderr
    bad = subprocess.run(cluster.ssh_argv(host, sudo, user="lab"), input="wrong\n", capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and bad.stdout.strip() != "0"


def test_a_shared_dir_is_one_directory_in_the_chosen_hosts_and_the_rest_of_their_homes_stays_private(fresh_cluster_factory):
    """shared_dirs: a lab's NFS data (or scratch) mount, the homes private."""
    cluster = fresh_cluster_factory(3, shared_dirs={"~/data": ("h1", "h2"), "/tmp/scratch": ("h2", "h3")})
    h1, h2, h3 = cluster.hosts
    cluster.run(h1, ["sh", "-c", "echo one > /root/data/f && echo mine > /root/own"])
    cluster.run(h3, ["sh", "-c", "echo two > /tmp/scratch/g"])
    assert cluster.run(h2, ["cat", "/root/data/f", "/tmp/scratch/g"]).stdout == "one\ntwo\n"
    assert (cluster.shared_dir("~/data") / "f").read_text() == "one\n"  # the one directory, on this machine
    assert cluster.run(h3, ["ls", "/root/data"], check=False).returncode != 0  # not h3's
    assert cluster.run(h1, ["ls", "/tmp/scratch"], check=False).returncode != 0  # nor h1's
    assert cluster.run(h2, ["cat", "/root/own"], check=False).returncode != 0  # the homes stay private


@pytest.mark.parametrize("path, names, why", [
    ("/data", ("h1",), "under the home"),  # a mount point there would be made on this machine
    ("~/../etc", ("h1",), "under the home"),
    ("~/d", "h1", "sequence of host names"),
])
def test_a_shared_dir_outside_the_hosts_own_directories_is_refused(testbed, tmp_path, path, names, why):
    with pytest.raises(ValueError, match=why):
        testbed.Cluster(prefix="mnftx", workdir=tmp_path, shared_dirs={path: names})


def test_a_shared_dir_for_a_host_the_cluster_does_not_have_is_refused(testbed, tmp_path):
    with pytest.raises(ValueError, match="hosts this cluster does not have: h3"):
        testbed.Cluster.create(2, tmp_path, outsider=False, shared_dirs={"~/data": ("h1", "h3")})


def test_a_checkout_under_tmp_is_seen_by_the_hosts_at_its_own_path_read_only(testbed, fresh_cluster_factory, monkeypatch, tmp_path):
    """Every host has a private /tmp: a fresh clone there (CI, a new user) would be out of the hosts' sight, and their
    Python imports mnft from it (the editable install). The test bed binds it in, read-only, at the same path."""
    checkout = tmp_path / "clone"  # pytest's tmp_path lies under /tmp
    (checkout / "mnft").mkdir(parents=True)
    (checkout / "mnft" / "__init__.py").write_text("seen = True\n")
    monkeypatch.setattr(testbed, "_project_paths", lambda: [str(checkout)])
    cluster = fresh_cluster_factory(1)
    h1 = cluster.hosts[0]
    seen = cluster.run(h1, [cluster.python, "-c", "import mnft; print(mnft.seen, mnft.__file__)"], env={"PYTHONPATH": str(checkout)})
    assert seen.stdout.split() == ["True", str(checkout / "mnft" / "__init__.py")]
    written = cluster.run(h1, ["touch", str(checkout / "mnft" / "x")], check=False)
    assert written.returncode != 0 and not (checkout / "mnft" / "x").exists()
