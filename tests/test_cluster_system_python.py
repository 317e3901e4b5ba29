"""The controller as most lab members run it: Debian's own Python (/usr/bin/python3, 3.11.2 on Debian 12), in a
venv of their own, as a user who is not root, against two test-bed hosts.

On that Python `mnft logs` once failed after every run (tarfile's `filter=` is 3.11.4 up): the suite ran the
controller on a newer Python, as root, only. Here the whole of `mnft train` (sync, launch, gang, collection) and
then `mnft logs` run under it.

How the lab member is made without touching this machine's files: a private mount namespace (`unshare -m`) binds
copies of /etc/passwd and /etc/group that name one more user (`labuser`), and `setpriv` drops to that user before
the controller starts. The venv is Debian's `python3 -m venv --without-pip` (Debian's python3 has no ensurepip
without python3-venv); its packages are the suite's own (the same minor version of Python, so the same compiled
wheels), reached through a .pth line to a bind of their site-packages (root's home, where pyenv keeps them, is
0700). mnft itself is a copy of this checkout's package in the user's own folder, as `pip install` would put it."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
UID = 4321  # labuser: a uid no account on this machine has (checked)


def _system_minor() -> str | None:
    if not os.path.exists(SYSTEM_PYTHON):
        return None
    done = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"], capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or None


class LabMember:
    """A non-root user of this machine with a venv of Debian's Python and mnft in it."""

    def __init__(self, cluster, folder: Path):
        self.cluster, self.dir = cluster, folder
        self.sites = [p for p in dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()]) if os.path.isdir(p)]
        self.binds = [(p, folder / "site" / str(i)) for i, p in enumerate(self.sites)]
        for _, target in self.binds:
            target.mkdir(parents=True)
        passwd = Path("/etc/passwd").read_text()
        if any(line.split(":")[2:3] == [str(UID)] for line in passwd.splitlines()):
            pytest.skip(f"uid {UID} is taken on this machine")
        (folder / "passwd").write_text(passwd.rstrip("\n") + f"\nlabuser:x:{UID}:{UID}:lab member:{folder / 'home'}:/bin/sh\n")
        (folder / "group").write_text(Path("/etc/group").read_text().rstrip("\n") + f"\nlabuser:x:{UID}:\n")
        src = folder / "src"  # mnft as pip would install it, plus the repository files train syncs (--src)
        shutil.copytree(REPO / "mnft", src / "mnft", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("tasks.py", "invoke.yaml", "pyproject.toml"):
            shutil.copy(REPO / name, src / name)
        (folder / "home").mkdir()
        (folder / "runs").mkdir()
        (folder / "leases").mkdir()
        shutil.copy(cluster.controller_key, folder / "id_ed25519")
        shutil.copy(cluster.known_hosts, folder / "known_hosts")
        self.inventory = cluster.write_inventory(folder / "lab.yaml", hosts=cluster.hosts[:2], identity=str(folder / "id_ed25519"),
                                                 known_hosts=str(folder / "known_hosts"))
        subprocess.run(["chown", "-R", f"{UID}:{UID}", str(folder)], check=True)
        os.chmod(folder / "id_ed25519", 0o600)
        venv = folder / "venv"
        made = self.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], timeout=120)
        assert made.returncode == 0, made.stderr
        purelib = next((venv / "lib").glob("python3.*/site-packages"))
        (purelib / "lab.pth").write_text("".join(f"{target}\n" for _, target in self.binds) + f"{src}\n")
        (venv / "bin" / "mnft").write_text(f"#!{venv}/bin/python\nfrom mnft.cli.main import main\nmain()\n")
        os.chmod(venv / "bin" / "mnft", 0o755)
        subprocess.run(["chown", "-R", f"{UID}:{UID}", str(venv)], check=True)

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM", "TZ")}
        home = self.dir / "home"
        return dict(keep, HOME=str(home), USER="labuser", LOGNAME="labuser", PATH=f"{self.dir / 'venv' / 'bin'}:/usr/bin:/bin",
                    MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(self.dir / "runs"), MNFT_LEASE_DIR=str(self.dir / "leases"),
                    PYTHONUNBUFFERED="1", COLUMNS="200")

    def run(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        """argv as labuser, in a mount namespace of its own where labuser exists and the packages are reachable."""
        binds = [("/etc/passwd", self.dir / "passwd"), ("/etc/group", self.dir / "group")]
        script = "set -e\n" + "".join(f'mount --bind "{source}" "{target}"\n' for target, source in binds)
        script += "".join(f'mount --bind "{source}" "{target}"\n' for source, target in self.binds)
        script += f'cd "{self.dir}"\nexec setpriv --reuid={UID} --regid={UID} --clear-groups -- "$@"\n'
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv], env=self.env(),
                              capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def member(healthy_cluster):
    version = _system_minor()
    if version is None:
        pytest.skip(f"no {SYSTEM_PYTHON} on this machine")
    if version.rsplit(".", 1)[0] != "%d.%d" % sys.version_info[:2]:
        pytest.skip(f"{SYSTEM_PYTHON} is {version}: the suite's packages are built for {sys.version_info[0]}.{sys.version_info[1]}")
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs unshare and setpriv (util-linux)")
    folder = Path(tempfile.mkdtemp(prefix="mnft-labuser-"))
    os.chmod(folder, 0o755)
    try:
        yield LabMember(healthy_cluster, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_lab_member_on_debians_python_trains_on_two_hosts_and_collects_the_logs(member):
    who = member.run(["sh", "-c", "id -un; python -c 'import sys, mnft; print(sys.version.split()[0], sys.prefix, mnft.__file__)'"])
    name, line = who.stdout.split("\n")[:2]
    version, prefix, where = line.split()
    assert name == "labuser" and version == _system_minor() and prefix == str(member.dir / "venv"), who.stdout + who.stderr
    assert where.startswith(str(member.dir / "src")), where

    trained = member.run(["mnft", "train", "--hosts", str(member.inventory), "--src", str(member.dir / "src"),
                          "--set", "max_steps=4", "--set", "log_every=2"])
    out = trained.stdout + trained.stderr
    assert trained.returncode == 0, out[-4000:]
    assert "log collection failed" not in out and "Traceback" not in out, out[-4000:]
    assert "where the time went" in out, out[-4000:]  # the time table, printed from the collected logs
    runs = sorted((member.dir / "runs").iterdir())
    run_dir = runs[-1]
    assert (run_dir / "metrics.jsonl").stat().st_size > 0
    for host in ("h1", "h2"):
        assert (run_dir / host / "run" / "output.log").is_file()
        assert (run_dir / host / "run" / "output.log").stat().st_uid == UID  # unpacked by the lab member, as theirs

    (run_dir / "metrics.jsonl").unlink()  # collected again by `mnft logs`
    collected = member.run(["mnft", "logs", run_dir.name])
    out = collected.stdout + collected.stderr
    assert collected.returncode == 0, out[-4000:]
    assert "h1: ok" in out and "h2: ok" in out and "Traceback" not in out, out[-4000:]
    assert (run_dir / "metrics.jsonl").stat().st_size > 0
