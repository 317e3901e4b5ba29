"""Naming the host that holds the gang back, from what the agents sample (pure rules; the agent's readings)."""

from __future__ import annotations

import json

from mnft.run import straggler

from mnft.onhost import rungpus, samples
from mnft.run.straggler import Watch


def sample(compute=None, run_cpu=None, gpus=(), t=0.0):
    ranks = {} if compute is None else {str(r): {"step": 40, "compute_s": c, "step_s": 0.5, "n": 20} for r, c in enumerate(compute)}
    return {"t": t, "cpu": 90.0, "run_cpu": run_cpu, "gpus": [{"index": i, "util": u, "mem_mib": 1.0} for i, u in enumerate(gpus)], "ranks": ranks}


def test_a_host_whose_ranks_compute_above_1_2x_the_median_is_the_straggler():
    found = straggler.find({"h1": sample([0.20, 0.21]), "h2": sample([0.21, 0.45]), "h3": sample([0.19, 0.20])})
    assert [(s.host, s.kind) for s in found] == [("h2", "compute")]
    assert "compute 2.1× the median host (450 ms vs 210 ms per step)" == found[0].why


def test_equal_hosts_or_a_single_host_have_no_straggler():
    assert straggler.find({"h1": sample([0.2]), "h2": sample([0.22]), "h3": sample([0.21])}) == []
    assert straggler.find({"h1": sample([5.0])}) == []


def test_for_any_job_a_host_far_less_busy_than_the_others_is_named():
    found = straggler.find({"h1": sample(gpus=(95, 97)), "h2": sample(gpus=(30, 20)), "h3": sample(gpus=(96, 90))})
    assert [(s.host, s.kind) for s in found] == [("h2", "utilisation")] and "GPU utilisation 25% vs 93% on the median host" in found[0].why
    assert straggler.find({"h1": sample(gpus=(5,)), "h2": sample(gpus=(1,))}) == []  # nobody works: nothing to compare
    # on CPU the ranks that wait for a straggler block and use less CPU than it: CPU use never names a host
    assert straggler.find({"h1": sample(run_cpu=98.0), "h2": sample(run_cpu=20.0), "h3": sample(run_cpu=96.0)}) == []


def test_a_host_is_named_only_when_slow_in_two_samples_in_a_row_and_cleared_only_when_in_pace_in_two():
    watch = Watch(sustain=2)
    watch.update("h1", sample([0.2], t=1))
    assert watch.update("h2", sample([0.5], t=1)) == []  # once: could be a hiccup
    watch.update("h1", sample([0.2], t=6))
    assert [s.host for s in watch.update("h2", sample([0.5], t=6))] == ["h2"]
    assert watch.seen["h2"]["first_seen"] == 6
    watch.update("h1", sample([0.2], t=11))
    assert [s.host for s in watch.update("h2", sample([0.21], t=11))] == ["h2"]  # once back in pace: could be a lull
    watch.update("h1", sample([0.2], t=16))
    assert watch.update("h2", sample([0.21], t=16)) == []  # twice: it is back


def test_the_agent_reads_rank_timings_gpu_use_and_the_runs_cpu(tmp_path):
    rows = [{"step": s, "rank": 1, "node_rank": 0, "step_s": 0.5, "data_s": 0.01, "compute_s": 0.3 + s / 100, "comm_s": 0.1} for s in range(1, 31)]
    (tmp_path / "timings-rank1.jsonl").write_text(json.dumps({"event": "start", "rank": 1}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))
    sampler = samples.Sampler(None, str(tmp_path / "timings-rank*.jsonl"))
    assert sampler.sample()["ranks"] == {}  # what the files held at the start is history
    with open(tmp_path / "timings-rank1.jsonl", "a") as fh:
        fh.write(json.dumps(dict(rows[-1], step=31, compute_s=0.9)) + "\n")
    (tmp_path / "timings-rank2.jsonl").write_text(json.dumps(dict(rows[0], rank=2, compute_s=0.25)) + "\n")  # a new file: read whole
    ranks = sampler.sample()["ranks"]
    assert ranks["1"] == {"step": 31, "n": 1, "step_s": 0.5, "compute_s": 0.9, "comm_s": 0.1} and ranks["2"]["compute_s"] == 0.25
    assert samples.rank_window({0: rows})["0"]["n"] == samples.WINDOW  # the medians are over the last steps only
    assert rungpus.parse_gpu_util("0, 97, 40000\n1, 3, 1200\n") == [{"index": 0, "util": 97.0, "mem_mib": 40000.0},
                                                                 {"index": 1, "util": 3.0, "mem_mib": 1200.0}]
