"""The lora and full recipes: config validation, data masking, model build, checkpoints, and 2-process
gloo runs under torchrun (marked slow: crash + resume reproduces the uninterrupted losses, the non-finite guard
holds every rank still, one rank all-masked, loss normalisation across splits, merged export, demo bar)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from mnft.recipes import checkpointing, common, data, model
from mnft.recipes.config import ConfigError, RecipeError, load_config

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    """A fake HOME shared by the session, so the tiny model is built once and the real home is never read."""
    return tmp_path_factory.mktemp("home")


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.pop("XDG_CACHE_HOME", None)
    env.update(HOME=str(home), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun(recipe: str, home: Path, *args: str, nproc: int = 2, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", f"mnft.recipes.{recipe}", *args]
    done = subprocess.run(cmd, env=env_for(home), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and aborted_at_exit_after_the_work(done):
        # torch's gloo, rarely (once in a full CI run; 0 of 10 launches in a loop), aborts a rank in the interpreter's
        # exit after destroy_process_group: the run is judged by what it wrote, which every caller checks, as
        # mnft judges it (finished, with a warning: tests/test_finished_job.py)
        return subprocess.CompletedProcess(done.args, 0, done.stdout, done.stderr)
    return done


def aborted_at_exit_after_the_work(done: subprocess.CompletedProcess) -> bool:
    """The rank that failed first was ended by SIGABRT with gloo's exit-time message, after rank 0 had summed up
    the whole run (its summary line comes after the last step and the last checkpoint)."""
    root_cause = done.stderr.partition("Root Cause (first observed failure):")[2]
    return GLOO_EXIT_ABORT in done.stderr and "Signal 6 (SIGABRT)" in root_cause and "\nsummary: steps" in done.stdout


def test_only_gloos_abort_at_exit_after_the_summary_is_taken_for_a_finished_run():
    def ran(stdout: str, stderr: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], 1, stdout, stderr)

    cause = "Root Cause (first observed failure):\n[0]:\n  exitcode  : -6 (pid: 3467)  (SIGABRT)\n  traceback : Signal 6 (SIGABRT) received by PID 3467\n"
    summed_up = "step     3/3  loss   5.8577\nsummary: steps 3  initial loss 6.2919\n"
    assert aborted_at_exit_after_the_work(ran(summed_up, GLOO_EXIT_ABORT + "\n" + cause))
    assert not aborted_at_exit_after_the_work(ran("step     2/3  loss   6.0399\n", GLOO_EXIT_ABORT + "\n" + cause))  # mid-run
    assert not aborted_at_exit_after_the_work(ran(summed_up, cause))  # another abort than gloo's at exit
    assert not aborted_at_exit_after_the_work(ran(summed_up, GLOO_EXIT_ABORT + "\n" + cause.replace("Signal 6 (SIGABRT)", "exit 17")))


def single(recipe: str, home: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"mnft.recipes.{recipe}", *args]
    return subprocess.run(cmd, env=env_for(home), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(path: Path) -> dict[int, float]:
    """Loss per step; after a resume the re-run steps overwrite the crashed run's lines."""
    return {r["step"]: r["loss"] for r in records(path) if "loss" in r and "event" not in r}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    model.build_tiny(out)
    return out


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------ config

def test_unknown_config_key_is_an_error_naming_it_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"config key 'lr_typo' unknown \(did you mean 'lr'\?\)"):
        load_config("lora", ["lr_typo=1e-3"])


def test_bad_value_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="config key 'max_steps' expects an int, got 'ten'"):
        load_config("full", ["max_steps=ten"])
    with pytest.raises(ConfigError, match="config key 'lora_dropout'"):
        load_config("lora", ["lora_dropout=1.5"])


def test_lora_only_key_is_unknown_to_full():
    with pytest.raises(ConfigError, match="config key 'lora_rank' unknown"):
        load_config("full", ["lora_rank=8"])


def test_overrides_are_typed_and_config_path_is_honoured(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0e-4\nmax_steps: 7\n")
    cfg = load_config("lora", [f"config={path}", "lora_target_modules=q_proj,v_proj", "packing=true",
                               "model_cache_dir=null", "lr=2e-4"])
    assert (cfg.lr, cfg.max_steps, cfg.packing) == (2e-4, 7, True)
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.model_cache_dir is None


def test_a_list_override_that_is_not_valid_yaml_is_one_error_naming_the_key():
    with pytest.raises(ConfigError) as e:
        load_config("lora", ["lora_target_modules=[q_proj"])
    assert str(e.value).startswith("config key 'lora_target_modules' expects a list like [a, b], got '[q_proj'")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arg", ["lr=nan", "lr=inf", "lr=-inf", "lr=NaN", "max_grad_norm=Infinity", "min_lr_ratio=1e999",
                                 "adam_betas=[0.9, nan]", "lora_alpha=-inf"])
def test_a_non_finite_number_is_refused_naming_the_key(arg):
    key = arg.partition("=")[0]
    with pytest.raises(ConfigError, match=f"^config key '{key}' must be a finite number, got "):
        load_config("lora", [arg])


def test_a_non_finite_number_in_the_config_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: .nan\n")
    with pytest.raises(ConfigError, match="^config key 'lr' must be a finite number, got nan$"):
        load_config("full", [f"config={path}"])


@pytest.mark.parametrize("value", ["null", "None", "~", "none", ""])
def test_resume_null_means_no_resume_not_a_directory_named_null(value, tmp_path):
    assert load_config("lora", [f"resume={value}"]).resume == "none"
    path = tmp_path / "c.yaml"
    path.write_text("resume: null\n")
    assert load_config("lora", [f"config={path}"]).resume == "none"


