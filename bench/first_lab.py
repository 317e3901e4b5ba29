"""The outputs of docs/first-lab.md, from a real run on the simulated cluster (tests/testbed.py): every step of the
walkthrough, from bare hosts to a first two-host run and mnft taken off again, its command and what it printed.

    python3 bench/first_lab.py      (root, as the cluster tests; prints each command and its output)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import testbed  # noqa: E402
from wheelmaker import make_wheel, write_lock  # noqa: E402

TRAIN = '''import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 6):
    x = torch.randn(16, 8); loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
torch.save(model.state_dict(), "model.pt")
dist.destroy_process_group()
'''


def second_member(cluster, work: Path, lock: Path) -> None:
    """docs/first-lab.md's "The second member's first day": ann, a student who is not the admin, at a controller of
    her own (her login, her home: getpass reads $USER and $LOGNAME as on her laptop), with the lab's shared inventory
    that names no user, her own clone of the project, her own known hosts, runs and environment."""
    import shutil

    cluster.add_user("ann", torch=True)  # the admin's useradd on every host, her key in her authorized_keys
    home = work / "ann"
    project = home / "my-project"
    project.mkdir(parents=True)
    (project / "train.py").write_text(TRAIN)
    (home / ".ssh").mkdir(mode=0o700)
    shutil.copy(cluster.controller_key, home / ".ssh" / "id_ed25519")
    shared = cluster.write_inventory(work / "lab-shared.yaml", known_hosts=None, user=None, workdir=None, python=cluster.python,
                                     identity="~/.ssh/id_ed25519")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MNFT_")}
    env.update(HOME=str(home), USER="ann", LOGNAME="ann", COLUMNS="120", PYTHONUNBUFFERED="1")
    print("\n# ---- the second member: ann, at her own controller, with the lab's shared inventory", flush=True)
    print(shared.read_text().replace(str(work), "…"), flush=True)

    def ann(*args: str, cwd: Path = project) -> None:
        print(f"\n$ mnft {' '.join(args)}    (ann, in {str(cwd).replace(str(work), '…')})", flush=True)
        done = subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        print((done.stdout + done.stderr).replace(str(work), "…"), f"[exit {done.returncode}]", sep="")

    inventory = str(shared)
    ann("inventory", "--hosts", inventory)
    ann("check", "--hosts", inventory, "--no-network")
    ann("trust-hosts", "--hosts", inventory)
    ann("check", "--hosts", inventory)
    ann("lab", "--hosts", inventory)
    ann("train", "--hosts", inventory, "--", "train.py")
    ann("runs", cwd=home)
    ann("status", cwd=home)
    ann("provision", "--hosts", inventory, "--lock", str(lock))
    ann("lab", "--hosts", inventory, "--usage")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="mnft-first-lab-"))
    cluster = testbed.Cluster.create(2, work / "cluster")
    try:
        project = work / "my-project"
        project.mkdir()
        (project / "train.py").write_text(TRAIN)
        inv = cluster.write_inventory(project / "lab.yaml", known_hosts=None)
        env = dict(os.environ, MNFT_HOME=str(work / "mnft-home"), MNFT_RUNS_DIR=str(project / "runs"), COLUMNS="120", PYTHONUNBUFFERED="1")
        wheels = work / "wheels"
        make_wheel(wheels, "alpha", "1.0", padding=100_000)
        lock = write_lock(project / "requirements.lock", sorted(wheels.glob("*.whl")), {"alpha": "1.0"}, find_links=wheels,
                          python="%d.%d" % sys.version_info[:2])

        def mnft(*args: str) -> None:
            print(f"\n$ mnft {' '.join(args)}", flush=True)
            done = subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", *args], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=600)
            print((done.stdout + done.stderr).replace(str(work), "…"), f"[exit {done.returncode}]", sep="")

        mnft("inventory", "--hosts", "lab.yaml")
        mnft("check", "--hosts", "lab.yaml", "--no-network")
        mnft("trust-hosts", "--hosts", "lab.yaml")
        mnft("setup", "--hosts", "lab.yaml")
        # the hosts' own Python has torch here: check and train first; then provision, from a lock of one tiny
        # wheel (the test bed has no index to resolve torch from), to show its output and what uninstall removes
        mnft("check", "--hosts", "lab.yaml")
        mnft("train", "--hosts", "lab.yaml", "--", "train.py")
        mnft("logs", "--lines", "5")
        mnft("lab", "--hosts", "lab.yaml")
        second_member(cluster, work, lock)
        mnft("provision", "--hosts", "lab.yaml", "--lock", "requirements.lock", "--dry-run")
        mnft("provision", "--hosts", "lab.yaml", "--lock", "requirements.lock")
        mnft("uninstall", "--hosts", "lab.yaml", "--dry-run")
        mnft("setup", "--hosts", "lab.yaml", "--undo")
        mnft("uninstall", "--hosts", "lab.yaml")
        del inv, lock
    finally:
        cluster.teardown()


if __name__ == "__main__":
    main()
