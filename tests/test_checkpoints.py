"""Before a resume: the latest complete checkpoint by the job's layout, in the union of the hosts' files (pure)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from mnft.hosts import inventory
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host, Inventory
from mnft.run import checkpoints
from mnft.onhost import queries
from mnft.run.job import ResumeRule
from mnft.onhost import sharemarks, treehash


def listing(**entries):
    """An agent `checkpoints` answer: entry name -> its files (or a link target)."""
    out = {}
    for name, files in entries.items():
        if isinstance(files, str):
            out[name] = {"dir": False, "link": files, "files": {}}
        else:
            out[name] = {"dir": True, "link": None, "files": {f: 10 for f in files}}
    return {"exists": True, "entries": out}


HF = ResumeRule(layout="hf")


def test_hf_takes_the_newest_checkpoint_whose_trainer_state_exists_on_some_host():
    # h1 (rank 0) wrote model and trainer_state.json; h2 only its RNG state; checkpoint-30 was cut short
    h1 = listing(**{"checkpoint-10": ["model.safetensors", "trainer_state.json", "rng_state_0.pth"],
                    "checkpoint-20": ["model.safetensors", "trainer_state.json", "rng_state_0.pth"],
                    "checkpoint-30": ["model.safetensors"], "runs": ["events"]})
    h2 = listing(**{"checkpoint-20": ["rng_state_1.pth"], "checkpoint-30": ["rng_state_1.pth"], "checkpoint-5": ["rng_state_1.pth"]})
    choice = checkpoints.choose(HF, {"h1": h1, "h2": h2})
    assert choice.name == "checkpoint-20" and choice.considered == ["checkpoint-30"]
    assert sorted(choice.union) == ["checkpoint-20/model.safetensors", "checkpoint-20/rng_state_0.pth", "checkpoint-20/rng_state_1.pth",
                                    "checkpoint-20/trainer_state.json"]
    assert checkpoints.transfers(choice) == {
        "h1": {"checkpoint-20/rng_state_1.pth": "h2"},
        "h2": {"checkpoint-20/model.safetensors": "h1", "checkpoint-20/rng_state_0.pth": "h1", "checkpoint-20/trainer_state.json": "h1"},
    }


def test_numbers_are_compared_as_numbers_and_no_complete_checkpoint_means_a_fresh_start():
    h1 = listing(**{"checkpoint-9": ["trainer_state.json"], "checkpoint-10": ["trainer_state.json"]})
    assert checkpoints.choose(HF, {"h1": h1}).name == "checkpoint-10"
    empty = checkpoints.choose(HF, {"h1": listing(**{"checkpoint-3": ["model.safetensors"]}), "h2": {"exists": False, "entries": {}}})
    assert empty.name is None and empty.considered == ["checkpoint-3"]


def test_torchtune_prefers_the_newest_epoch_then_steps_and_a_glob_rule_uses_its_marker():
    tt = ResumeRule(layout="torchtune")
    h1 = listing(epoch_0=["recipe_state.pt"], epoch_1=["model.safetensors"], step_900=["recipe_state.pt"])
    assert checkpoints.choose(tt, {"h1": h1}).name == "epoch_0"
    assert checkpoints.choose(tt, {"h1": listing(step_100=["recipe_state.pt"], step_200=["x"])}).name == "step_100"
    rule = ResumeRule(layout="glob", pattern="ckpt_*", marker="DONE")
    assert checkpoints.choose(rule, {"h1": listing(ckpt_2=["DONE"], ckpt_11=["DONE"], ckpt_12=["w.pt"], other_99=["DONE"])}).name == "ckpt_11"


def test_sana_follows_latest_pth_and_copies_the_link_with_its_target():
    h1 = {"exists": True, "entries": {"latest.pth": {"dir": False, "link": "/root/w/checkpoints/epoch_1_step_500.pth", "files": {}},
                                       "epoch_1_step_500.pth": {"dir": False, "link": None, "files": {"": 99}},
                                       "epoch_1_step_600.pth": {"dir": False, "link": None, "files": {"": 50}}}}
    choice = checkpoints.choose(ResumeRule(layout="sana"), {"h1": h1, "h2": {"exists": True, "entries": {}}})
    assert choice.name == "epoch_1_step_500.pth" and set(choice.paths) == {"epoch_1_step_500.pth", "latest.pth"}
    assert checkpoints.transfers(choice) == {"h2": {"epoch_1_step_500.pth": "h1", "latest.pth": "h1"}}


def test_a_listed_path_that_leaves_the_checkpoints_directory_is_refused():
    bad = {"exists": True, "entries": {"checkpoint-1": {"dir": True, "link": None, "files": {"trainer_state.json": 1, "../../.ssh/authorized_keys": 9}}}}
    with pytest.raises(checkpoints.CheckpointError, match="not a plain path inside the checkpoints directory"):
        checkpoints.choose(HF, {"h1": bad})


def test_files_of_one_name_that_differ_between_hosts_are_a_conflict():
    trees = {"h1": {"c/a": (1, "x"), "c/b": (2, "y")}, "h2": {"c/a": (1, "x")}, "h3": {"c/b": (2, "z")}}
    assert checkpoints.conflicts(trees) == ["c/b differs between h1 and h3"]


def test_the_agent_lists_a_checkpoints_directory_and_the_hash_reads_only_the_chosen_checkpoint(tmp_path):
    for name in ("checkpoint-10", "checkpoint-20"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(name)
    (tmp_path / "latest.pth").symlink_to("checkpoint-20")
    found = queries.list_checkpoints(str(tmp_path))
    listed = found["entries"]["checkpoint-10"]
    assert {k: v for k, v in listed.items() if k != "newest"} == {"dir": True, "link": None, "files": {"trainer_state.json": 13}}
    assert listed["newest"] == (tmp_path / "checkpoint-10" / "trainer_state.json").stat().st_mtime  # which save came last
    assert found["entries"]["latest.pth"]["link"] == "checkpoint-20"
    _, files, _ = treehash.tree_hash(tmp_path, checkpoints.hash_rules(("checkpoint-20",)))
    assert sorted(files) == ["checkpoint-20/trainer_state.json"]


def test_a_crashed_saves_temp_dir_is_neither_hashed_nor_copied(tmp_path):
    # h2 was killed mid-save of step 36: its rank-1 part is only a temp dir; ranks 0 and 2 completed theirs
    step = tmp_path / "step-36"
    (step / "rank-1.tmp-k3j9").mkdir(parents=True)
    (step / "rank-1.tmp-k3j9" / "__0_0.distcp").write_bytes(b"half")
    (step / "rank-0").mkdir()
    (step / "rank-0" / "meta.json").write_text('{"rank": 0, "world_size": 3, "step": 36}')
    listing = queries.list_checkpoints(str(tmp_path))
    choice = checkpoints.choose(ResumeRule(layout="mnft"), {"h1": listing}, needs="any")
    assert choice.name == "step-36" and sorted(choice.union) == ["step-36/rank-0/meta.json"]
    _, files, _ = treehash.tree_hash(tmp_path, checkpoints.hash_rules(choice.paths, choice.exclude))
    assert sorted(files) == ["step-36/rank-0/meta.json"]


def steps_listing(parts: dict[int, tuple[int, ...]], world: int = 3) -> dict:
    """The agent's listing of a checkpoints directory holding, per step, the complete parts of these ranks."""
    return {"exists": True, "entries": {
        f"step-{step}": {"dir": True, "link": None,
                         "files": {f"rank-{r}/{f}": 10 for r in ranks for f in ("meta.json", "__0_0.distcp")},
                         "meta": {f"rank-{r}/meta.json": {"rank": r, "world_size": world} for r in ranks}}
        for step, ranks in parts.items()}}