def test_overwrite_needs_a_fresh_run():
    assert load_config("lora", ["overwrite=true"]).overwrite is True
    with pytest.raises(ConfigError, match="config key 'overwrite' .* needs resume=none, got resume=latest"):
        load_config("lora", ["overwrite=true", "resume=latest"])


def test_null_for_a_string_key_is_refused_not_turned_into_the_string_none(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: null\n")
    with pytest.raises(ConfigError, match="config key 'output_dir' expects a str, got None"):
        load_config("lora", [f"config={path}"])


@pytest.mark.parametrize("path", sorted((REPO / "mnft" / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    load_config("full" if "full" in path.name else "lora", [f"config={path}"])


@pytest.mark.parametrize("arg,line", [
    ("lr_typo=1", "config key 'lr_typo' unknown (did you mean 'lr'?)"),
    ("lora_target_modules=[q_proj", "config key 'lora_target_modules' expects a list like [a, b], got '[q_proj' "
                                    "(while parsing a flow sequence)"),
])
def test_bad_config_exits_2_with_one_line(home, arg, line):
    res = single("lora", home, arg)
    assert res.returncode == 2
    assert res.stderr.strip() == f"mnft.recipes: {line}"


# ------------------------------------------------------------------ model and data

def test_tiny_model_round_trips_through_save_pretrained(tiny_dir, tmp_path):
    net, tok = model.load(tiny_dir, torch.float32)
    net.save_pretrained(tmp_path / "again")
    tok.save_pretrained(tmp_path / "again")
    net2, tok2 = model.load(tmp_path / "again", torch.float32)
    ids = torch.tensor([tok("### Instruction:\nCount up from 3 to 7")["input_ids"]])
    assert torch.equal(net(input_ids=ids).logits, net2(input_ids=ids).logits)
    assert model.checksum(net) == model.checksum(net2)
    assert tok2.decode(tok2("Count down from 9 to 3")["input_ids"]) == "Count down from 9 to 3"
    assert (tok2.pad_token, tok2.eos_token) == ("<|pad|>", "<|end|>")


def test_tiny_build_is_deterministic_so_nodes_agree(tiny_dir, tmp_path):
    model.build_tiny(tmp_path / "other")
    a, _ = model.load(tiny_dir, torch.float32)
    b, _ = model.load(tmp_path / "other", torch.float32)
    assert model.checksum(a) == model.checksum(b)
    assert (tiny_dir / "tokenizer.json").read_bytes() == (tmp_path / "other" / "tokenizer.json").read_bytes()


def test_prompt_tokens_are_masked_and_response_trained(tiny_dir):
    _, tok = model.load(tiny_dir, torch.float32)
    ids, labels = data.tokenize(tok, {"instruction": "Count up from 3 to 5", "response": "3 4 5"}, 128)
    n_prompt = sum(1 for x in labels if x == data.IGNORE)
    assert ids[0] == tok.bos_token_id and labels[-1] == tok.eos_token_id == ids[-1]
    assert tok.decode(ids[n_prompt:-1]) == "3 4 5"
    assert tok.decode(ids[1:n_prompt]) == data.PROMPT.format(instruction="Count up from 3 to 5")


def test_packing_keeps_every_label_with_its_token():
    examples = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5]), ([6, 7, 8, 9], [-100, -100, 8, 9])]
    rows = data.pack(examples, max_seq_len=6)
    assert rows == [([1, 2, 3, 4, 5], [-100, 2, 3, -100, 5]), ([6, 7, 8, 9], [-100, -100, 8, 9])]


def test_all_masked_batch_gives_zero_loss_and_finite_zero_grads():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), data.IGNORE)
    loss = common.token_loss_sum(logits, labels)
    (loss * 2 / max(0, 1.0)).backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all() and not logits.grad.any()
    assert data.trained_tokens({"labels": labels}) == 0


def test_batches_resume_at_the_same_position():
    rows = [([i], [i]) for i in range(40)]
    a = data.Batches(rows, 3, rank=1, world_size=2, seed=0, pad_id=0)
    taken, positions = [], []
    for _ in range(9):  # crosses an epoch boundary (6 per epoch)
        positions.append(a.position())
        taken.append(a.next()["input_ids"].tolist())
    assert positions[4] == {"epoch": 0, "offset": 4 * 3 * 2} and positions[7] == {"epoch": 1, "offset": 3 * 2}
    b = data.Batches(rows, 3, rank=1, world_size=2, seed=0, pad_id=0)
    b.seek(positions[4])
    assert [b.next()["input_ids"].tolist() for _ in range(5)] == taken[4:]
    assert taken[0] != taken[6]  # set_epoch reshuffles


