"""What a job needs on every host, read from its source (mnft.run.needs): the entry point in the synced tree, and
the installed modules it imports, its own project modules followed, optional imports left out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mnft.check.findings import CheckOptions, CheckReport, Need
from mnft.check.rules import evaluate
from mnft.core.errors import InputError
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.inventory import parse
from mnft.run.job import cli_job, recipe_job
from mnft.run.needs import job_needs, module_imports

REPO = Path(__file__).resolve().parent.parent


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def modules(needs) -> dict[str, str]:
    return {n.module: n.where for n in needs.modules}


def test_a_scripts_installed_imports_are_needed_with_the_line_that_imports_them(tmp_path):
    tree = write(tmp_path, {"train.py": """\
        import os, json
        import torch.distributed as dist
        from transformers import Trainer
        import numpy as np
        """})
    needs = job_needs(cli_job(["train.py", "--lr", "1"]), tree, synced=True)
    assert modules(needs) == {"torch": "train.py:2", "transformers": "train.py:3", "numpy": "train.py:4"}  # no stdlib
    assert needs.files == () and needs.read == 1


def test_the_projects_own_modules_are_followed_and_not_needed_as_installed(tmp_path):
    tree = write(tmp_path, {
        "scripts/train.py": "import helpers\nfrom mypkg.models import net\n",
        "scripts/helpers.py": "import peft\n",  # beside the script: sys.path[0] on the host
        "mypkg/__init__.py": "import yaml\n",  # the tree's top: PYTHONPATH on the host
        "mypkg/models/__init__.py": "",
        "mypkg/models/net.py": "from . import layers\nfrom ..util import tool\nimport safetensors\n",
        "mypkg/models/layers.py": "import einops\n",
        "mypkg/util.py": "import accelerate\n",
    })
    needs = job_needs(cli_job(["scripts/train.py"]), tree, synced=True)
    assert set(modules(needs)) == {"peft", "yaml", "safetensors", "einops", "accelerate"}
    assert modules(needs)["einops"] == "mypkg/models/layers.py:1"
    assert not any(n.optional for n in needs.modules)


def test_optional_late_and_type_only_imports_are_not_needed():
    imports, touches = module_imports(textwrap.dedent("""\
        import torch
        try:
            import apex
        except ImportError:
            apex = None
        try:
            import wandb
        except (ModuleNotFoundError, RuntimeError):
            wandb = None
        if TYPE_CHECKING:
            import pandas
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli
        def main():
            import deepspeed
        """))
    assert [i.module for i in imports] == ["torch", "tomllib", "tomli"]
    assert not touches


def test_a_script_that_changes_sys_path_makes_its_misses_warnings(tmp_path):
    tree = write(tmp_path, {"train.py": "import sys\nsys.path.insert(0, 'third_party')\nimport vendored_thing\n"})
    (need,) = job_needs(cli_job(["train.py"]), tree, synced=True).modules
    assert need.module == "vendored_thing" and need.optional
    assert need.problem("h1", "/usr/bin/python3").severity == "warning"


def test_a_module_entry_point_is_read_from_the_tree_or_needed_as_installed(tmp_path):
    tree = write(tmp_path, {"userpkg/__init__.py": "", "userpkg/train.py": "import torch\n"})
    assert modules(job_needs(cli_job(["-m", "userpkg.train"]), tree, synced=True)) == {"torch": "userpkg/train.py:1"}
    assert modules(job_needs(cli_job(["-m", "torchtune.run"]), tree, synced=True)) == {"torchtune": "-m torchtune.run"}


def test_a_package_entry_point_runs_its_main(tmp_path):
    tree = write(tmp_path, {"tool/__init__.py": "import yaml\n", "tool/__main__.py": "import rich\n"})
    assert set(modules(job_needs(cli_job(["-m", "tool"]), tree, synced=True))) == {"yaml", "rich"}


def test_a_missing_entry_point_is_bad_input_and_one_outside_the_tree_is_checked_on_each_host(tmp_path):
    with pytest.raises(InputError, match=r"^nope\.py: no such file in .* \(the tree mnft syncs"):
        job_needs(cli_job(["nope.py"]), tmp_path, synced=True)
    needs = job_needs(cli_job(["/opt/lab/train.py"]), tmp_path, synced=True)
    assert needs.files == ("/opt/lab/train.py",)
    assert job_needs(cli_job(["rel.py"]), tmp_path, synced=False).files == ("rel.py",)


def test_a_recipe_needs_what_its_source_imports_and_what_it_declares():
    needs = modules(job_needs(recipe_job("lora"), REPO, synced=True))
    assert {"torch", "peft", "transformers", "safetensors", "yaml"} <= set(needs)
    assert needs["peft"].startswith("mnft/recipes/")  # found by reading mnft/recipes/lora.py


def test_a_source_that_does_not_parse_needs_nothing_and_does_not_stop_the_run(tmp_path):
    tree = write(tmp_path, {"train.py": "import helper\n", "helper.py": "def broken(:\n"})
    assert job_needs(cli_job(["train.py"]), tree, synced=True).modules == ()


def test_a_job_files_requires_list_is_needed(tmp_path):
    from mnft.run.job import load_job_file

    (tmp_path / "t.py").write_text("print(1)\n")
    job_file = write(tmp_path, {"job.yaml": "script: t.py\nrequires: [flash_attn, deepspeed.ops]\n"}) / "job.yaml"
    needs = modules(job_needs(load_job_file(job_file), tmp_path, synced=True))
    assert set(needs) == {"flash_attn", "deepspeed"} and needs["deepspeed"].endswith(": requires")
    bad = write(tmp_path, {"bad.yaml": "script: t.py\nrequires: ['pip install x']\n"}) / "bad.yaml"
    with pytest.raises(InputError, match=r"bad\.yaml:2: key 'requires': 'pip install x' is not a module name"):
        load_job_file(bad)


def test_a_host_whose_python_lacks_a_needed_module_fails_the_check_naming_host_module_and_fix():
    inv = parse("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n")
    facts = {name: {"python": {"executable": "/opt/env/bin/python"}, "rsync": "/usr/bin/rsync", "modules": {"peft": name == "h1", "yaml": True}}
             for name in ("h1", "h2")}
    options = CheckOptions(network=False, modules=(Need("peft", "mnft/recipes/lora.py:19", "peft"), Need("yaml", "x.py:1", "PyYAML")))
    report = CheckReport(inv, {n: HostResult(n, Status.OK) for n in facts}, facts)
    (problem,) = [p for p in evaluate(inv, facts, report, options) if p.field == "module"]
    assert (problem.host, problem.severity) == ("h2", "error")
    assert problem.message == "peft is not importable by /opt/env/bin/python (imported at mnft/recipes/lora.py:19)"
    assert problem.fix == "add peft to the lock and run `mnft provision` (or install peft into that Python)"


def test_the_probe_tells_which_modules_this_python_resolves_without_importing_them():
    import sys

    from mnft.onhost import facts

    assert facts.modules(["json", "definitely_not_a_module_x", "yaml"]) == {"json": True, "definitely_not_a_module_x": False, "yaml": True}
    assert "definitely_not_a_module_x" not in sys.modules


# ------------------------------------------------------------------------------------------------ the commands

MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]


@pytest.fixture
def project(tmp_path):
    """A user's project outside any git repository, and a one-host local inventory whose workdir is not there yet."""
    proj = write(tmp_path / "proj", {"train.py": "import os\nimport definitely_missing_pkg_x\nprint('trained')\n"})
    inv = tmp_path / "local.yaml"
    inv.write_text(f"hosts:\n  me:\n    connection: local\n    python: {sys.executable}\n    workdir: {tmp_path / 'work'}\n")
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    (tmp_path / "home").mkdir()
    return proj, inv, env


