"""The command line's parsing: `logs`, `status` and `stop` take an optional RUN (default: the latest run)."""

from __future__ import annotations

import pytest
from invoke.exceptions import ParseError
from invoke.parser import Parser

import tasks


def parse(*argv: str) -> dict[str, dict]:
    contexts = Parser(contexts=tasks.ns.to_contexts()).parse_argv(list(argv))
    return {ctx.name: ctx.as_kwargs for ctx in contexts}


@pytest.mark.parametrize("name", ["logs", "status", "stop"])
def test_run_may_be_left_out_and_the_task_gets_its_default(name):
    assert parse(name)[name]["run"] is None


@pytest.mark.parametrize("name", ["logs", "status", "stop"])
def test_run_given_positionally_or_as_a_flag(name):
    assert parse(name, "20261122-185641-a51e")[name]["run"] == "20261122-185641-a51e"
    assert parse(name, "--run", "r1")[name]["run"] == "r1"


def test_flags_before_or_after_the_optional_run():
    only_flag = parse("logs", "-f")["logs"]
    assert only_flag["run"] is None and only_flag["follow"] is True
    assert parse("logs", "-f", "r1")["logs"]["run"] == "r1"
    assert parse("logs", "r1", "-f")["logs"]["follow"] is True


def test_other_tasks_still_parse_after_an_optional_run():
    parsed = parse("logs", "r1", "status")
    assert parsed["logs"]["run"] == "r1" and parsed["status"]["run"] is None


def test_a_required_positional_of_plain_invoke_is_still_required():
    from invoke import Collection, task

    @task(positional=["name"])
    def needs(c, name):
        pass

    with pytest.raises(ParseError, match="did not receive required positional"):
        Parser(contexts=Collection(needs).to_contexts()).parse_argv(["needs"])


# ------------------------------------------------------------------------------------------------ every task's help


def _tasks() -> list[str]:
    return sorted(tasks.ns.task_names)


def help_of(name: str, monkeypatch, capsys, tmp_path) -> tuple[int, str]:
    """`mnft NAME --help`: its exit code and what it printed (in a scratch directory, with a scratch home)."""
    from mnft.cli import parsing
    from mnft.cli.main import program

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(parsing, "_ARGV", None)  # restored: later tests read sys.argv, as `invoke` does
    with pytest.raises(SystemExit) as done:
        program().run(["mnft", name, "--help"])
    said = capsys.readouterr()
    return done.value.code or 0, said.out + said.err


def test_every_task_given_help_prints_its_help_exit_0(monkeypatch, capsys, tmp_path):
    """Issue 45: `mnft logs --help` said "run id '--help': not a run id" and `mnft drain --help` "'--help' is not a
    host of …": an optional RUN or HOST ate the flag. A word starting with '-' is never taken for one."""
    said = {name: help_of(name, monkeypatch, capsys, tmp_path) for name in _tasks()}
    wrong = {name: out for name, (code, out) in said.items() if code != 0 or not out.startswith(f"Usage: mnft [--core-opts] {name} ")}
    assert {"drain", "undrain", "logs", "status", "stop", "wait", "train", "check"} <= set(said) and wrong == {}


def test_no_task_lists_a_flag_without_a_name(monkeypatch, capsys, tmp_path):
    """Issue 45: train listed `--=STRING, --idle-stop=STRING`: invoke gave --idle-stop the short flag '-' (i, d, l, e
    taken). Short flags are letters or digits."""
    wrong = {name: [ln for ln in out.splitlines() if "--=" in ln or ln.lstrip().startswith("-=")]
             for name in _tasks() for out in [help_of(name, monkeypatch, capsys, tmp_path)[1]]}
    assert {name: lines for name, lines in wrong.items() if lines} == {}


def test_a_run_id_or_host_still_comes_positionally_and_a_word_with_a_dash_is_a_flag():
    assert parse("drain", "gpu3", "--reason", "fan")["drain"]["target"] == "gpu3"
    with pytest.raises(ParseError, match="No idea what '--bogus' is"):
        parse("logs", "--bogus")


def test_no_merge_leftover_is_tracked():
    """Issue 45: mnft/cli/tasks.py.orig, a merge's leftover, was committed (and would ship in nothing, but confuse)."""
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=True, timeout=60).stdout
    assert [f for f in tracked.split("\0") if f.endswith((".orig", ".rej", ".BACKUP", ".BASE", ".LOCAL", ".REMOTE"))] == []


# ------------------------------------------------------------------------------------------------ the command's own name


