"""A job is data: the command line and job files give one value; plan() turns it into per-host torchrun argv."""

from __future__ import annotations

from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.hosts import inventory
from mnft.run import launch
from mnft.run.job import cli_job, from_record, load_job_file, recipe_job
from mnft.run.launch import LaunchOptions

INV = inventory.parse("vars: {slots: 2, python: /opt/py/bin/python, workdir: /srv/w}\nhosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n")
NASTY = ["two words", "it's \"quoted\"", "$(touch /tmp/PWNED)", "a;b", "line1\nline2", "`id`", "{output_dir}", "--lr=1e-4", ""]


def plan(job, inv=INV, **options):
    return launch.plan(inv, master_addr="10.0.0.1", port=29500, run_id="R2", job_id="J1", options=LaunchOptions(job=job, **options),
                       ifaces={}, env={}, secret_names=(), latest_checkpoint=options.pop("latest", None) if "latest" in options else None)


def plan_resumed(job, latest):
    return launch.plan(INV, master_addr="10.0.0.1", port=29500, run_id="R2", job_id="J1", options=LaunchOptions(job=job, resume=True),
                       ifaces={}, env={}, secret_names=(), latest_checkpoint=latest)


def entry_of(argv: tuple[str, ...]) -> list[str]:
    """What torchrun runs: mnft's launch wrapper in the run directory (mnft.onhost.entry), then the job's entry point
    and arguments, everything after its --log-dir option."""
    wrapper = argv[argv.index("--log-dir") + 2]
    assert wrapper == argv[argv.index("--log-dir") + 1].rsplit("/", 1)[0] + "/entry.py"  # <run_dir>/entry.py
    return list(argv[argv.index("--log-dir") + 3:])


# ------------------------------------------------------------------------------------------ the command line


def test_a_script_and_its_arguments_reach_torchrun_verbatim_after_mnfts_flags():
    a, b = plan(cli_job(["train.py", *NASTY]))
    assert entry_of(a.argv) == ["train.py", *NASTY] and entry_of(b.argv) == ["train.py", *NASTY]
    assert a.argv[:3] == ("/opt/py/bin/python", "-m", "torch.distributed.run")
    assert a.argv[a.argv.index("--node-rank") + 1] == "0" and b.argv[b.argv.index("--node-rank") + 1] == "1"
    assert a.cwd == "/srv/w/outputs/J1"  # a relative script is relative to the job's copy of the synced tree


def test_a_module_entry_point_is_passed_with_dash_m():
    (a, _) = plan(cli_job(["-m", "pkg.train", "--epochs", "2"]))
    assert entry_of(a.argv) == ["-m", "pkg.train", "--epochs", "2"]


@pytest.mark.parametrize("argv, message", [
    ([], "nothing after --"),
    (["--lr", "1"], "not a script path"),
    (["-m"], "expected a module name"),
    (["-m", "pkg/train.py"], "expected a module name"),
])
def test_a_bad_entry_point_is_refused(argv, message):
    with pytest.raises(InputError, match=message):
        cli_job(argv)


def test_the_recipes_are_jobs_like_any_other():
    (a, _) = plan(recipe_job("lora", ("lr=1e-4",)))
    assert entry_of(a.argv) == ["-m", "mnft.recipes.lora", "output_dir=/srv/w/outputs/J1", "lr=1e-4"]
    assert a.metrics == "/srv/w/outputs/J1/metrics.jsonl"
    (r, _) = plan_resumed(recipe_job("lora"), None)
    assert entry_of(r.argv)[-1] == "resume=latest"  # a recipe finds its own latest checkpoint


# ------------------------------------------------------------------------------------------ job files


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


HF_JOB = """\
name: clm
script: examples/run_clm.py
args: [--output_dir, "{output_dir}", --per_device_train_batch_size, 4, --num_gpus, "{world_size}", "--seed={job_id}"]
env: {WANDB_MODE: disabled, IS_TORCHRUN: 1}
pass_env: [HF_TOKEN]
resume:
  layout: hf
  args: [--resume_from_checkpoint, "{latest_checkpoint}"]
  exit_codes: [124]
metrics: hf
torchrun: [--monitor-interval, "1"]
"""