@pytest.mark.parametrize("needs", ["any", "all"])
def test_a_save_cut_short_on_a_host_still_there_resumes_the_step_before_that_every_rank_completed(needs):
    """h2 was killed while it wrote step 40; h1 and h3 completed theirs. Resuming step 40 would give h2's rank
    another rank's replica and a new RNG stream: the step before continues every rank's own state (exact)."""
    listings = {"h1": steps_listing({36: (0,), 40: (0,)}), "h2": steps_listing({36: (1,)}), "h3": steps_listing({36: (2,), 40: (2,)})}
    choice = checkpoints.choose(ResumeRule(layout="mnft"), listings, needs=needs)
    assert choice.name == "step-36" and choice.considered == ["step-40"]
    assert sorted({p.split("/")[1] for p in choice.union}) == ["rank-0", "rank-1", "rank-2"]


def test_lora_resumes_a_step_some_ranks_completed_when_a_host_lost_for_good_took_its_parts_of_every_step():
    """h2 is gone (a spare holds nothing yet): no step has all 3 ranks. lora's ranks are replicas, so the newest
    step of the others serves; full's shards cannot be made whole."""
    listings = {"h1": steps_listing({36: (0,), 40: (0,)}), "h3": steps_listing({36: (2,), 40: (2,)}), "h4": steps_listing({})}
    lora = checkpoints.choose(ResumeRule(layout="mnft"), listings, needs="any")
    assert lora.name == "step-40" and checkpoints.transfers(lora)["h4"] == {p: "h1" if "rank-0" in p else "h3" for p in lora.union}
    assert checkpoints.choose(ResumeRule(layout="mnft"), listings, needs="all").name is None


