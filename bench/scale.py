#!/usr/bin/env python3
"""Every command at 8, 16, 32 and 64 simulated hosts whose sshd keeps the stock limits (MaxStartups 10:30:100,
MaxSessions 10): check, setup, sync, sync no-op, train of a small user script to its first step, status, logs,
stop; pdsh running `PYTHON -c 'import torch'` on every host as the reference. Issue 20; results in docs/scale.md.

    python bench/scale.py [--sizes 8,16,32,64] [--out /tmp/scale.json] [--plot docs/scale.png] [--goals] [--controller-nice -10]

Per command, each run as the user runs it (`python -m invoke …` in a subprocess, private HOME and MNFT_HOME):
  wall s       from start to exit (train: to rank 0's "step 1/" line; stop: until it returned)
  cpu s        the controller's CPU seconds: user + system of the command and of every child it waited for
               (rsync, ssh), from wait4(); train: of the supervising process until its first step
  rss MB       peak resident memory of the controller process (ru_maxrss; train: VmHWM until stop)
  fds          most file descriptors the controller process held at once (sampled every 50 ms)
  conns        most TCP connections to port 22 any one host held at once (each host's TCP table read every 50 ms
               through its sshd's /proc/PID/net/tcp: the controller's and its peers')
  accepted     most SSH logins any one host accepted during the command (its sshd log)
  throttled    hosts whose sshd reached MaxStartups during the command (its log: "beginning MaxStartups throttling")
The hosts run on this machine's 2 cores: a figure that grows with the hosts' own work (Python start-up, torch
import) measures the test bed, one that grows with the controller's cpu s, fds or conns measures mnft.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

TICK = 0.05
FIRST_STEP = re.compile(r"\bstep 1/")
SCRIPT = '''"""A small user script: one gloo all_reduce a second; rank 0 prints its step; runs until stopped."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1)
step = 0
while True:
    step += 1
    dist.all_reduce(x)
    if rank == 0:
        print(f"step {step}/100000 world {world}", flush=True)
    time.sleep(1)
