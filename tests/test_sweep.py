"""Issue 43: a sweep's points, each point's job, where the next points start, the table, dependencies (pure), and a
whole sweep on this machine (a local inventory: its supervisor is a process of this machine's user)."""

from __future__ import annotations

import json

import pytest

from mnft.core.errors import InputError
from mnft.run import after, sweep, sweepspec
from mnft.run.job import PLACEHOLDERS, cli_job, load_job_file

RESERVED = frozenset(PLACEHOLDERS)


# ------------------------------------------------------------------------------------------------ the points


def test_sweep_flags_make_every_combination_the_first_key_varying_slowest():
    spec = sweepspec.from_flags(("lr=1e-4,3e-4", "seed=1,2"), RESERVED)
    assert spec.keys == ("lr", "seed")
    assert spec.values() == [{"lr": "1e-4", "seed": "1"}, {"lr": "1e-4", "seed": "2"}, {"lr": "3e-4", "seed": "1"}, {"lr": "3e-4", "seed": "2"}]
    assert sweepspec.from_flags((), RESERVED) is None


@pytest.mark.parametrize("flags,said", [
    (("lr",), "--sweep lr: write KEY=V1,V2"),
    (("lr=",), "--sweep lr=: an empty value"),
    (("lr=1,,2",), "an empty value"),
    (("lr=1,1",), "a value given twice"),
    (("lr=1", "lr=2"), "key 'lr' given twice"),
    (("run_id=1,2",), "sweep key 'run_id' is a placeholder mnft fills itself"),
    (("l-r=1",), "sweep key 'l-r': a word of letters"),
])
def test_a_malformed_sweep_flag_is_one_line_naming_it(flags, said):
    with pytest.raises(InputError) as err:
        sweepspec.from_flags(flags, RESERVED)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_job_files_sweep_is_a_grid_or_a_list_of_points_with_the_metric_that_names_the_best(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("script: train.py\nargs: [--lr, '{lr}', --out, '{output_dir}']\nenv: {SEED: '{seed}'}\n"
                   "sweep:\n  grid: {lr: [1e-4, 3e-4], seed: [1, 2]}\n  metric: eval_loss\n  max_parallel: 2\n")
    loaded = load_job_file(job)
    assert loaded.sweep.values()[1] == {"lr": "1e-4", "seed": "2"} and loaded.sweep.metric == "eval_loss" and loaded.sweep.max_parallel == 2
    point = sweep.point_job(loaded, {"lr": "3e-4", "seed": "7"})
    assert point.args == ("--lr", "3e-4", "--out", "{output_dir}") and dict(point.env) == {"SEED": "7"}  # the run's own placeholders stay
    job.write_text("script: train.py\nargs: ['{lr}']\nsweep:\n  points: [{lr: 1}, {lr: 5}]\n  goal: max\n")
    assert [p["lr"] for p in load_job_file(job).sweep.values()] == ["1", "5"] and load_job_file(job).sweep.goal == "max"


@pytest.mark.parametrize("text,said", [
    ("sweep: {grid: {lr: [1]}, points: [{lr: 1}]}", "give exactly one of grid:"),
    ("sweep: {grid: {lr: []}}", "sweep.grid.lr: an empty list"),
    ("sweep: {points: [{lr: 1}, {seed: 2}]}", "every point sets the same keys"),
    ("sweep: {grid: {lr: [1]}, goal: best}", "goal: 'best': min (lower is better) or max"),
    ("sweep: {grid: {lr: [1]}, max_parallel: 0}", "max_parallel: '0': a whole number ≥ 1"),
    ("sweep: {grid: {lr: [1]}, every: 2}", "unknown key 'every'"),
])
def test_a_bad_sweep_in_a_job_file_is_one_line_naming_the_file_and_key(tmp_path, text, said):
    job = tmp_path / "job.yaml"
    job.write_text("script: train.py\nargs: ['{lr}']\n" + text + "\n")
    with pytest.raises(InputError) as err:
        load_job_file(job)
    assert said in str(err.value) and str(job) in str(err.value)


def test_a_key_no_placeholder_uses_is_refused_as_every_point_would_run_the_same():
    job = cli_job(("train.py", "--lr", "{lr}"))
    sweep.check_used(job, sweepspec.from_flags(("lr=1,2",), RESERVED), "--sweep")
    with pytest.raises(InputError) as err:
        sweep.check_used(job, sweepspec.from_flags(("lr=1,2", "seed=1,2"), RESERVED), "--sweep")
    assert "key 'seed': no {seed} in the job's arguments" in str(err.value) and "--seed {seed}" in str(err.value)


def test_a_points_values_fill_only_the_sweeps_placeholders_of_command_line_words_kept_otherwise_verbatim():
    job = cli_job(("train.py", "--lr={lr}", '{"a": 1}', "{run_id}", "x{lr}y"))
    point = sweep.point_job(job, {"lr": "3e-4"})
    assert point.extra_args == ("--lr=3e-4", '{"a": 1}', "{run_id}", "x3e-4y")


def test_point_ids_are_the_sweeps_id_and_a_number_of_one_width():
    assert sweep.point_id("S", 3, 6) == "S-03" and sweep.point_id("S", 7, 120) == "S-007"
    assert [p["run_id"] for p in sweep.new_points("S", sweepspec.from_flags(("lr=1,2",), RESERVED))] == ["S-01", "S-02"]


# ------------------------------------------------------------------------------------------------ where points start


def test_points_start_on_the_hosts_with_the_most_free_gpus_up_to_the_room_left():
    starts = sweep.plan_starts([1, 2, 3, 4, 5, 6], 4, ["h1", "h2"], {"h1": 4, "h2": 4}, {"h1": 4, "h2": 4}, 1, {})
    assert starts == [(1, "h1"), (2, "h2"), (3, "h1"), (4, "h2")]


def test_with_no_free_gpu_one_point_waits_in_each_hosts_line_and_no_more():
    starts = sweep.plan_starts([5, 6, 7], 10, ["h1", "h2"], {"h1": 0, "h2": 0}, {"h1": 4, "h2": 4}, 1, {})
    assert starts == [(5, "h1"), (6, "h2")]
    assert sweep.plan_starts([5, 6, 7], 10, ["h1", "h2"], {"h1": 0, "h2": 0}, {"h1": 4, "h2": 4}, 1, {"h1": 1, "h2": 1}) == []
    assert sweep.plan_starts([5], 10, ["h1", "h2"], {"h1": 0, "h2": 0}, {"h1": 4, "h2": 4}, 1, {}, may_wait={"h1": 0, "h2": 1}) == [(5, "h2")]


def test_a_rerun_point_pinned_to_the_host_of_its_checkpoints_starts_only_there_and_holds_up_no_other():
    starts = sweep.plan_starts([1, 2], 2, ["h1", "h2"], {"h1": 0, "h2": 4}, {"h1": 4, "h2": 4}, 1, {"h1": 1}, pinned={1: "h1"})
    assert starts == [(2, "h2")]  # point 1 waits for h1 (one of the sweep's points already waits there); point 2 goes on
    assert sweep.plan_starts([1], 1, ["h1", "h2"], {"h1": 1, "h2": 4}, {"h1": 4, "h2": 4}, 1, {}, pinned={1: "h1"}) == [(1, "h1")]


def test_a_whole_host_point_needs_every_device_free_and_a_host_too_small_is_never_picked():
    assert sweep.plan_starts([1, 2], 2, ["h1", "h2"], {"h1": 3, "h2": 4}, {"h1": 4, "h2": 4}, None, {"h1": 1, "h2": 1}) == [(1, "h2")]
    assert sweep.plan_starts([1], 1, ["h1"], {"h1": 2}, {"h1": 2}, 4, {}) == []


# ------------------------------------------------------------------------------------------------ the table


def test_a_points_row_has_its_values_state_gpus_step_last_and_best_metric_and_time():
    point = {"index": 2, "values": {"lr": "3e-4"}, "run_id": "S-02", "state": "running"}
    record = {"state": "running", "devices": {"h1": [3]}, "created": 100.0}
    metrics = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": 1.5}]
    row = sweep.point_row(point, record, metrics, "loss", "min", now=130.0)
    assert (row["where"], row["step"], row["last"], row["best"], row["seconds"]) == ("h1: GPU 3", 3, 1.5, 1.0, 30.0)
    pending = sweep.point_row({"index": 3, "values": {}, "run_id": "S-03", "state": "pending"}, None, [], "loss", "min")
    assert pending["state"] == "pending" and pending["seconds"] is None
    rows = [row, dict(row, run_id="S-01", best=0.5), dict(row, run_id="S-03", best=None)]
    assert sweep.best_row(rows, "min")["run_id"] == "S-01" and sweep.best_row(rows, "max")["run_id"] == "S-02"


def test_a_sweep_succeeds_when_every_point_did_and_fails_when_one_did_not():
    assert sweep.sweep_state([{"state": "succeeded"}, {"state": "running"}]) == "running"
    assert sweep.sweep_state([{"state": "succeeded"}, {"state": "succeeded"}]) == "succeeded"
    assert sweep.sweep_state([{"state": "succeeded"}, {"state": "failed"}]) == "failed"
    assert sweep.sweep_state([{"state": "stopped"}, {"state": "succeeded"}], stopping=True) == "stopped"
    assert sweep.summary([{"state": "succeeded"}, {"state": "failed"}, {"state": "succeeded"}]) == "3 point(s): 2 succeeded, 1 failed"


def test_resume_run_of_a_sweep_runs_again_only_the_points_that_did_not_succeed_each_from_its_own_record():
    data = {"sweep": {"keys": ["lr"], "metric": "loss", "goal": "min", "points": [
        {"index": 1, "values": {"lr": "1"}, "run_id": "S-01", "state": "succeeded", "started": 1.0},
        {"index": 2, "values": {"lr": "2"}, "run_id": "S-02", "state": "failed", "started": 1.0},
        {"index": 3, "values": {"lr": "3"}, "run_id": "S-03", "state": "stopped"}]}}
    spec, again = sweep.rerun_of(data, resumable=True)
    assert [(p["index"], p["resume_from"]) for p in again] == [(2, "S-02"), (3, None)]  # a point never started starts afresh
    record = sweep.SweepRun(spec, rerun=again, count=3).record("T")
    assert [(p["run_id"], p["rerun_of"]) for p in record["points"]] == [("T-02", "S-02"), ("T-03", "S-03")]
    assert [p["resume_from"] for p in sweep.rerun_of(data, resumable=False)[1]] == [None, None]


# ------------------------------------------------------------------------------------------------ --after


def test_after_starts_once_the_run_succeeded_or_with_any_once_it_ended_and_names_a_failed_one():
    assert after.verdict({"run_id": "R"}, "running") == (False, None)
    assert after.verdict({"run_id": "R"}, "succeeded") == (True, None)
    done, why = after.verdict({"run_id": "R"}, "failed")
    assert done and "run R ended failed, not succeeded" in why and "--after R:any" in why
    assert after.verdict({"run_id": "R", "any": True}, "failed") == (True, None)


@pytest.mark.parametrize("value", ["../x", "R:all", "", "R:any:x"])
def test_a_malformed_after_is_one_line(value):
    with pytest.raises(InputError) as err:
        sweepspec.after(value)
    assert "--after" in str(err.value)


def test_after_waits_for_a_run_attached_here_by_its_record_and_says_so_once_per_state(tmp_path, monkeypatch):
    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "home"))
    first = records.RunRecord.create("20261129-100000-aaaa", state="running")
    said, states = [], iter(["running", "running", "failed"])

    def sleep(_):
        first.update(state=next(states))

    why = after.wait_for({"run_id": first.run_id, "local": True}, said.append, sleep=sleep)
    assert "ended failed" in why and len(said) == 1 and "in no host's line meanwhile" in said[0]