def test_messages_name_the_command_the_user_runs():
    """Issue 36: a person who typed `mnft` was told `invoke trust-hosts …`. One helper decides from how the process
    was started; `invoke` in the checkout (or `python -m invoke`) gets invoke, everything else mnft."""
    from mnft.core.output import program

    assert program("/usr/local/bin/mnft") == "mnft"
    assert program("/root/.pyenv/versions/3.11.7/bin/invoke") == "invoke"
    assert program("inv") == "invoke"
    assert program("/usr/lib/python3/dist-packages/invoke/__main__.py") == "invoke"
    assert program("-c") == "mnft"  # python -c "from mnft.cli.main import main; main()"


def _message_strings():
    """Every string literal in mnft/ that is not a docstring, with where it is."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "mnft"
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                yield f"{path.relative_to(root.parent)}:{node.lineno}", node.value


# Written into the hosts' files as markers (setup finds its blocks by them, and --undo by them): not a message, and
# changing one would orphan the blocks already on the hosts.
MARKERS = ("remove with: invoke setup --undo", "remove with invoke setup --undo", "invoke setup --undo deletes it",
           "invoke setup --undo takes it away", "invoke setup --undo removes it")


def test_no_message_names_invoke_literally_every_one_goes_through_the_helper():
    import re

    said = re.compile(r"(^|[\s`(])invoke (trust-hosts|setup|provision|sync|check|train|logs|status|stop|lab|board|uninstall)\b")
    found = [f"{where}: {text[:80]!r}" for where, text in _message_strings() if said.search(text) and not any(m in text for m in MARKERS)]
    assert found == []


@pytest.mark.parametrize("argv, said", [
    (["check", "--gpus", "2", "--hosts", "inventory/missing.yaml"], "mnft check: No idea what '--gpus' is (its flags: `mnft check --help`)"),
    (["--bogus"], "mnft: No idea what '--bogus' is (its flags: `mnft --help`)"),
])
def test_an_unknown_flag_is_one_line_of_bad_input_exit_2_before_anything_runs(argv, said, tmp_path):
    """Issue 36: `mnft check --gpus 2` was invoke's own message and exit 1. It is mnft's bad input: exit 2, one line
    on stderr, nothing on stdout (the check never started: no table)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", *argv], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(repo), MNFT_RUNS_DIR=str(tmp_path / "runs")))
    assert (done.returncode, done.stdout, done.stderr) == (2, "", said + "\n")


def test_every_hosts_flag_names_every_inventory_format_and_the_real_embedded_inventory():
    """Read in a fresh process: invoke moves a task's help text into its parser when it first parses."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    read = ("import json; from mnft.cli.tasks import ns; "
            "print(json.dumps({n: t.help.get('hosts') for n, t in ns.tasks.items() if 'hosts' in t.help}))")
    done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(repo)))
    helps = json.loads(done.stdout)
    files = {name: h for name, h in helps.items() if "inventory file" in h}
    assert len(files) >= 9 and all("Ansible YAML or INI" in h and "mnft/cli/local.yaml" in h for h in files.values()), helps
    assert (repo / "mnft" / "cli" / "local.yaml").is_file()


def test_every_path_the_docs_name_in_backticks_exists():
    """docs/jobs.md named `mnft/inventories/local.yaml`, which does not exist (issue 36)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    missing = []
    for doc in [*sorted((root / "docs").glob("*.md")), root / "README.md"]:
        for match in re.finditer(r"`((?:mnft|inventory|docs|tests|bench|examples|playbooks)/[A-Za-z0-9_./-]+)`", doc.read_text()):
            path = match.group(1).rstrip(".")
            if not (root / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert missing == []


def test_the_install_works_on_a_system_python_and_never_takes_mnft_from_the_index():
    """Issue 45: on Debian 12's own Python the README's `pip install torch==2.13.0 -e .` failed
    (externally-managed-environment), and the docs said `pip install mnft`, an unrelated package on PyPI. The
    README's first command installs into a venv (python3-venv where ensurepip is missing) and runs that venv's
    Python; no page installs mnft by its name from an index."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    by_name = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?mnft(?![\w/.-])")
    found = [f"{doc.name}: {m.group(0)}" for doc in [*sorted((root / "docs").glob("*.md")), root / "README.md"]
             for m in by_name.finditer(doc.read_text())]
    assert found == []
    first = re.search(r"```\n(.*?)\n```", (root / "README.md").read_text(), re.S).group(1)
    assert "python3-venv" in first and "python3 -m venv ~/mnft-venv" in first
    assert re.findall(r"(\S*)pip install", first) == ["~/mnft-venv/bin/"] and first.endswith("~/mnft-venv/bin/python -m invoke train --recipe lora")