'''


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of a live process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / _ticks()


def proc_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """Every TICK: the controller's open fds, and each host's TCP connections on port 22 (ESTABLISHED/SYN_RECV)."""

    def __init__(self, cluster: Cluster, pid: int) -> None:
        self.cluster, self.pid = cluster, pid
        self.tables = {h.name: f"/proc/{cluster.sshd_pid(h)}/net/tcp" for h in cluster.hosts}
        self.fds = 0
        self.conns: dict[str, int] = {h: 0 for h in self.tables}
        self.hwm = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
                self.hwm = max(self.hwm, proc_hwm_mb(self.pid))
            except OSError:
                pass
            for name, table in self.tables.items():
                try:
                    lines = Path(table).read_text().splitlines()[1:]
                except OSError:
                    continue
                n = sum(1 for ln in lines if ln.split()[1].endswith(":0016") and ln.split()[3] in ("01", "03"))
                self.conns[name] = max(self.conns[name], n)
            self._stop.wait(TICK)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Logs:
    """sshd log offsets per host, to count what happened during one command."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.offsets = {h.name: self._size(h) for h in cluster.hosts}

    def _size(self, host) -> int:
        path = host.root / "run" / "sshd.log"
        return path.stat().st_size if path.exists() else 0

    def since(self) -> tuple[int, int]:
        """(most logins one host accepted, hosts that reached MaxStartups)."""
        accepted, throttled = 0, 0
        for host in self.cluster.hosts:
            with open(host.root / "run" / "sshd.log", "rb") as f:
                f.seek(self.offsets[host.name])
                text = f.read().decode(errors="replace")
            accepted = max(accepted, text.count("Accepted publickey"))
            throttled += "beginning MaxStartups throttling" in text
        return accepted, throttled


class Bench:
    def __init__(self, n: int, work: Path, pin_neighbours: bool = False, nice: int = 0) -> None:
        self.n = n
        self.nice = nice  # the controller's niceness: on 2 cores shared with 64 hosts it otherwise lacks the CPU of a machine of its own
        self.work = work / f"n{n}"
        self.cluster = Cluster.create(n, self.work / "tb", outsider=False, stock_sshd=True)
        if pin_neighbours:  # see Cluster.pin_neighbours: ARP starves on 2 cores at 64 hosts (a test bed limit)
            self.cluster.pin_neighbours()
        self.inventory = self.cluster.write_inventory(self.work / "inventory.yaml")
        self.project = self.work / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        (self.project / "train_small.py").write_text(SCRIPT)
        # a user's tree of some size: the script beside a copy of a real package (~100 files)
        shutil.copytree(REPO / "mnft", self.project / "lib", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        home = self.work / "home"
        home.mkdir(exist_ok=True)
        self.env = dict(os.environ, HOME=str(home), MNFT_HOME=str(self.work / "mnft-home"), MNFT_RUNS_DIR=str(self.work / "runs"),
                        PYTHONUNBUFFERED="1", COLUMNS="160")

    def invoke(self, *args: str) -> list[str]:
        return [*(["nice", "-n", str(self.nice)] if self.nice else []), sys.executable, "-m", "invoke", "-r", str(REPO), *args]

    def run(self, name: str, argv: list[str], *, ok=(0,), env: dict | None = None) -> dict:
        logs = Logs(self.cluster)
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.project, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sampler = Sampler(self.cluster, proc.pid)
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
        reader.join(timeout=30)
        accepted, throttled = logs.since()
        text = b"".join(out).decode(errors="replace")
        row = {"command": name, "hosts": self.n, "exit": proc.returncode, "wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
               "rss_mb": usage.ru_maxrss / 1024, "fds": sampler.fds, "conns": max(sampler.conns.values()),
               "accepted": accepted, "throttled": throttled}
        if proc.returncode != 0:  # kept for the post-mortem (stop's exit 1 names what it saw remaining)
            row["error" if proc.returncode not in ok else "output"] = text[-3000:]
        print(f"  {name:<12} {fmt_row(row)}", flush=True)
        return row

    def train_until_first_step(self) -> tuple[dict, subprocess.Popen, Sampler, Logs]:
        logs = Logs(self.cluster)
        started = time.monotonic()
        proc = subprocess.Popen(self.invoke("train", "--hosts", str(self.inventory), "--src", str(self.project), "--", "train_small.py"),
                                cwd=self.project, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(self.cluster, proc.pid)
        seen: list[str] = []
        for line in proc.stdout:
            seen.append(line)
            if FIRST_STEP.search(line):
                break
        else:
            raise RuntimeError(f"train on {self.n} hosts reached no first step:\n" + "".join(seen[-60:]))
        row = {"command": "train", "hosts": self.n, "exit": 0, "wall": time.monotonic() - started, "cpu": proc_cpu(proc.pid),
               "rss_mb": proc_hwm_mb(proc.pid), "fds": sampler.fds, "conns": max(sampler.conns.values())}
        accepted, throttled = logs.since()
        row.update(accepted=accepted, throttled=throttled)
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep draining
        print(f"  {'train':<12} {fmt_row(row)}", flush=True)
        return row, proc, sampler, logs

    def pdsh(self) -> dict:
        c = self.cluster
        env = dict(self.env, PDSH_SSH_ARGS_APPEND=" ".join([
            "-F /dev/null", f"-i {c.controller_key}", f"-o UserKnownHostsFile={c.known_hosts}",
            "-o GlobalKnownHostsFile=/dev/null", "-o StrictHostKeyChecking=yes", "-o BatchMode=yes",
            "-o IdentitiesOnly=yes", "-o IdentityAgent=none", "-o ControlMaster=no", "-o ControlPath=none",
        ]))
        argv = ["pdsh", "-R", "ssh", "-f", "32", "-l", "root", "-w", ",".join(h.address for h in c.hosts),
                c.python, "-c", "'import torch'"]
        return self.run("pdsh", argv, env=env)

    def goals(self) -> list[dict]:
        """The commands with a goal relative to pdsh or in seconds (check, sync no-op), each run twice beside pdsh."""
        inv = str(self.inventory)
        rows = [self.pdsh(), self.run("sync", self.invoke("sync", "--hosts", inv, "--src", str(self.project)))]
        for _ in range(2):
            rows += [self.run("check", self.invoke("check", "--hosts", inv, "--json")),
                     self.run("sync no-op", self.invoke("sync", "--hosts", inv, "--src", str(self.project)))]
        return rows + [self.pdsh()]

    def all(self) -> list[dict]:
        inv = str(self.inventory)
        rows = [self.pdsh(), self.run("check", self.invoke("check", "--hosts", inv, "--json")),
                self.run("setup", self.invoke("setup", "--hosts", inv, "--json")),
                self.run("sync", self.invoke("sync", "--hosts", inv, "--src", str(self.project))),
                self.run("sync no-op", self.invoke("sync", "--hosts", inv, "--src", str(self.project)))]
        train, proc, sampler, logs = self.train_until_first_step()
        rows.append(train)
        rows.append(self.run("status", self.invoke("status", "--json"), ok=(0, 1)))
        rows.append(self.run("logs", self.invoke("logs"), ok=(0, 1)))
        rows.append(self.run("stop", self.invoke("stop"), ok=(0, 1)))
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            train["error"] = "train did not end after stop"
        sampler.stop()
        train["rss_mb"] = max(train["rss_mb"], sampler.hwm)
        time.sleep(2)
        left = {h.name: self.cluster.processes(h) for h in self.cluster.hosts}
        left = {name: procs for name, procs in left.items() if procs}
        rows[-1]["left"] = sum(len(p) for p in left.values())
        if left:
            rows[-1]["left_detail"] = {k: [c for _, c in v][:3] for k, v in list(left.items())[:3]}
        print(f"  processes left on the hosts after stop: {rows[-1]['left']}", flush=True)
        return rows

    def close(self) -> None:
        self.cluster.teardown()


def fmt_row(r: dict) -> str:
    return (f"exit {r['exit']:>2}  wall {r['wall']:7.2f} s  cpu {r['cpu']:6.2f} s  rss {r['rss_mb']:6.1f} MB  fds {r['fds']:4d}  "
            f"conns {r['conns']:3d}  accepted {r['accepted']:3d}  throttled {r['throttled']:2d}")


def table(rows: list[dict]) -> str:
    sizes = sorted({r["hosts"] for r in rows})
    pdsh = {r["hosts"]: r["wall"] for r in rows if r["command"] == "pdsh"}
    out = ["| command | metric | " + " | ".join(f"{n} hosts" for n in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    commands = list(dict.fromkeys(r["command"] for r in rows))
    for command in commands:
        by_n = {r["hosts"]: r for r in rows if r["command"] == command}
        for key, label in (("wall", "wall s"), ("ratio", "÷ pdsh"), ("cpu", "cpu s"), ("rss_mb", "rss MB"), ("fds", "fds"),
                           ("conns", "conns"), ("accepted", "accepted"), ("throttled", "throttled"), ("exit", "exit")):
            if key == "ratio" and command == "pdsh":
                continue
            cells = []
            for n in sizes:
                r = by_n.get(n)
                if r is None:
                    cells.append("-")
                elif key == "ratio":
                    cells.append(f"{r['wall'] / pdsh[n]:.2f}" if pdsh.get(n) else "-")
                elif isinstance(r.get(key), float):
                    cells.append(f"{r[key]:.2f}" if key != "rss_mb" else f"{r[key]:.0f}")
                else:
                    cells.append(str(r.get(key, "-")))
            out.append(f"| {command} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["hosts"] for r in rows})
    commands = list(dict.fromkeys(r["command"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for command in commands:
        by_n = {r["hosts"]: r for r in rows if r["command"] == command}
        xs = [n for n in sizes if n in by_n]
        for ax, key in zip(axes, ("wall", "cpu", "rss_mb")):
            ax.plot(xs, [by_n[n][key] for n in xs], marker="o", label=command, linestyle="--" if command == "pdsh" else "-")
    for ax, title in zip(axes, ("wall seconds", "controller CPU seconds", "controller peak RSS (MB)")):
        ax.set_title(title)
        ax.set_xlabel("simulated hosts (stock sshd, 2 cores)")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--work", default=None, help="work directory (default: a new one under /tmp)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG of wall, cpu and rss here")
    parser.add_argument("--pin-from", type=int, default=64, help="static ARP entries (Cluster.pin_neighbours) from this many hosts")
    parser.add_argument("--goals", action="store_true", help="only pdsh, check and sync no-op (twice each): the goals' figures")
    parser.add_argument("--controller-nice", type=int, default=0,
                        help="run every mnft command at this niceness (-10: 64-host train on 2 cores, docs/scale.md)")
    args = parser.parse_args()
    # mnft's modules compiled first, as an installed mnft has them: where PYTHONDONTWRITEBYTECODE is set, a checkout
    # never gets them, and every command would compile what it imports again (0.5 s more for check at 8 hosts)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "mnft")], check=True)
    work = Path(args.work or f"/tmp/mnft-scale-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    Cluster.cleanup_stale()
    rows: list[dict] = []
    for n in (int(s) for s in args.sizes.split(",")):
        print(f"{n} hosts (stock sshd)", flush=True)
        bench = Bench(n, work, pin_neighbours=n >= args.pin_from, nice=args.controller_nice)
        try:
            rows += bench.goals() if args.goals else bench.all()
        finally:
            bench.close()
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