# ------------------------------------------------------------------------------------------------ a whole sweep, here


STEPS = '''\
import sys, time
lr, seed = sys.argv[sys.argv.index("--lr") + 1], sys.argv[sys.argv.index("--seed") + 1]
print(f"values lr={lr} seed={seed}", flush=True)
for i in range(1, 4):
    print(f"step {i} loss {float(lr) / i:.4f}", flush=True)
    time.sleep(0.1)
sys.exit(3 if seed == "2" else 0)
'''


@pytest.mark.slow
def test_a_sweep_on_this_machine_runs_its_points_one_after_another_and_its_table_names_the_best(tmp_path):
    from test_supervisor import _mnft, local_lab

    src, lab = local_lab(tmp_path, {"steps.py": STEPS})
    bad = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--sweep", "lr=1,2", "--sweep", "seed=1", "--", "steps.py", "--lr", "{lr}")
    assert bad.returncode == 2 and "key 'seed': no {seed}" in bad.stderr and not (tmp_path / "runs").exists()  # nothing started
    queued = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--sweep", "lr=1,2", "--wait", "--", "steps.py", "--lr", "{lr}")
    assert queued.returncode == 2 and "a sweep runs under its supervisor on the lab: leave out --wait" in queued.stderr
    told = tmp_path / "told"
    started = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--sweep", "lr=3,1", "--sweep", "seed=1,2",
                    "--notify", f'echo "$MNFT_NOTIFY_EVENT|$MNFT_NOTIFY_KIND|$MNFT_NOTIFY_SUMMARY" >> {told}',
                    "--", "steps.py", "--lr", "{lr}", "--seed", "{seed}")
    assert started.returncode == 0, started.stdout + started.stderr
    sweep_id = started.stdout.split("sweep ", 1)[1].split()[0]
    waited = _mnft(tmp_path, "wait", sweep_id)
    assert waited.returncode == 1 and f"sweep {sweep_id}: failed" in waited.stdout, waited.stdout + waited.stderr
    [line] = told.read_text().splitlines()  # told once, at the sweep's end, with its summary and best point
    assert line.startswith(f"ended|sweep|mnft sweep {sweep_id}") and "4 point(s): 2 succeeded, 2 failed" in line and "best: point 3 (lr=1 seed=1)" in line
    data = json.loads(_mnft(tmp_path, "status", sweep_id, "--json").stdout)
    assert [p["state"] for p in data["points"]] == ["succeeded", "failed", "succeeded", "failed"]
    assert data["best"] == f"{sweep_id}-03" and data["points"][2]["best"] == pytest.approx(1 / 3, abs=1e-3)
    for point in data["points"]:  # every point is a run of its own, its record here
        record = json.loads((tmp_path / "runs" / point["run_id"] / "run.json").read_text())
        assert record["sweep"] == {"id": sweep_id, "index": point["index"], "values": point["values"]}
        assert record["job"]["extra_args"] == ["--lr", point["values"]["lr"], "--seed", point["values"]["seed"]]
    assert "values lr=1 seed=1" in _mnft(tmp_path, "logs", sweep_id).stdout
    listed = _mnft(tmp_path, "runs").stdout  # the sweep is one row; its points are in it
    assert sweep_id in listed and "(sweep: 4 point(s): 2 succeeded, 2 failed)" in listed and f"{sweep_id}-01" not in listed
    assert "and 4 point(s) of the sweeps shown" in listed
    every = json.loads(_mnft(tmp_path, "runs", "--json").stdout)["runs"]
    assert sorted(r["id"] for r in every if r.get("sweep") == sweep_id) == [f"{sweep_id}-0{n}" for n in range(1, 5)]