def test_a_job_file_fills_in_placeholders_per_host(tmp_path):
    job = load_job_file(write(tmp_path, HF_JOB)).with_extra(("--max_steps", "{not a placeholder}"))
    a, b = plan(job)
    assert entry_of(a.argv) == ["examples/run_clm.py", "--output_dir", "/srv/w/outputs/J1", "--per_device_train_batch_size", "4",
                                "--num_gpus", "4", "--seed=J1", "--max_steps", "{not a placeholder}"]
    assert a.argv[a.argv.index("--log-dir") - 2:a.argv.index("--log-dir")] == ("--tee", "3")
    assert a.argv[a.argv.index("--monitor-interval") + 1] == "1" and a.argv.index("--monitor-interval") < a.argv.index("--max-restarts")
    assert a.env["WANDB_MODE"] == "disabled" and a.env["IS_TORCHRUN"] == "1" and a.env["MNFT_OUTPUT_DIR"] == "/srv/w/outputs/J1"
    assert job.pass_env == ("HF_TOKEN",) and job.resume.exit_codes == (124,)


def test_resume_arguments_are_passed_only_with_a_complete_checkpoint(tmp_path):
    job = load_job_file(write(tmp_path, HF_JOB))
    (fresh, _) = plan_resumed(job, None)
    assert "--resume_from_checkpoint" not in fresh.argv  # HF raises when told to resume with no checkpoint
    (resumed, _) = plan_resumed(job, "checkpoint-40")
    assert entry_of(resumed.argv)[-2:] == ["--resume_from_checkpoint", "/srv/w/outputs/J1/checkpoint-40"]


def test_a_job_survives_the_run_record(tmp_path):
    job = load_job_file(write(tmp_path, HF_JOB)).with_extra(("x y",))
    assert from_record(job.to_record()) == job
    assert from_record(recipe_job("full", ("lr=2",)).to_record()) == recipe_job("full", ("lr=2",))


@pytest.mark.parametrize("text, message", [
    ("script: a.py\nargz: [1]\n", r"job.yaml:2: unknown key 'argz' \(did you mean 'args'\?\)"),
    ("script: a.py\nargs: ['{outptu_dir}']\n", r"unknown placeholder \{outptu_dir\}"),
    ("script: a.py\nargs: ['{output_dir']\n", "bad placeholder"),
    ("script: a.py\nargs: ['{world_size:>4}']\n", "bad placeholder"),
    ("script: a.py\nargs: ['{latest_checkpoint}']\n", "known only when resuming"),
    ("script: a.py\nresume: {args: ['{latest_checkpoint}']}\n", "set resume.layout"),
    ("script: a.py\nresume: {layout: hf, args: ['--resume={latest_checkpoint']}\n", "bad placeholder"),
    ("script: a.py\nmodule: b\n", "exactly one of 'script', 'module' or 'recipe'"),
    ("args: [a]\n", "exactly one of"),
    ("script: a.py\nenv: {HF_TOKEN: abc}\n", "HF_TOKEN is a secret"),
    ("script: a.py\nenv: {'1X': a}\n", "not a variable name"),
    ("script: a.py\nargs: --lr 1\n", "expected a list of arguments"),
    ("script: a.py\ntorchrun: [--nnodes, '4']\n", "--nnodes is set by mnft"),
    ("script: a.py\ntorchrun: ['--master_port=1']\n", "--master_port is set by mnft"),
    ("script: a.py\nresume: {layout: glob}\n", "needs 'pattern'"),
    ("script: a.py\nresume: {layout: newest}\n", "resume.layout 'newest'"),
    ("script: a.py\nresume: {exit_codes: [0]}\n", "exit codes 1-255"),
    ("script: a.py\nmetrics: {format: regex, regex: 'loss (\\d+'}\n", "metrics.regex"),
    ("script: a.py\nmetrics: {format: regex, regex: 'step (?P<step>\\d+)'}\n", "named group 'loss'"),
    ("script: a.py\nmetrics: tensorboard\n", "needs 'path'"),
    ("script: a.py\nelastic: maybe\n", "expected true or false"),
    ("- a.py\n", "a job file is a mapping"),
    ("script: a.py\nscript: b.py\n", "duplicate key"),
])
def test_a_bad_job_file_is_one_line_naming_the_file(tmp_path, text, message):
    with pytest.raises(InputError, match=message) as err:
        load_job_file(write(tmp_path, text))
    assert str(err.value).startswith(str(tmp_path / "job.yaml")) and "\n" not in str(err.value)


def test_a_missing_job_file_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="job file not found"):
        load_job_file(tmp_path / "nope.yaml")


def test_literal_braces_are_written_twice(tmp_path):
    job = load_job_file(write(tmp_path, "script: a.py\nargs: ['--cfg={{\"bs\": {world_size}}}']\n"))
    (a, _) = plan(job)
    assert entry_of(a.argv)[-1] == '--cfg={"bs": 4}'


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parent.parent / "examples" / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_example_job_is_valid_and_plans(path):
    job = load_job_file(path)
    a, b = plan(job)
    assert entry_of(a.argv)[0] == job.entry[0] and "{" not in " ".join(a.argv)
