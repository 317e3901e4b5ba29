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


def torchrun(recipe: str, home: Path, *args: str, nproc: int = 2, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", f"mnft.recipes.{recipe}", *args]
    return subprocess.run(cmd, env=env_for(home), cwd=REPO, capture_output=True, text=True, timeout=timeout)


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
    taken = [a.next()["input_ids"].tolist() for _ in range(9)]  # crosses an epoch boundary (6 per epoch)
    b = data.Batches(rows, 3, rank=1, world_size=2, seed=0, pad_id=0)
    b.seek({"epoch": 0, "index": 4})
    assert [b.next()["input_ids"].tolist() for _ in range(5)] == taken[4:]
    assert taken[0] != taken[6]  # set_epoch reshuffles


# ------------------------------------------------------------------ checkpoints

def fake_checkpoint(root: Path, step: int, rank: int, world_size: int = 2, complete: bool = True) -> None:
    d = checkpointing.step_dir(root, step) / (f"rank-{rank}" if complete else f"rank-{rank}.tmp-x")
    d.mkdir(parents=True)
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size}))


def test_incomplete_checkpoint_is_not_listed(tmp_path):
    fake_checkpoint(tmp_path, 2, rank=0)
    fake_checkpoint(tmp_path, 4, rank=0, complete=False)
    (checkpointing.step_dir(tmp_path, 6) / "rank-0").mkdir(parents=True)  # no meta.json
    assert checkpointing.complete_steps(tmp_path, rank=0) == {2: 2}
    assert checkpointing.complete_steps(tmp_path, rank=1) == {}


def test_latest_refuses_a_different_world_size(tmp_path, world_of_one):
    fake_checkpoint(tmp_path, 2, rank=0, world_size=2)
    with pytest.raises(RecipeError, match="written by 2 ranks but this run has 1"):
        checkpointing.resolve("latest", tmp_path, rank=0, world_size=1)


def test_latest_without_checkpoints_starts_fresh(tmp_path, world_of_one):
    assert checkpointing.resolve("latest", tmp_path / "none", rank=0, world_size=1) is None


def test_resume_path_refuses_a_different_world_size(tmp_path, world_of_one):
    fake_checkpoint(tmp_path, 2, rank=0, world_size=2)
    with pytest.raises(RecipeError, match="step-2 was written by 2 ranks but this run has 1"):
        checkpointing.resolve(str(tmp_path / "step-2"), tmp_path / "elsewhere", rank=0, world_size=1)


def test_prune_keeps_last_k_of_this_rank(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step, rank=0)
    fake_checkpoint(tmp_path, 6, rank=0, complete=False)
    checkpointing.prune(tmp_path, rank=0, keep_last=2, current=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    assert [p.name for p in (tmp_path / "step-6").iterdir()] == ["rank-0"]


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