def test_check_with_a_script_names_the_host_the_module_and_the_fix(project):
    proj, inv, env = project
    done = subprocess.run([*MNFT, "check", "--hosts", str(inv), "--no-network", "--", "train.py", "--lr", "1"], cwd=proj, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    text = " ".join(done.stdout.split())
    assert f"me: module: definitely_missing_pkg_x is not importable by {sys.executable} (imported at train.py:2)" in text
    assert "fix: add definitely_missing_pkg_x to the lock and run `mnft provision`" in text


def test_train_refuses_a_job_that_cannot_import_before_anything_is_synced_or_started(project):
    proj, inv, env = project
    done = subprocess.run([*MNFT, "train", "--hosts", str(inv), "--", "train.py"], cwd=proj, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "check failed on me (me: module: definitely_missing_pkg_x is not importable" in done.stderr
    assert not (proj.parent / "work").exists()  # nothing synced, nothing started


def test_train_outside_a_git_repository_syncs_the_current_directory_and_names_it(project):
    proj, inv, env = project
    (proj / "train.py").write_text("import os\nprint('trained on', os.environ['RANK'])\n")
    done = subprocess.run([*MNFT, "train", "--hosts", str(inv), "--", "train.py"], cwd=proj, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = next((proj.parent / "work" / "outputs").iterdir())  # the job's directory: its code, never mnft's checkout
    assert (job / "train.py").is_file() and not (job / "mnft").exists()
    out = " ".join(done.stdout.split())
    assert re.search(rf"code [0-9a-f]{{12}} from {re.escape(str(proj))} \(1 files\)", out) and f"from {proj}" in out.split("finished on every host")[-1]
