"""The `mnft` command from a lab's own repository: bad input is one line and exit 2 with nothing started; the
words after `--` reach every host's command verbatim (shown by --dry-run on the embedded local inventory)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]


@pytest.fixture
def repo(tmp_path):
    """A user's project outside mnft's checkout, with a training script and a job file."""
    project = tmp_path / "project"
    (project / "jobs").mkdir(parents=True)
    (project / "train.py").write_text("print('hello')\n")
    (project / "jobs" / "good.yaml").write_text("script: train.py\nargs: ['--out', '{output_dir}', '--gpus', '{world_size}']\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    return project


def run(repo: Path, tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    (tmp_path / "home").mkdir(exist_ok=True)
    return subprocess.run([*MNFT, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_console_command_is_mnfts_program():
    (script,) = entry_points(group="console_scripts", name="mnft")
    assert script.value == "mnft.cli.main:main"


def test_version_and_help_work_outside_the_checkout(repo, tmp_path):
    from mnft import __version__

    assert run(repo, tmp_path, "--version").stdout.strip() == f"mnft {__version__}"
    helped = run(repo, tmp_path, "--help", "train")
    assert helped.returncode == 0 and "--job" in helped.stdout and "Usage: mnft [--core-opts] train" in helped.stdout


@pytest.mark.parametrize("args, message", [
    (["train", "--", "nope.py"], "nope.py: no such file in "),
    (["train", "--job", "jobs/missing.yaml"], "jobs/missing.yaml: job file not found"),
    (["train", "--job", "jobs/bad.yaml"], "jobs/bad.yaml:2: unknown key 'argz'"),
    (["train", "--job", "jobs/placeholder.yaml"], "unknown placeholder {gpus}"),
    (["train", "--recipe", "lora", "--", "train.py"], "--recipe lora runs mnft's recipe: leave out the script after --"),
    (["train", "--set", "lr=1", "--", "train.py"], "--set is for mnft's recipes"),
    (["train", "--", "-m", "not a module"], "expected a module name"),
    (["train", "--", "--lr", "1"], "not a script path"),
    (["train", "--recipe", "lora", "--set", "max_stepz=5"], "--set: recipe lora: config key 'max_stepz' unknown (did you mean 'max_steps'?)"),
    (["train", "--recipe", "full", "--set", "lr=fast"], "--set: recipe full: config key 'lr' expects a float, got 'fast'"),
    (["train", "--recipe", "lora", "--set", "max_steps=0"], "--set: recipe lora: config key 'max_steps' must be >= 1, got 0"),
    (["train", "--recipe", "lora", "--set", "config=missing.yaml", "--set", "lora_rnak=4"], "config key 'lora_rnak' unknown (did you mean 'lora_rank'?)"),
    (["train", "--gpus", "0", "--", "train.py"], "--gpus 0: a whole number of GPUs per host from 1 to 64"),
    (["train", "--wait", "soon", "--", "train.py"], "--wait 'soon': give seconds from 0 to"),
])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(repo, tmp_path, args, message):
    (repo / "jobs" / "bad.yaml").write_text("script: train.py\nargz: [1]\n")
    (repo / "jobs" / "placeholder.yaml").write_text("script: train.py\nargs: ['{gpus}']\n")
    done = run(repo, tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()  # no run was recorded, nothing was started


@pytest.mark.slow
def test_dry_run_shows_each_hosts_command_with_the_arguments_verbatim_and_placeholders_filled(repo, tmp_path):
    nasty = ["two words", "it's", "$(touch PWNED)", "a;b", "{output_dir}", "checkpointer.checkpoint_files=[model.pt]", "[/b]"]
    done = run(repo, tmp_path, "train", "--dry-run", "--job", "jobs/good.yaml", "--", *nasty, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    command = next(line.strip() for line in done.stdout.splitlines() if "torch.distributed.run" in line)
    argv = shlex.split(command)
    # printed literally (no rich markup eaten) and pasteable: the home as "$HOME", which a shell expands
    assert argv[argv.index("train.py"):] == ["train.py", "--out", "$HOME/.cache/mnft/work/outputs/" + argv[argv.index("--out") + 1].rsplit("/", 1)[1],
                                             "--gpus", "2", *nasty]
    assert not list(repo.rglob("PWNED")) and not (tmp_path / "runs").exists()


def test_a_port_that_answers_but_is_not_ssh_is_one_unreachable_row_without_paramikos_traceback(repo, tmp_path):
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def web():  # a web server where SSH was expected
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    thread = threading.Thread(target=web, daemon=True)
    thread.start()
    inv = tmp_path / "web.yaml"
    inv.write_text(f"hosts:\n  web: {{address: 127.0.0.1, port: {server.getsockname()[1]}}}\n")
    try:
        done = run(repo, tmp_path, "check", "--hosts", str(inv), "--no-network")
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert done.returncode == 4, done.stdout + done.stderr
    assert "web: unreachable: cannot connect to [127.0.0.1]" in done.stdout and "SSH protocol banner" in done.stdout
    assert "Traceback" not in done.stderr and "Exception (client)" not in done.stderr, done.stderr


def test_resume_of_a_script_without_a_resume_rule_is_refused_before_anything_starts(repo, tmp_path):
    first = run(repo, tmp_path, "train", "--", "train.py")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    runs = sorted((tmp_path / "runs").glob("[!.]*"))
    again = run(repo, tmp_path, "train", "--resume")
    assert again.returncode == 2, again.stdout + again.stderr
    message = again.stderr.strip()
    assert len(message.splitlines()) == 1 and "train.py has no resume rule" in message and "start again at step 1" in message
    assert "--resume_from_checkpoint" in message  # the rule that fits an HF Trainer script, as an example
    assert sorted((tmp_path / "runs").glob("[!.]*")) == runs  # no run started, not even recorded


def test_restarts_of_a_script_without_a_resume_rule_are_warned_to_begin_at_step_1(repo, tmp_path):
    shown = run(repo, tmp_path, "train", "--max-restarts", "1", "--dry-run", "--", "train.py")
    assert shown.returncode == 0, shown.stderr
    assert "warning: train.py has no resume rule: a restart after a failure begins again at step 1" in shown.stdout
    with_rule = run(repo, tmp_path, "train", "--max-restarts", "1", "--dry-run", "--job", "jobs/good.yaml")
    assert with_rule.returncode == 0 and "no resume rule" in with_rule.stdout  # good.yaml has none either