def test_a_complete_step_of_an_older_world_does_not_outrank_the_newest_world_for_lora():
    """The gang shrank from 3 ranks to 2 after step 20, then lost a host: step 40 (world 2, one part left) is
    resumed, not the older step 20 that all 3 ranks of the earlier world completed."""
    listings = {"h1": {"exists": True, "entries": {**steps_listing({20: (0, 1, 2)})["entries"], **steps_listing({40: (0,)}, world=2)["entries"]}}}
    assert checkpoints.choose(ResumeRule(layout="mnft"), listings, needs="any").name == "step-40"


def test_a_host_that_still_differs_after_copying_is_named_with_a_file():
    union = {"s/a": (1, "x"), "s/b": (2, "y")}
    assert checkpoints._difference("h3", {"s/a": (1, "x"), "s/c": (3, "z")}, union) == \
        "h3 lacks 1 file(s), e.g. s/b and holds another 1 file(s), e.g. s/c"



# ------------------------------------------------------------------------------------------------ torchtune 0.6.1

TORCHTUNE = Path(__file__).parent / "data" / "torchtune-0.6.1"


def torchtune_listing(run: str) -> dict:
    """The agent's `checkpoints` answer for a real torchtune 0.6.1 output directory (its manifest: files, sizes
    and the order they were written in, as ms after the first)."""
    manifest = json.loads((TORCHTUNE / run / "manifest.json").read_text())
    written = dict(manifest["write_order"])
    entries: dict[str, dict] = {}
    for rel, size in manifest["files"].items():
        top, _, rest = rel.partition("/")
        entry = entries.setdefault(top, {"dir": bool(rest), "link": None, "files": {}})
        entry["files"][rest] = size
        if rel in written:
            entry["newest"] = max(entry.get("newest") or 0.0, 1e9 + written[rel] / 1000)
    return {"root": "out", "exists": True, "entries": entries}


@pytest.mark.parametrize("run, latest", [
    ("full-killed", "epoch_1"),  # killed in epoch 2: epoch_1 and the recipe state written after it
    ("lora-killed", "epoch_1"),
    ("full", "epoch_0"),  # finished: the last epoch has no recipe state, epoch_0's is the one on disk
    ("lora", "epoch_0"),
])
def test_torchtune_0_6_1_resumes_the_newest_epoch_its_recipe_state_was_written_after(run, latest):
    choice = checkpoints.choose(ResumeRule("torchtune"), {"h1": torchtune_listing(run), "h2": {"root": "out", "exists": False, "entries": {}}})
    assert choice.name == latest and choice.paths == (latest, "recipe_state")
    assert "recipe_state/recipe_state.pt" in choice.held["h1"] and choice.held["h2"] == {}  # copied to h2 with the epoch


def test_an_epoch_checkpoint_names_no_step():
    assert checkpoints.step_of("epoch_1") is None and checkpoints.step_of("checkpoint-40") == 40
    assert checkpoints.step_of("epoch_1_step_500.pth") == 500


def test_torchtune_0_6_1_metrics_are_read_from_its_log_file_and_its_bar():
    from mnft.run import scrape

    for run, steps in (("full", [1, 2, 3, 4, 5, 6]), ("lora-resume", [7, 8, 9])):  # a resume continues the step count
        records = scrape.LineParser("torchtune").lines((TORCHTUNE / run / "metrics.txt").read_text().splitlines())
        assert [r["step"] for r in records] == steps and all(isinstance(r["loss"], float) for r in records)
        bar = scrape.LineParser("torchtune").lines((TORCHTUNE / run / "stderr.txt").read_text().splitlines())
        assert sorted({r["step"] for r in bar}) == steps  # tqdm's `E|S|Loss: x`, with \r and ESC[A between updates