@pytest.mark.slow
def test_a_sweep_after_a_detached_run_waits_in_its_supervisor_then_runs_its_points(tmp_path):
    from test_supervisor import _mnft, local_lab

    src, lab = local_lab(tmp_path, {"steps.py": STEPS, "slow.py": "import time\ntime.sleep(4)\nprint('first done', flush=True)\n"})
    first = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--detach", "--", "slow.py")
    assert first.returncode == 0, first.stdout + first.stderr
    run_id = first.stdout.split("run ", 1)[1].split()[0]
    started = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--sweep", "lr=1", "--sweep", "seed=1", "--after", run_id,
                    "--", "steps.py", "--lr", "{lr}", "--seed", "{seed}")
    assert started.returncode == 0, started.stdout + started.stderr
    sweep_id = started.stdout.split("sweep ", 1)[1].split()[0]
    waiting = json.loads(_mnft(tmp_path, "status", sweep_id, "--json").stdout)
    assert waiting["state"] == "waiting" and waiting["points"][0]["state"] == "pending"  # nothing of it in any line meanwhile
    assert _mnft(tmp_path, "wait", sweep_id).returncode == 0
    done = json.loads(_mnft(tmp_path, "status", sweep_id, "--json").stdout)
    assert done["state"] == "succeeded" and done["points"][0]["state"] == "succeeded"
    _mnft(tmp_path, "status", run_id)  # its record brought here from its supervisor
    first_ended = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())["ended"]
    point = json.loads((tmp_path / "runs" / f"{sweep_id}-01" / "run.json").read_text())
    assert point["created"] >= first_ended - 1  # its point started once the run it waited for had ended
