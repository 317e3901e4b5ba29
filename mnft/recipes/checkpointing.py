"""Checkpoints with ``torch.distributed.checkpoint`` that work when nodes share no filesystem.

Layout under ``<output_dir>/checkpoints/``::

    step-40/rank-0/   .metadata  __0_0.distcp  meta.json      <- written by rank 0 where rank 0 runs
    step-40/rank-1/   ...                                    <- written by rank 1 where rank 1 runs

Every rank saves at the same step (all ranks participate; a barrier follows) its own DCP checkpoint -- its
FSDP shards or its copy of the adapters, optimizer state, scheduler, step, data position, RNG state -- together
with DCP metadata, so a rank never needs a file another node wrote. A rank first writes ``rank-R.tmp-*`` and
renames it to ``rank-R`` when complete (``meta.json`` last): a crash mid-save leaves only a temp dir, which is
ignored and later removed. Step N is *complete* for the run when every rank has its ``rank-R``; ``latest`` is
the newest step complete on every rank, agreed by an all-gather, so all ranks resume from the same step.
A fresh run (``resume=none``) refuses an output dir that already holds complete checkpoints (``overwrite=true``
deletes them), so two runs' steps are never pruned or resumed as one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mnft.recipes.config import ConfigError, RecipeError

STEP_RE = re.compile(r"^step-(\d+)$")
# no_dist=True is deliberate (each rank writes a self-contained checkpoint): silence DCP's notice about it
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def complete_steps(root: Path, rank: int) -> dict[int, int]:
    """``{step: world_size}`` of the checkpoints this rank holds complete under ``root``."""
    found = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        m = STEP_RE.match(entry.name)
        meta = entry / f"rank-{rank}" / "meta.json"
        if m and meta.is_file():
            try:
                found[int(m.group(1))] = int(json.loads(meta.read_text())["world_size"])
            except (ValueError, KeyError, OSError):
                continue  # unreadable meta: not complete
    return found


def save(root: Path, step: int, state: dict, meta: dict, rank: int, world_size: int, keep_last: int) -> Path:
    """Save this rank's ``state`` for ``step``; collective (every rank must call it at the same step)."""
    final = step_dir(root, step) / f"rank-{rank}"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"rank-{rank}.tmp-", dir=final.parent))
    dcp.save(state, checkpoint_id=tmp, no_dist=True)
    meta = {**meta, "step": step, "rank": rank, "world_size": world_size, "time": time.time()}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # a stale copy of the same step (e.g. a run resumed from an earlier step)
        shutil.rmtree(final)
    os.rename(tmp, final)
    dist.barrier()  # now step is complete on every rank: older ones may go
    prune(root, rank, keep_last, current=step)
    return final.parent


def prune(root: Path, rank: int, keep_last: int, current: int) -> None:
    """Keep this rank's newest ``keep_last`` complete checkpoints up to step ``current`` (the one just written);
    remove its older ones and stale temps. Steps after ``current`` (left by a run resumed from an earlier PATH)
    are never touched, so the checkpoint just written always survives.

    Other ranks on the same filesystem prune concurrently, so every listing tolerates vanished entries."""
    steps = sorted(s for s in complete_steps(root, rank) if s <= current)
    for step in steps[:-keep_last]:
        shutil.rmtree(step_dir(root, step) / f"rank-{rank}", ignore_errors=True)
        try:
            step_dir(root, step).rmdir()  # succeeds for the last rank on this filesystem to remove its part
        except OSError:
            pass
    for step in steps:
        try:
            names = os.listdir(step_dir(root, step))
        except OSError:
            continue
        for name in names:
            if name.startswith(f"rank-{rank}.tmp-"):  # left by a crash mid-save
                shutil.rmtree(step_dir(root, step) / name, ignore_errors=True)


def agree_latest(root: Path, rank: int, world_size: int) -> int | None:
    """The newest step complete on every rank (collective), or None. Refuses another world size."""
    mine = complete_steps(root, rank)
    everyone: list[dict[int, int] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for r, steps in enumerate(everyone):
        for step, ws in sorted(steps.items()):
            if ws != world_size:
                raise RecipeError(
                    f"checkpoint {step_dir(root, step)} was written by {ws} ranks but this run has {world_size}; "
                    f"resuming onto a different world size is not supported (use {ws} ranks, or resume=none "
                    "with a new output_dir)")
    common = set.intersection(*(set(s) for s in everyone))
    return max(common) if common else None


def clear(root: Path, rank: int) -> None:
    """Delete this rank's parts (complete or temp) of every checkpoint under ``root``, then empty step dirs."""
    for entry in list(root.iterdir()) if root.is_dir() else []:
        if not STEP_RE.match(entry.name):
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            if name == f"rank-{rank}" or name.startswith(f"rank-{rank}.tmp-"):
                shutil.rmtree(entry / name, ignore_errors=True)
        try:
            entry.rmdir()
        except OSError:
            pass  # another rank's part is still there


def check_fresh(root: Path, rank: int, world_size: int, overwrite: bool) -> None:
    """A fresh run (``resume=none``) must not mix its checkpoints with an earlier run's (collective).

    Old steps would be pruned together with the new ones (an old step-200 outranks a new step-50) and a later
    ``resume=latest`` would pick them. So refuse, on every rank, when any rank's ``root`` holds a complete
    checkpoint (bad input: exit 2) -- unless ``overwrite``: then each rank deletes its own parts first."""
    mine = sorted(complete_steps(root, rank))
    everyone: list[tuple[str, list[int]] | None] = [None] * world_size
    dist.all_gather_object(everyone, (str(root), mine))
    found = [(where, steps) for where, steps in everyone if steps]
    if not found:
        return
    if overwrite:
        clear(root, rank)
        dist.barrier()
        return
    where, steps = found[0]
    raise ConfigError(
        f"output_dir holds checkpoints of an earlier run ({where}: step-{steps[-1]}"
        f"{f' and {len(steps) - 1} more' if len(steps) > 1 else ''}): continue it with resume=latest, "
        "use another output_dir, or pass overwrite=true to delete them")


def resolve(resume: str, root: Path, rank: int, world_size: int, overwrite: bool = False) -> Path | None:
    """The checkpoint step dir to resume from for ``resume=none|latest|PATH`` (collective)."""
    if resume == "none":
        check_fresh(root, rank, world_size, overwrite)
        return None
    if resume == "latest":
        step = agree_latest(root, rank, world_size)
        return None if step is None else step_dir(root, step)
    path = Path(resume).expanduser()
    meta = path / f"rank-{rank}" / "meta.json"
    ok = meta.is_file()
    flags = [None] * world_size
    dist.all_gather_object(flags, ok)
    if not all(flags):
        missing = [r for r, f in enumerate(flags) if not f]
        raise RecipeError(f"resume={resume}: no complete checkpoint for rank(s) {missing} "
                          f"(expected {path}/rank-R/meta.json on each rank's node)")
    ws = json.loads(meta.read_text())["world_size"]
    if ws != world_size:
        raise RecipeError(f"checkpoint {path} was written by {ws} ranks but this run has {world_size}; "
                          "resuming onto a different world size is not supported")
    return path


def load(path: Path, state: dict, rank: int) -> dict:
    """Load this rank's part of checkpoint ``path`` into ``state`` (in place); return its meta."""
    dcp.load(state, checkpoint_id=path / f"rank-{rank}", no_dist=True)
    return json.loads((path / f"rank-{rank}" / "meta.json").read_text())