# ------------------------------------------------------------------------------------------------ shared directories


def test_hosts_that_see_one_directory_are_one_directory_under_their_first_host():
    groups = {"h2": ("h2", "h4"), "h4": ("h2", "h4")}  # sync's shared groups: hosts alone are left out
    assert checkpoints.directories(["h1", "h2", "h3", "h4"], groups) == {"h1": ("h1",), "h2": ("h2", "h4"), "h3": ("h3",)}
    assert checkpoints.directories(["h1", "h2"], {}) == {"h1": ("h1",), "h2": ("h2",)}


def test_a_shared_directory_gets_each_missing_file_once_and_never_from_itself():
    """h1 and h2 share a home: rank 0 and rank 1 wrote there; h3's own disk holds rank 2's files."""
    written = listing(**{"checkpoint-20": ["rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]})
    listings = {"h1": written, "h2": written, "h3": listing(**{"checkpoint-20": ["rng_state_2.pth"]})}
    choice = checkpoints.choose(HF, listings)
    groups = {"h1": ("h1", "h2"), "h2": ("h1", "h2")}
    assert checkpoints.transfers(choice, groups) == {
        "h1": {"checkpoint-20/rng_state_2.pth": "h3"},  # once, for h1 and h2
        "h3": {"checkpoint-20/rng_state_0.pth": "h1", "checkpoint-20/rng_state_1.pth": "h1", "checkpoint-20/trainer_state.json": "h1"},
    }
    assert checkpoints.transfers(choice)["h2"] == {"checkpoint-20/rng_state_2.pth": "h3"}  # undetected: copied twice
    everyone = {n: ("h1", "h2", "h3") for n in listings}
    assert checkpoints.transfers(checkpoints.choose(HF, {n: listings["h1"] for n in listings}), everyone) == {}
    assert checkpoints.unseen(choice, checkpoints.directories(list(listings), groups)) == []


def test_a_host_of_a_shared_directory_that_lists_other_files_is_named():
    listings = {"h1": listing(**{"checkpoint-20": ["trainer_state.json", "model.safetensors"]}),
                "h2": listing(**{"checkpoint-20": ["trainer_state.json"]})}
    choice = checkpoints.choose(HF, listings)
    assert checkpoints.unseen(choice, {"h1": ("h1", "h2")}) == \
        ["h2 shares h1's directory but lacks 1 file(s), e.g. checkpoint-20/model.safetensors"]


def test_declared_shared_fs_found_apart_names_the_hosts_apart_from_the_directory_most_declared_hosts_see():
    hosts = [Host(name=n, rank=i, address=f"10.0.0.{i}", shared_fs=n != "h4") for i, n in enumerate(["h1", "h2", "h3", "h4"])]
    assert checkpoints.declared_apart(hosts, {"h1": ("h1", "h2"), "h2": ("h1", "h2")}) == ("h1", ["h3"])
    assert checkpoints.declared_apart(hosts, {n: ("h1", "h2", "h3", "h4") for n in ("h1", "h2", "h3", "h4")}) == ("h1", [])
    assert checkpoints.declared_apart(hosts[:1] + hosts[3:], {}) == (None, [])  # one declared host asserts nothing
    assert checkpoints.declared_apart(hosts, {}) == ("h1", ["h2", "h3"])  # all apart: the first is the reference
    # h1 alone, h2 and h3 together: the odd one is named, not the two that agree
    together = {"h2": ("h2", "h3"), "h3": ("h2", "h3")}
    assert checkpoints.declared_apart(hosts, together) == ("h2", ["h1"])
    # h1's mark could not be left: its failure is said, nobody is blamed for not seeing it
    assert checkpoints.declared_apart(hosts, together, {"h1": "Permission denied"}) == ("h2", [])


def hf(*names: str, files=("trainer_state.json", "model.safetensors")):
    return listing(**{name: list(files) for name in names})


class Clock:
    """A clock that moves only when slept on, and the sleeps asked for."""

    def __init__(self):
        self.now, self.slept = 100.0, []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_host_of_a_shared_directory_that_does_not_list_the_newest_checkpoint_yet_is_listed_again_until_it_does():
    """Right after a crash, h2's NFS client still serves h2 the directory as it was before checkpoint-20."""
    first = {"h1": hf("checkpoint-10", "checkpoint-20"), "h2": hf("checkpoint-10"), "h3": hf("checkpoint-10", "checkpoint-20")}
    dirs = {"h1": ("h1", "h2"), "h3": ("h3",)}
    answers = [{"h2": hf("checkpoint-10")}, {"h2": hf("checkpoint-10", "checkpoint-20")}]
    asked, clock = [], Clock()

    def relist(names):
        asked.append(names)
        return answers.pop(0)

    assert checkpoints.lagging(checkpoints.choose(HF, first), dirs) == ["h2"]
    choice, listings = checkpoints.settle(HF, first, dirs, relist, sleep=clock.sleep, clock=lambda: clock.now)
    assert choice.name == "checkpoint-20" and checkpoints.unseen(choice, dirs) == []
    assert asked == [["h2"], ["h2"]] and clock.slept == [1.0, 1.0]  # only the lagging host, once a second
    assert listings["h2"] == first["h1"]


def test_a_shared_directory_listed_differently_for_ten_seconds_is_refused_and_private_directories_are_never_listed_again():
    first = {"h1": hf("checkpoint-20"), "h2": hf("checkpoint-20", files=("trainer_state.json",))}
    clock = Clock()
    relisted = []
    choice, _ = checkpoints.settle(HF, first, {"h1": ("h1", "h2")}, lambda names: relisted.append(names) or {"h2": first["h2"]},
                                   sleep=clock.sleep, clock=lambda: clock.now)
    assert len(relisted) == checkpoints.SHARED_WAIT and clock.now == 100.0 + checkpoints.SHARED_WAIT
    assert checkpoints.unseen(choice, {"h1": ("h1", "h2")}) == \
        ["h2 shares h1's directory but lacks 1 file(s), e.g. checkpoint-20/model.safetensors"]
    # each host its own directory: a checkpoint spread over them is what copying is for, nothing to wait for
    spread = checkpoints.settle(HF, first, {"h1": ("h1",), "h2": ("h2",)}, lambda names: pytest.fail("listed again"),
                                sleep=lambda s: pytest.fail("waited"))[0]
    assert spread.name == "checkpoint-20"


def local_hosts(*names: str, **settings) -> Inventory:
    """Hosts on this machine (connection local): the real marks, listings, hashes and rsync, no SSH."""
    extra = "".join(f", {k}: {json.dumps(v)}" for k, v in settings.items())
    return inventory.parse("hosts:\n" + "".join(f"  {n}: {{connection: local{extra}}}\n" for n in names))


def hf_checkpoint(root: Path, *files: str) -> Path:
    (root / "checkpoint-10").mkdir(parents=True)
    for name in files:
        (root / "checkpoint-10" / name).write_text(name)
    return root


def test_prepare_reads_a_shared_directory_once_and_copies_to_it_once(tmp_path):
    """Three hosts on this machine (local connections, the real marks, hashes and rsync): h1 and h2 see one
    directory, h3 its own. Before detection, h2's directory was filled a second time from h3."""
    shared = hf_checkpoint(tmp_path / "home" / "ckpt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth")
    own = hf_checkpoint(tmp_path / "h3" / "ckpt", "rng_state_2.pth")
    with Fleet(local_hosts("h1", "h2", "h3")) as fleet:
        found = checkpoints.prepare(fleet, HF, {"h1": str(shared), "h2": str(shared), "h3": str(own)}, Console(file=None, quiet=True))
    assert found.name == "checkpoint-10" and found.shared == [["h1", "h2"]]
    assert found.copied == {"h1": 1, "h3": 3}
    assert "verified in 2 directories (h1, h2 share one directory)" in found.note
    for root in (shared, own):
        assert sorted(p.name for p in (root / "checkpoint-10").iterdir()) == \
            ["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth", "trainer_state.json"]


def test_prepare_on_one_directory_for_every_host_copies_and_hashes_nothing(tmp_path, monkeypatch):
    shared = hf_checkpoint(tmp_path / "home" / "ckpt", "trainer_state.json", "rng_state_0.pth")
    monkeypatch.setattr(checkpoints, "_hash_trees", lambda *a, **k: pytest.fail("one directory: nothing to compare"))
    with Fleet(local_hosts("h1", "h2", "h3", shared_fs=True)) as fleet:
        found = checkpoints.prepare(fleet, HF, {n: str(shared) for n in ("h1", "h2", "h3")}, Console(file=None, quiet=True))
    assert found.name == "checkpoint-10" and found.copied == {} and found.shared == [["h1", "h2", "h3"]]
    assert found.note == "one directory for h1, h2, h3: read once, nothing copied"


def test_declared_shared_fs_on_private_checkpoint_directories_resumes_as_found_with_a_warning(tmp_path):
    """A lab whose data mount is shared and whose homes are private, shared_fs: true in the inventory: the marks
    say each host has its own checkpoints directory, and detection decides (it used to refuse every resume)."""
    dirs = {"h1": hf_checkpoint(tmp_path / "h1", "trainer_state.json"), "h2": hf_checkpoint(tmp_path / "h2", "rng_state_1.pth"),
            "h3": hf_checkpoint(tmp_path / "h3", "rng_state_2.pth")}
    out = io.StringIO()
    with Fleet(local_hosts("h1", "h2", "h3", shared_fs=True)) as fleet:
        found = checkpoints.prepare(fleet, HF, {n: str(d) for n, d in dirs.items()}, Console(file=out, width=400))
    assert found.name == "checkpoint-10" and found.shared == [] and found.copied == {"h1": 2, "h2": 2, "h3": 2}
    assert found.warnings == [(f"h2, h3 declared shared_fs, but the checkpoints directory {dirs['h2']} there is not the one h1 sees: "
                               "resumed as found, directories of their own (a mount missing there? `mnft check` verifies shared_fs)")]
    assert f"warning: {found.warnings[0]}" in out.getvalue()
    for root in dirs.values():
        assert sorted(p.name for p in (root / "checkpoint-10").iterdir()) == ["rng_state_1.pth", "rng_state_2.pth", "trainer_state.json"]


def test_a_host_whose_mark_failed_is_said_to_and_read_as_its_own_directory_and_nobody_else_is_blamed(tmp_path):
    """h1's mark cannot be left (a .mnft-share writable by others is never used); h2 and h3 see one directory,
    all three declared shared_fs. Before, h2 and h3 were blamed for not seeing h1's directory and the resume stopped."""
    (tmp_path / "h1").mkdir()
    (tmp_path / "h1" / sharemarks.SHARE_DIR).mkdir(mode=0o777)
    os.chmod(tmp_path / "h1" / sharemarks.SHARE_DIR, 0o777)
    own = hf_checkpoint(tmp_path / "h1" / "ckpt", "trainer_state.json")
    shared = hf_checkpoint(tmp_path / "home" / "ckpt", "rng_state_1.pth", "rng_state_2.pth")
    with Fleet(local_hosts("h1", "h2", "h3", shared_fs=True)) as fleet:
        found = checkpoints.prepare(fleet, HF, {"h1": str(own), "h2": str(shared), "h3": str(shared)}, Console(file=None, quiet=True))
    assert found.warnings == [(f"h1: no mark could be left for the checkpoints directory {own} ({tmp_path / 'h1' / sharemarks.SHARE_DIR} is "
                               "another user's or writable by others: not used (remove it)): read as a directory of its own")]
    assert found.name == "checkpoint-10" and found.shared == [["h2", "h3"]] and found.copied == {"h1": 2, "h2": 1}


def test_a_host_whose_mark_failed_but_that_sees_the_others_marks_is_read_with_them(tmp_path, monkeypatch):
    shared = hf_checkpoint(tmp_path / "home" / "ckpt", "trainer_state.json")
    together = {"h1": ("h1", "h2"), "h2": ("h1", "h2")}
    monkeypatch.setattr(checkpoints, "detect_sharing", lambda fleet, hosts, dirs: (together, {"h1": "Read-only file system"}))
    with Fleet(local_hosts("h1", "h2", shared_fs=True)) as fleet:
        found = checkpoints.prepare(fleet, HF, {"h1": str(shared), "h2": str(shared)}, Console(file=None, quiet=True))
    assert found.warnings == [(f"h1: no mark could be left for the checkpoints directory {shared} (Read-only file system): "
                               "read with h2, whose marks it sees")]
    assert found.shared == [["h1", "h2"]] and found.copied == {}