def epoch_permutation(n: int, epoch: int, seed: int = 0) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("n,world,mbs", [(40, 2, 3), (41, 3, 2), (10, 4, 2), (7, 1, 7)])
def test_batches_deal_what_the_distributed_sampler_deals(n, world, mbs):
    rows = [([i], [i]) for i in range(n)]
    for rank in range(world):
        b = data.Batches(rows, mbs, rank=rank, world_size=world, seed=5, pad_id=0)
        got = [i for _ in range(3 * (n // world // mbs)) for i in b.next()["rows"]]  # three epochs
        want = []
        for epoch in range(3):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
            sampler.set_epoch(epoch)
            dealt = list(sampler)
            want += dealt[: len(dealt) // mbs * mbs]
        assert got == want, rank


def test_batches_continue_the_epoch_on_another_world_size_without_repeating_a_row():
    """2 ranks x 3 rows take 4 micro-batches (24 rows of 40), then 3 ranks x 2 rows continue the same epoch's
    permutation at row 24: 16 rows left, 5 per rank (2 micro-batches each), the last row too few for 3 ranks."""
    rows = [([i], [i]) for i in range(40)]
    old = [data.Batches(rows, 3, rank=r, world_size=2, seed=0, pad_id=0) for r in range(2)]
    seen = [i for _ in range(4) for b in old for i in b.next()["rows"]]
    position = old[0].position()
    assert position == old[1].position() == {"epoch": 0, "offset": 24}
    perm = epoch_permutation(40, 0)
    assert sorted(seen) == sorted(perm[:24])
    new = [data.Batches(rows, 2, rank=r, world_size=3, seed=0, pad_id=0) for r in range(3)]
    for b in new:
        b.seek(position)
    first = [b.next()["rows"] for b in new]
    assert first == [[perm[24 + r], perm[24 + r + 3]] for r in range(3)]  # rank r: offset + r + 3j
    second = [b.next()["rows"] for b in new]
    assert second == [[perm[30 + r], perm[33 + r]] for r in range(3)]
    assert sorted(seen + [i for ids in first + second for i in ids]) == sorted(perm[:36])  # no row twice, none skipped but the tail
    assert new[0].position() == {"epoch": 0, "offset": 36}
    assert [b.next()["rows"] for b in new] == [epoch_permutation(40, 1)[r::3][:2] for r in range(3)]  # next epoch as usual


def test_the_position_survives_a_second_change_of_world_size():
    rows = [([i], [i]) for i in range(60)]
    a = data.Batches(rows, 2, rank=0, world_size=3, seed=1, pad_id=0)
    a.next(), a.next()  # 12 rows on 3 ranks
    b = data.Batches(rows, 4, rank=1, world_size=2, seed=1, pad_id=0)
    b.seek(a.position())
    b.next()  # 8 more on 2 ranks
    assert b.position() == {"epoch": 0, "offset": 20}
    c = data.Batches(rows, 5, rank=0, world_size=1, seed=1, pad_id=0)
    c.seek(b.position())
    assert c.next()["rows"] == epoch_permutation(60, 0, seed=1)[20:25]


# ------------------------------------------------------------------ checkpoints

def fake_checkpoint(root: Path, step: int, rank: int, world_size: int = 2, complete: bool = True,
                    save_id: str | None = None) -> None:
    d = checkpointing.step_dir(root, step) / (f"rank-{rank}" if complete else f"rank-{rank}.tmp-x")
    d.mkdir(parents=True)
    if complete:
        meta = {"step": step, "world_size": world_size, **({"save_id": save_id} if save_id else {})}
        (d / "meta.json").write_text(json.dumps(meta))


def test_incomplete_checkpoint_is_not_listed(tmp_path):
    fake_checkpoint(tmp_path, 2, rank=0)
    fake_checkpoint(tmp_path, 4, rank=0, complete=False)
    (checkpointing.step_dir(tmp_path, 6) / "rank-0").mkdir(parents=True)  # no meta.json
    assert checkpointing.complete_steps(tmp_path, rank=0) == {2: 2}
    assert checkpointing.complete_steps(tmp_path, rank=1) == {}


def test_latest_on_another_world_size_reads_one_replica_per_rank_when_the_state_is_replicated(tmp_path, world_of_one):
    """lora: every rank dir holds the whole state, so rank 0 of a world of one resumes from its own rank-0."""
    fake_checkpoint(tmp_path, 2, rank=0, world_size=2, save_id="a")
    resume = checkpointing.resolve("latest", tmp_path, rank=0, world_size=1, replicated=True)
    assert (resume.path, resume.step, resume.world_size, resume.new_world_size) == (tmp_path / "step-2", 2, 2, 1)
    assert resume.sources(0) == (0,) and resume.skipped == "" and resume.rng_state({"x": 1}, 0) == {"x": 1}


def test_a_lora_rank_whose_own_dir_is_gone_reads_another_replica_and_gets_a_fresh_rng_stream(tmp_path, world_of_one):
    """The node of old rank 0 was lost; mnft copied what the others held (rank-1) here."""
    fake_checkpoint(tmp_path, 4, rank=1, world_size=1, save_id="a")  # a (malformed) dir of a world of 1: ignored
    fake_checkpoint(tmp_path, 2, rank=1, world_size=2, save_id="b")
    resume = checkpointing.resolve("latest", tmp_path, rank=0, world_size=1, replicated=True)
    assert (resume.step, resume.sources(0)) == (2, (1,))
    saved = {"python": __import__("random").getstate(), "torch": torch.get_rng_state()}
    assert not torch.equal(resume.rng_state(saved, 0)["torch"], saved["torch"])


def three_nodes(monkeypatch, tmp_path, shared: bool = False) -> list[Path]:
    """Each rank's checkpoints dir on its own node (or one shared dir): agree_latest's all-gather answered from them."""
    roots = [tmp_path / ("shared" if shared else f"n{r}") for r in range(3)]
    monkeypatch.setattr(checkpointing, "_gather", lambda _: [(checkpointing.held_steps(r), f"n{i}", str(r)) for i, r in enumerate(roots)])
    return roots


@pytest.mark.parametrize("shared", [False, True])
def test_a_lora_save_cut_short_on_one_node_resumes_the_step_every_rank_saved_with_its_own_state(monkeypatch, tmp_path, shared):
    """Rank 1's save of step 40 was killed (a temp dir); ranks 0 and 2 completed theirs. Step 40 would give rank 1
    another rank's replica and a new RNG stream; step 36 lets every rank continue its own (exact)."""
    roots = three_nodes(monkeypatch, tmp_path, shared)
    for rank in range(3):
        fake_checkpoint(roots[rank], 36, rank, world_size=3, save_id="a")
        fake_checkpoint(roots[rank], 40, rank, world_size=3, save_id="b", complete=rank != 1)
    for rank in range(3):
        resume = checkpointing.agree_latest(roots[rank], rank, world_size=3, replicated=True)
        assert (resume.step, resume.sources(rank)) == (36, (rank,))
        saved = {"torch": torch.get_rng_state()}
        assert resume.rng_state(saved, rank) is saved  # its own stream goes on
        # on a shared filesystem rank 1 could have read a replica of step 40: the note says why it did not
        assert resume.skipped.startswith("newer step-40 lacks the own dir of rank(s) 1 (a save cut short)") if shared else resume.skipped == ""


def test_a_lora_node_lost_for_good_resumes_the_newest_step_from_a_replica(monkeypatch, tmp_path):
    """Old rank 1's node was replaced by a spare that holds nothing of its own: no step has rank 1's dir, so step 40
    is resumed, rank 1 reading rank 0's replica (mnft copied it there)."""
    roots = three_nodes(monkeypatch, tmp_path)
    for rank in (0, 2):
        for step in (36, 40):
            fake_checkpoint(roots[rank], step, rank, world_size=3, save_id=f"s{step}")
    for step in (36, 40):
        fake_checkpoint(roots[1], step, 0, world_size=3, save_id=f"s{step}")
    resume = checkpointing.agree_latest(roots[1], 1, world_size=3, replicated=True)
    assert (resume.step, resume.sources(1), resume.skipped) == (40, (0,), "")


def test_latest_on_another_world_size_without_every_shard_is_one_line_naming_what_is_missing_where(tmp_path, world_of_one):
    """full: each rank dir holds a shard; without rank-1 here nothing can be resumed: exit 2, nothing guessed."""
    fake_checkpoint(tmp_path, 2, rank=0, world_size=2, save_id="a")
    with pytest.raises(ConfigError) as e:
        checkpointing.resolve("latest", tmp_path, rank=0, world_size=1)
    assert str(e.value) == (
        f"resume=latest: checkpoint {tmp_path}/step-2 was written by 2 ranks and this run has 1: resuming it needs "
        f"all 2 rank dirs (rank-0 .. rank-1) on each node, but {socket.gethostname()}:{tmp_path}/step-2 lacks "
        "rank-1 (new rank 0); copy them there (`train --resume` does) or resume with 2 ranks")
    assert e.value.exit_code == 2
    fake_checkpoint(tmp_path, 2, rank=1, world_size=2, save_id="a")  # copied here, as mnft does before a resume
    resume = checkpointing.resolve("latest", tmp_path, rank=0, world_size=1)
    assert resume.step == 2 and resume.sources(0) == (0, 1)


def test_latest_never_mixes_rank_dirs_of_different_saves_of_a_step(tmp_path, world_of_one):
    """step-4's rank-1 here is a stale copy from another save: step-4 is not complete, step-2 is."""
    for rank in (0, 1):
        fake_checkpoint(tmp_path, 2, rank=rank, world_size=2, save_id="a")
    fake_checkpoint(tmp_path, 4, rank=0, world_size=2, save_id="b")
    fake_checkpoint(tmp_path, 4, rank=1, world_size=2, save_id="stale")
    resume = checkpointing.resolve("latest", tmp_path, rank=0, world_size=1)
    assert resume.step == 2
    assert resume.skipped.startswith(f"newer checkpoint {tmp_path}/step-4 was written by 2 ranks")


def test_latest_on_the_same_world_size_prefers_its_own_save(tmp_path, world_of_one):
    fake_checkpoint(tmp_path, 6, rank=0, world_size=1, save_id="new")
    fake_checkpoint(tmp_path, 6, rank=1, world_size=3, save_id="old")  # left by an earlier, larger world
    resume = checkpointing.resolve("latest", tmp_path, rank=0, world_size=1)
    assert (resume.step, resume.world_size, resume.sources(0)) == (6, 1, (0,))


def test_a_rank_new_to_the_run_gets_a_derived_rng_stream_and_old_ranks_keep_theirs(tmp_path):
    saved = {"python": __import__("random").getstate(), "torch": torch.get_rng_state()}
    grow = checkpointing.Resume(tmp_path, 40, world_size=2, new_world_size=4, replicated=True)
    assert grow.rng_state(saved, 1) is saved
    before = torch.get_rng_state()
    two, three = grow.rng_state(saved, 2), grow.rng_state(saved, 3)
    assert torch.equal(torch.get_rng_state(), before)  # the process's own stream is left alone
    assert torch.equal(two["torch"], grow.rng_state(saved, 2)["torch"])  # deterministic
    assert not torch.equal(two["torch"], three["torch"]) and not torch.equal(two["torch"], saved["torch"])
    later = checkpointing.Resume(tmp_path, 60, world_size=2, new_world_size=4, replicated=True)
    assert not torch.equal(later.rng_state(saved, 2)["torch"], two["torch"])


def test_latest_without_checkpoints_starts_fresh(tmp_path, world_of_one):
    assert checkpointing.resolve("latest", tmp_path / "none", rank=0, world_size=1) is None


def test_a_changed_world_or_global_batch_is_one_line_and_an_event_and_nothing_else_is(tmp_path, capsys):
    from mnft.recipes import metrics

    log = metrics.Metrics(tmp_path, True, 10, tensorboard=False, resumed=False)
    position = {"epoch": 1, "offset": 960}
    same = checkpointing.Resume(tmp_path / "step-40", 40, world_size=2, new_world_size=2, replicated=True)
    checkpointing.announce(same, {"global_batch": 16}, 16, position, log)
    assert capsys.readouterr().out == ""
    checkpointing.announce(same, {"global_batch": 16}, 32, position, log)  # micro_batch_size doubled
    assert capsys.readouterr().out == ("resumed: step-40 was written by 2 ranks, resuming on 2: global batch 16 -> 32 "
                                       "rows per step; data continues epoch 1 at row 960\n")
    shrink = checkpointing.Resume(tmp_path / "step-40", 40, world_size=3, new_world_size=2, replicated=False)
    checkpointing.announce(shrink, {"global_batch": 24}, 16, position, log)
    assert capsys.readouterr().out.startswith("resharded: step-40 was written by 3 ranks, resuming on 2: global batch 24 -> 16")
    log.close()
    events = [{k: v for k, v in r.items() if k != "time"} for r in records(tmp_path / "metrics.jsonl")]
    assert events[-1] == {"event": "reshard", "step": 40, "from_world_size": 3, "to_world_size": 2,
                          "from_global_batch": 24, "to_global_batch": 16, "data": position}
    assert len(events) == 2


def test_resume_path_on_another_world_size_names_the_missing_rank_dirs(tmp_path, world_of_one):
    fake_checkpoint(tmp_path, 2, rank=1, world_size=2, save_id="a")
    with pytest.raises(ConfigError, match=r"^resume=.*step-2: checkpoint .*step-2 was written by 2 ranks and this "
                                          r"run has 1: .* lacks rank-0 \(new rank 0\)"):
        checkpointing.resolve(str(tmp_path / "step-2"), tmp_path / "elsewhere", rank=0, world_size=1)
    fake_checkpoint(tmp_path, 2, rank=0, world_size=2, save_id="a")
    resume = checkpointing.resolve(str(tmp_path / "step-2"), tmp_path / "elsewhere", rank=0, world_size=1)
    assert (resume.path, resume.step, resume.world_size) == (tmp_path / "step-2", 2, 2)


def test_resume_path_without_this_ranks_dir_on_the_same_world_size_is_refused(tmp_path, world_of_one):
    (tmp_path / "step-2").mkdir()
    with pytest.raises(RecipeError, match=r"no complete checkpoint for rank\(s\) \[0\]"):
        checkpointing.resolve(str(tmp_path / "step-2"), tmp_path / "elsewhere", rank=0, world_size=1)


def test_prune_keeps_last_k_of_this_rank(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step, rank=0)
    fake_checkpoint(tmp_path, 6, rank=0, complete=False)
    checkpointing.prune(tmp_path, rank=0, keep_last=2, current=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    assert [p.name for p in (tmp_path / "step-6").iterdir()] == ["rank-0"]


def test_prune_removes_copies_of_other_ranks_once_this_rank_keeps_enough_of_its_own(tmp_path):
    """Copies made for a resume (rank-1, rank-2 of step-3 here) have no owner on this node: they go with the
    step once it is older than the checkpoints kept; never before this rank holds keep_last of its own."""
    for rank in (1, 2):
        fake_checkpoint(tmp_path, 3, rank=rank, world_size=3)
    fake_checkpoint(tmp_path, 6, rank=0, world_size=1)
    checkpointing.prune(tmp_path, rank=0, keep_last=2, current=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-6"]
    fake_checkpoint(tmp_path, 9, rank=0, world_size=1)
    checkpointing.prune(tmp_path, rank=0, keep_last=2, current=9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-9"]


def test_prune_never_deletes_the_step_just_written_nor_later_steps(tmp_path):
    for step in (10, 30, 150, 200):  # 150, 200: left by a run resumed from an earlier step-30 PATH
        fake_checkpoint(tmp_path, step, rank=0)
    fake_checkpoint(tmp_path, 50, rank=0)
    checkpointing.prune(tmp_path, rank=0, keep_last=2, current=50)
    assert sorted(checkpointing.complete_steps(tmp_path, rank=0)) == [30, 50, 150, 200]


def test_a_fresh_run_refuses_an_output_dir_holding_checkpoints(tmp_path, world_of_one):
    root = tmp_path / "checkpoints"
    for step in (150, 200):
        fake_checkpoint(root, step, rank=0, world_size=1)
    with pytest.raises(ConfigError) as e:
        checkpointing.resolve("none", root, rank=0, world_size=1)
    assert str(e.value) == (f"output_dir holds checkpoints of an earlier run ({root}: step-200 and 1 more): continue "
                            "it with resume=latest, use another output_dir, or pass overwrite=true to delete them")
    assert sorted(checkpointing.complete_steps(root, rank=0)) == [150, 200]  # nothing touched


def test_a_fresh_run_ignores_incomplete_checkpoints_and_empty_dirs(tmp_path, world_of_one):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 4, rank=0, complete=False)
    assert checkpointing.resolve("none", root, rank=0, world_size=1) is None
    assert checkpointing.resolve("none", tmp_path / "new", rank=0, world_size=1) is None


def test_overwrite_deletes_the_earlier_runs_checkpoints(tmp_path, world_of_one):
    root = tmp_path / "checkpoints"
    for step in (150, 200):
        fake_checkpoint(root, step, rank=0, world_size=1)
    fake_checkpoint(root, 250, rank=0, complete=False)
    assert checkpointing.resolve("none", root, rank=0, world_size=1, overwrite=True) is None
    assert list(root.iterdir()) == []
    assert checkpointing.resolve("latest", root, rank=0, world_size=1) is None


# ------------------------------------------------------------------ 2-process runs (slow)

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens", "skipped_steps", "peak_memory_mb",
             "time"}


def run_ok(recipe, home, *args):
    res = torchrun(recipe, home, *args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe,layout", [("lora", "{rank}"), ("full", "")])
def test_kill_then_resume_reproduces_uninterrupted_losses(recipe, layout, home, tmp_path):
    """Per-rank output dirs (``{rank}``) emulate nodes that share no filesystem; ``full`` shares one dir."""
    common_args = ["max_steps=8", "save_every=2", "keep_last=3", "log_every=3", "micro_batch_size=4"]
    a, b = tmp_path / "a" / layout, tmp_path / "b" / layout
    res = run_ok(recipe, home, f"output_dir={a}", *common_args)
    assert "rank=0/2 node_rank=0 local_rank=0" in res.stdout and "rank=1/2 node_rank=0 local_rank=1" in res.stdout
    main = Path(str(a).format(rank=0))
    recs = records(main / "metrics.jsonl")
    steps = [r for r in recs if "event" not in r]
    # metrics every step; log_every only throttles the progress line (steps 3, 6 and the last)
    assert [r["step"] for r in steps] == list(range(1, 9)) and all(STEP_KEYS <= set(r) for r in steps)
    assert [line.split()[1] for line in res.stdout.splitlines() if line.startswith("step ")] == ["3/8", "6/8", "8/8"]
    assert recs[-2]["event"] == "summary" and recs[-2]["steps"] == 8 and recs[-1]["event"] == "saved"

    crashed = torchrun(recipe, home, f"output_dir={b}", *common_args, "debug_crash_after_step=5")
    assert crashed.returncode != 0
    rank_dir = lambda r: Path(str(b).format(rank=r)) / "checkpoints"  # noqa: E731
    assert checkpointing.complete_steps(rank_dir(0), 0) == {2: 2, 4: 2}
    # a newer step complete on rank 0 only, and a half-written one on rank 1: latest must still be step 4
    shutil.copytree(rank_dir(0) / "step-4" / "rank-0", rank_dir(0) / "step-6" / "rank-0")
    (rank_dir(0) / "step-6" / "rank-0" / "meta.json").write_text(json.dumps({"step": 6, "world_size": 2}))
    (rank_dir(1) / "step-6" / "rank-1.tmp-dead").mkdir(parents=True)
    res = run_ok(recipe, home, f"output_dir={b}", *common_args, "resume=latest")
    assert "resuming from" in res.stdout and "step-4" in res.stdout

    want, got = losses(main / "metrics.jsonl"), losses(Path(str(b).format(rank=0)) / "metrics.jsonl")
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step

    # a fresh run into the same output_dir would mix its steps with these: refused, one line, nothing deleted
    again = torchrun(recipe, home, f"output_dir={b}", *common_args)
    assert again.returncode != 0  # each rank exits 2; torchrun itself reports any failed child as 1
    assert [line for line in again.stderr.splitlines() if line.startswith("mnft.recipes:")][0] == (
        f"mnft.recipes: output_dir holds checkpoints of an earlier run ({rank_dir(0)}: step-8 and 2 more): "
        "continue it with resume=latest, use another output_dir, or pass overwrite=true to delete them")
    assert sorted(checkpointing.complete_steps(rank_dir(0), 0)) == [4, 6, 8]

    if recipe == "lora":  # adapters in PEFT format, loadable onto the base
        import peft
        base, _ = model.load(home / ".cache" / "mnft" / "models" / model.tiny_key(), torch.float32)
        peft.PeftModel.from_pretrained(base, main / "adapter")
    else:  # the gathered full model loads with from_pretrained
        net, _ = model.load(main / "model", torch.float32)
        assert sum(p.numel() for p in net.parameters()) > 0


def launch(recipe: str, home: Path, world: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(recipe, home, *args, nproc=world) if world > 1 else single(recipe, home, *args)


def replicate(out: Path, step: int, ranks: int) -> None:
    """What mnft does before a resume when nodes share no filesystem: every rank dir of the step on every node
    (here: in every rank's ``output_dir``)."""
    parts = {p.name: p for r in range(ranks) for p in (out / str(r) / "checkpoints" / f"step-{step}").glob("rank-*")}
    for r in range(ranks):
        for name, part in parts.items():
            if not (out / str(r) / "checkpoints" / f"step-{step}" / name).exists():
                shutil.copytree(part, out / str(r) / "checkpoints" / f"step-{step}" / name)


def exported(recipe: str, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = out / ("adapter" if recipe == "lora" else "model")
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def step_records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(path) if "event" not in r}  # a re-run step's later line wins


def in_order(per_rank: list[list[int]]) -> list[int]:
    """A step's rows in the order of the epoch's permutation: rank r of W took positions r, r + W, r + 2W, ..."""
    return [ids[t] for t in range(len(per_rank[0])) for ids in per_rank]


@pytest.fixture(scope="module")
def forty_rows(tmp_path_factory) -> Path:
    """The first 40 rows of the recipes' instruct data: 5 steps an epoch at a global batch of 8."""
    lines = (REPO / "mnft" / "recipes" / "assets" / "instruct.jsonl").read_text().splitlines()[:40]
    path = tmp_path_factory.mktemp("forty") / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def uninterrupted_1x8(tmp_path_factory, home):
    """recipe, args -> the step records of an uninterrupted run on 1 rank x 8 rows for 6 steps, run once per
    recipe and args in this module (a reference several tests compare with)."""
    made: dict[tuple, dict[int, dict]] = {}

    def get(recipe: str, args: list[str]) -> dict[int, dict]:
        key = (recipe, tuple(args))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ref-{recipe}")
            ref = launch(recipe, home, 1, f"output_dir={out}", "micro_batch_size=8", "max_steps=6", *args)
            assert ref.returncode == 0, ref.stderr[-3000:]
            made[key] = step_records(out / "metrics.jsonl")
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe,before,after", [("lora", 2, 1), ("lora", 1, 2), ("full", 2, 1)])
def test_a_checkpoint_resumes_on_another_world_size_with_the_same_state_and_the_data_continued(
        recipe, before, after, home, tmp_path, forty_rows, uninterrupted_1x8):
    """Per-rank output dirs emulate nodes that share no filesystem. 40 rows, a global batch of 8 rows (8 / W per
    rank, constant lr): 5 steps an epoch. A run on ``before`` ranks saves step 3; ``after`` ranks resume it:
    - without the old rank dirs they need where they run (full: all of them; lora: their own old rank's, or
      rank-0's for a new rank) the resume is refused in one line, exit 2, nothing touched;
    - with them copied (as mnft does) the state is the saved one: the model exported at once equals the model
      exported at step 3; steps 4-6 reproduce the losses and the rows of an uninterrupted 1 x 8 run (the loss is
      normalised by the global token count, so 2 ranks x 4 rows and 1 x 8 are the same step), and step 6 starts
      epoch 1;
    - a second change, back to ``before`` ranks with a global batch of 4, continues epoch 1 at row 8 and says so
      in a line and a ``reshard`` event."""
    args = [f"data_path={forty_rows}", "save_every=3", "keep_last=3", "warmup_steps=0", "min_lr_ratio=1",
            "tensorboard=false", "debug_sample_ids=true", "log_every=1"] + (["lora_dropout=0"] if recipe == "lora" else [])
    out, metrics_file = tmp_path / "run", tmp_path / "run" / "0" / "metrics.jsonl"

    def run(world: int, batch: int, *extra: str) -> subprocess.CompletedProcess:
        return launch(recipe, home, world, f"output_dir={out}/{{rank}}", f"micro_batch_size={batch // world}", *args, *extra)

    want = uninterrupted_1x8(recipe, args)
    res = run(before, 8, "max_steps=3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    saved = exported(recipe, out / "0")

    if recipe == "full" or after > before:
        res = run(after, 8, "max_steps=3", "resume=latest")
        assert res.returncode == (2 if after == 1 else 1), res.stderr[-3000:]  # torchrun: 1 when a child fails
        errors = [line for line in res.stderr.splitlines() if line.startswith("mnft.recipes:")]
        lacking, new_rank = ("rank-1", 0) if recipe == "full" else ("rank-0", 1)
        assert len(errors) == 1 and errors[0].startswith(
            f"mnft.recipes: resume=latest: checkpoint {out}/0/checkpoints/step-3 was written by {before} ranks and "
            f"this run has {after}: resuming it needs "), errors
        assert (f"but {socket.gethostname()}:{out}/{new_rank}/checkpoints/step-3 lacks {lacking} (new rank {new_rank}); "
                f"copy them there (`train --resume` does) or resume with {before} ranks") in errors[0]
        assert not (out / str(new_rank) / "checkpoints" / "step-3" / lacking).exists()
        replicate(out, 3, max(before, after))
    res = run(after, 8, "max_steps=3", "resume=latest")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (f"resharded: step-3 was written by {before} ranks, resuming on {after}: global batch 8 -> 8 rows per "
            "step; data continues epoch 0 at row 24") in res.stdout
    now = exported(recipe, out / "0")
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)

    res = run(after, 8, "max_steps=6", "resume=latest")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = step_records(metrics_file)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
        assert in_order(got[step]["sample_ids"]) == want[step]["sample_ids"][0], step
    assert in_order(got[6]["sample_ids"]) == epoch_permutation(40, 1)[:8]

    replicate(out, 6, max(before, after))
    res = run(before, 4, "max_steps=9", "resume=latest")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (f"resharded: step-6 was written by {after} ranks, resuming on {before}: global batch 8 -> 4 rows per "
            "step; data continues epoch 1 at row 8") in res.stdout
    event = [r for r in records(metrics_file) if r.get("event") == "reshard"][-1]
    assert {k: v for k, v in event.items() if k != "time"} == {
        "event": "reshard", "step": 6, "from_world_size": after, "to_world_size": before, "from_global_batch": 8,
        "to_global_batch": 4, "data": {"epoch": 1, "offset": 8}}
    got = step_records(metrics_file)
    for step in (7, 8, 9):
        assert in_order(got[step]["sample_ids"]) == epoch_permutation(40, 1)[8 + 4 * (step - 7): 12 + 4 * (step - 7)]
    assert [r for r in records(metrics_file) if r.get("event") == "summary"][-1]["steps"] == 9


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_non_finite_steps_are_skipped_on_all_ranks_counted_then_abort(recipe, home, tmp_path):
    """NaN loss on the last rank at steps 2, 5, 6; at step 4 a finite loss but an inf gradient on the last rank
    only. Every rank skips each of them (its parameters unchanged), counts them, and aborts after 3 in a row."""
    res = torchrun(recipe, home, f"output_dir={tmp_path}", "max_steps=10", "log_every=1", "micro_batch_size=4",
                   "debug_nan_steps=[2,5,6]", "debug_inf_grad_steps=[4]", "max_consecutive_skips=3",
                   "save_final=false", "debug_rank_checksums=true")
    assert res.returncode != 0, res.stderr[-3000:]
    assert "3 steps in a row had a non-finite loss or grad norm (last at step 6" in res.stderr
    by_step = {r["step"]: r for r in records(tmp_path / "metrics.jsonl") if "event" not in r}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    assert [by_step[s]["skipped_steps"] for s in range(1, 7)] == [0, 1, 1, 2, 3, 4]
    assert [by_step[s]["skipped"] for s in range(1, 7)] == [False, True, False, True, True, True]
    assert by_step[2]["loss"] == "nan" and isinstance(by_step[3]["loss"], float)  # JSON-safe non-finite
    assert isinstance(by_step[4]["loss"], float)  # the grad-only case: FSDP2's norm is global (inf on every
    # rank); under DDP rank 0's own norm stays finite and only rank 1's all-reduced flag makes rank 0 skip
    assert by_step[4]["grad_norm"] == "inf" if recipe == "full" else isinstance(by_step[4]["grad_norm"], float)
    sums = {s: by_step[s]["rank_checksums"] for s in by_step}
    assert all(len(c) == 2 for c in sums.values())
    for s in (2, 4, 5, 6):  # skipped: no rank moved
        assert sums[s] == sums[s - 1], s
    for s in (3,):  # a good step after a skipped one: every rank moved
        assert all(now != before for now, before in zip(sums[s], sums[s - 1])), s
    if recipe == "lora":  # DDP: every rank holds the same adapters
        assert all(c[0] == c[1] for c in sums.values())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_a_rank_whose_batches_are_all_masked_trains_safely(recipe, home, tiny_dir, tmp_path):
    """Rank 0 gets only rows whose response is truncated away (no trained token), rank 1 only normal rows:
    the step's loss is rank 1's, nothing is skipped, and the update reaches every rank."""
    n, seq = 16, 32
    rank0 = set(data.Batches([([i], [i]) for i in range(n)], n // 2, rank=0, world_size=2, seed=0, pad_id=0)
                .next()["input_ids"][:, 0].tolist())  # the rows the recipe's sampler deals rank 0 in epoch 0
    masked = {"instruction": "Count up from 1 to 30 " * 8, "response": "1 2 3"}
    normal = {"instruction": "Count up from 1 to 3", "response": "1 2 3"}
    rows = [masked if i in rank0 else normal for i in range(n)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, tok = model.load(tiny_dir, torch.float32)
    assert all(x == data.IGNORE for x in data.tokenize(tok, masked, seq)[1])
    per_normal_row = data.trained_tokens(data.collate([data.tokenize(tok, normal, seq)], tok.pad_token_id))
    assert per_normal_row > 0

    run_ok(recipe, home, f"output_dir={tmp_path}/out", f"data_path={tmp_path}/d.jsonl", f"max_seq_len={seq}",
           "max_steps=2", "micro_batch_size=4", "save_final=false", "debug_rank_checksums=true")
    steps = [r for r in records(tmp_path / "out" / "metrics.jsonl") if "event" not in r]
    assert [(r["trained_tokens"], r["skipped_steps"]) for r in steps] == [(4 * per_normal_row, 0)] * 2
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 and isinstance(r["grad_norm"], float) for r in steps)
    first, second = steps[0]["rank_checksums"], steps[1]["rank_checksums"]
    assert all(a != b for a, b in zip(first, second))  # both ranks updated at step 2
    if recipe == "lora":
        assert first[0] == first[1] and second[0] == second[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_all_masked_batches_train_safely(home, tmp_path):
    rows = [{"instruction": "Count up from 1 to 30 " * 4, "response": "1 2 3"} for _ in range(8)]
    (tmp_path / "masked.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = single("full", home, f"output_dir={tmp_path}/out", f"data_path={tmp_path}/masked.jsonl",
                 "max_seq_len=16", "max_steps=2", "micro_batch_size=4", "save_final=false")
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in records(tmp_path / "out" / "metrics.jsonl") if "event" not in r]
    assert [(r["trained_tokens"], r["loss"], r["skipped_steps"]) for r in steps] == [(0, 0.0, 0), (0, 0.0, 0)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_the_loss_is_normalised_by_global_trained_tokens_whatever_the_split(recipe, home, tmp_path):
    """The same 8 rows per step as 2 ranks x micro-batch 4, as 1 rank x micro-batch 4 x accumulation 2, and as
    1 rank x micro-batch 8 (the sampler deals rank r every other row of one shuffled order) must give the same
    losses and gradient norms: a per-micro-batch or per-rank mean would weight rows differently."""
    args = ["max_steps=3", "save_final=false", "tensorboard=false"] + (["lora_dropout=0"] if recipe == "lora" else [])
    run_ok(recipe, home, f"output_dir={tmp_path}/ranks", "micro_batch_size=4", *args)
    for name, split in (("accum", ["micro_batch_size=4", "grad_accum_steps=2"]), ("one", ["micro_batch_size=8"])):
        res = single(recipe, home, f"output_dir={tmp_path}/{name}", *split, *args)
        assert res.returncode == 0, res.stderr[-3000:]

    def trajectory(name):
        return [(r["loss"], r["grad_norm"], r["trained_tokens"])
                for r in records(tmp_path / name / "metrics.jsonl") if "event" not in r]

    want = trajectory("ranks")
    assert len(want) == 3 and len({loss for loss, _, _ in want}) == 3  # it trains: three different losses
    for name in ("accum", "one"):
        got = trajectory(name)
        assert [t for _, _, t in got] == [t for _, _, t in want], name
        for (loss, norm, _), (loss_want, norm_want, _) in zip(got, want):
            assert loss == pytest.approx(loss_want, abs=1e-5), name
            assert norm == pytest.approx(norm_want, abs=1e-5), name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_merged_export_matches_the_peft_model_with_checkpointing_and_packing(home, tmp_path):
    import peft

    run_ok("lora", home, f"output_dir={tmp_path}", "max_steps=3", "micro_batch_size=4", "activation_checkpointing=true",
           "packing=true", "export_merged=true", "tensorboard=false")
    base_dir = home / ".cache" / "mnft" / "models" / model.tiny_key()
    base, tok = model.load(base_dir, torch.float32)
    ids = torch.tensor([tok("### Instruction:\nCount down from 9 to 3\n### Response:\n9 8 7")["input_ids"]])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
        merged, _ = model.load(tmp_path / "merged", torch.float32)
        merged_logits = merged.eval()(input_ids=ids).logits
    assert not torch.allclose(peft_logits, base_logits, atol=1e-3)  # the adapters learned something
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_demo_bar_default_config_halves_the_loss_on_two_processes(recipe, home, tmp_path):
    """The demo bar: the default config, 2 processes on CPU, ends at <= 50% of its initial loss. Its time goal
    (<= 90 s) is measured by `python bench/recipe.py --demo-bar`, never asserted here."""
    run_ok(recipe, home, f"output_dir={tmp_path}")
    summary = [r for r in records(tmp_path / "metrics.jsonl") if r.get("event") == "summary"][-1]
    assert summary["steps"] == load_config(recipe, []).max_steps and summary["skipped_steps"] == 0
    assert summary["final_loss"] <= 0.5 * summary["initial_loss"], summary
