"""Checkpoints with ``torch.distributed.checkpoint`` that work when nodes share no filesystem.

Layout under ``<output_dir>/checkpoints/``::

    step-40/rank-0/   .metadata  __0_0.distcp  meta.json      <- written by rank 0 where rank 0 runs
    step-40/rank-1/   ...                                    <- written by rank 1 where rank 1 runs

Every rank saves at the same step (all ranks participate; a barrier follows) its own DCP checkpoint -- its
FSDP shards or its copy of the adapters, optimizer state, scheduler, step, data position, RNG state -- together
with DCP metadata, so a rank never needs a file another node wrote. A rank first writes ``rank-R.tmp-*`` and
renames it to ``rank-R`` when complete (``meta.json`` last): a crash mid-save leaves only a temp dir, which is
ignored and later removed. ``meta.json`` records the world size that wrote the step and a ``save_id`` that the
ranks of that save agreed on, so dirs of one save are never mixed with another run's dirs of the same step.

*Complete* (what ``resume=latest`` resumes from): step N is complete for the resuming world when, for one save
of it (world size W, save id), every rank can read, where it runs, the ``rank-R`` dirs of that save it needs:
``full`` with the same world size its own ``rank-R`` (as always), on another world size (resharding, see
``mnft.recipes.reshard``) all W dirs; ``lora`` (the dirs are replicas) its own old rank's dir or, when that is
not there (a rank new to the run, or its host lost), any one dir of that save -- but on the same world size only
when no step has every rank's own dir: a save cut short on one node is passed over for the step before it, so
every rank continues its own state and RNG stream. ``mnft`` copies the dirs to every node before a resume;
without them a resume on another world size fails with a one-line error naming what is missing where.
``latest`` is the newest complete step, agreed by an all-gather, so all ranks resume from it.
A fresh run (``resume=none``) refuses an output dir that already holds complete checkpoints (``overwrite=true``
deletes them), so two runs' steps are never pruned or resumed as one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mnft.recipes import dist as mdist
from mnft.recipes import reshard
from mnft.recipes.config import ConfigError, RecipeError

STEP_RE = re.compile(r"^step-(\d+)$")
RANK_RE = re.compile(r"^rank-(\d+)$")
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


def held(step_path: Path) -> dict[int, reshard.Writer]:
    """The complete ``rank-R`` dirs readable in ``step_path`` (own or copied here): old rank -> (world size, save id)."""
    found = {}
    try:
        names = os.listdir(step_path)
    except OSError:
        return found
    for name in names:
        m = RANK_RE.match(name)
        if not m:
            continue
        try:
            meta = json.loads((step_path / name / "meta.json").read_text())
            found[int(m.group(1))] = (int(meta["world_size"]), meta.get("save_id"))
        except (ValueError, KeyError, TypeError, OSError):
            continue  # no or unreadable meta: not complete
    return found


def held_steps(root: Path) -> dict[int, dict[int, reshard.Writer]]:
    """``{step: held(step dir)}`` for every step under ``root`` that holds a complete rank dir."""
    out = {}
    for entry in list(root.iterdir()) if root.is_dir() else []:
        m = STEP_RE.match(entry.name)
        if m and (found := held(entry)):
            out[int(m.group(1))] = found
    return out


def save(root: Path, step: int, state: dict, meta: dict, rank: int, world_size: int, keep_last: int) -> Path:
    """Save this rank's ``state`` for ``step``; collective (every rank must call it at the same step)."""
    final = step_dir(root, step) / f"rank-{rank}"
    final.parent.mkdir(parents=True, exist_ok=True)
    ids: list[str | None] = [None] * world_size
    dist.all_gather_object(ids, uuid.uuid4().hex)  # one id for this save on every rank: its dirs belong together
    tmp = Path(tempfile.mkdtemp(prefix=f"rank-{rank}.tmp-", dir=final.parent))
    dcp.save(state, checkpoint_id=tmp, no_dist=True)
    meta = {**meta, "step": step, "rank": rank, "world_size": world_size, "save_id": ids[0], "time": time.time()}
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

    Once this rank holds ``keep_last`` checkpoints of its own, every step dir older than the oldest of them goes
    as a whole on this filesystem: besides its own part, the other ranks' dirs that were copied here for a resume
    (or left by a rank of an earlier, larger world) have no owner that would prune them.

    Other ranks on the same filesystem prune concurrently, so every listing tolerates vanished entries."""
    steps = sorted(s for s in complete_steps(root, rank) if s <= current)
    if len(steps) >= keep_last:  # keep_last >= 1 (config)
        oldest_kept = steps[-keep_last]
        for entry in list(root.iterdir()) if root.is_dir() else []:
            m = STEP_RE.match(entry.name)
            if m and int(m.group(1)) < oldest_kept:
                shutil.rmtree(entry, ignore_errors=True)
    for step in steps:
        try:
            names = os.listdir(step_dir(root, step))
        except OSError:
            continue
        for name in names:
            if name.startswith(f"rank-{rank}.tmp-"):  # left by a crash mid-save
                shutil.rmtree(step_dir(root, step) / name, ignore_errors=True)


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from: its step dir and the save in it (world size, id) that every rank can
    read what it needs of; ``world_size`` != ``new_world_size`` means resharding."""

    path: Path
    step: int
    world_size: int  # of the run that wrote it
    new_world_size: int
    replicated: bool  # every rank dir holds the whole model and optimizer state (lora)
    skipped: str = ""  # a newer step passed over because this world cannot read it, for the notice
    available: frozenset | None = None  # the old ranks' dirs of this save readable on this rank's node

    def __str__(self) -> str:
        return str(self.path)

    def sources(self, rank: int) -> tuple[int, ...]:
        return reshard.sources(self.world_size, rank, self.new_world_size, self.replicated, self.available)

    def rng_state(self, saved: dict, rank: int) -> dict:
        """``saved`` (the RNG state in this rank's primary dir) when that is its own old rank's dir: it keeps its
        stream. A rank the writing world did not have, or a lora rank reading another rank's replica (its own
        dir was lost with its host), gets a fresh stream seeded from sha256 of (the step, its rank, the primary
        dir's saved torch RNG state): deterministic, and different from every other rank's and from step 0's."""
        if self.sources(rank)[0] == rank:
            return saved
        digest = hashlib.sha256(f"mnft-rng:{self.step}:{rank}:".encode()
                                + bytes(saved["torch"].numpy().tobytes())).digest()
        before = mdist.rng_state()
        mdist.seed_all(int.from_bytes(digest[:8], "big") >> 1)
        derived = mdist.rng_state()
        mdist.set_rng_state(before)
        return derived


def _gather(obj: object) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _unreadable(step_path: Path, writer: reshard.Writer, views: list, places: list, replicated: bool) -> str:
    """Why this world cannot resume ``writer``'s save of ``step_path``: what is missing where, and what to do."""
    old, new = writer[0], len(views)
    needs = ("on each node the dir of its own old rank, or rank-0 for a rank the old world did not have"
             if replicated else f"all {old} rank dirs (rank-0 .. rank-{old - 1}) on each node")
    lacking = reshard.missing(views, writer, replicated)
    where = reshard.describe_missing(lacking, [h for _, h, _ in places], [p for _, _, p in places])
    return (f"checkpoint {step_path} was written by {old} ranks and this run has {new}: resuming it needs {needs}, "
            f"but {where}; copy them there (`train --resume` does) or resume with {old} ranks")


def agree_latest(root: Path, rank: int, world_size: int, replicated: bool = False) -> Resume | None:
    """The newest step complete for this world (collective; see the module docstring), or None.

    A newer step that another world size wrote but whose dirs are not where this world needs them is passed
    over with a note (as a same-world step complete on some ranks only always was); when nothing is complete
    and such a step exists, the resume is refused (ConfigError, exit 2) naming the missing dirs and where.
    Replicated state (lora) on the same world size: a step where a rank would read another rank's replica (its
    own dir was cut short by a crash) is passed over for the newest step where every rank reads its own dir, so
    each continues its own state and RNG stream; when no step of this world has that (a host lost for good),
    the replica serves."""
    everyone = _gather((held_steps(root), socket.gethostname(), str(root)))
    passed: list[str] = []
    newest = None  # the newest step this world can read: (step, writer, this rank's view, note)
    for step in sorted({s for steps, _, _ in everyone for s in steps}, reverse=True):
        views = [steps.get(step, {}) for steps, _, _ in everyone]
        writer = reshard.pick(views, replicated)
        if writer is None:
            other = [w for w in reshard.writers(views) if w[0] != world_size]
            if other:
                places = [(None, host, str(step_dir(Path(r), step))) for _, host, r in everyone]
                passed.append(_unreadable(step_dir(root, step), other[0], views, places, replicated))
            continue
        found = (step, writer, views[rank], f"newer {passed[0]}" if passed else "")
        lacking = sorted(reshard.missing(views, writer, replicated=False)) if replicated and writer[0] == world_size else []
        if not lacking and (newest is None or writer[0] == world_size):
            newest = found
            break
        if newest is None:  # some rank would read a replica: look on for a step where every rank reads its own dir
            newest = found
            passed.append(f"{step_dir(root, step).name} lacks the own dir of rank(s) {', '.join(map(str, lacking))} (a save "
                          "cut short), and resuming it would give that rank another rank's replica and a new RNG stream")
    if newest is not None:
        step, writer, mine, note = newest
        return Resume(step_dir(root, step), step, writer[0], world_size, replicated, note,
                      frozenset(x for x, w in mine.items() if w == writer))
    if passed:
        raise ConfigError(f"resume=latest: {passed[0]}")
    return None


def clear(root: Path, rank: int) -> None:
    """Delete every checkpoint step dir under ``root``: this rank's parts, other ranks' dirs copied here for a
    resume, temps. Called at the start of a fresh run, when no rank is saving; ranks sharing the filesystem
    delete concurrently."""
    for entry in list(root.iterdir()) if root.is_dir() else []:
        if STEP_RE.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def check_fresh(root: Path, rank: int, world_size: int, overwrite: bool) -> None:
    """A fresh run (``resume=none``) must not mix its checkpoints with an earlier run's (collective).

    Old steps would be pruned together with the new ones (an old step-200 outranks a new step-50) and a later
    ``resume=latest`` would pick them. So refuse, on every rank, when any rank's ``root`` holds a complete
    checkpoint (its own or a copy of another rank's; bad input: exit 2) -- unless ``overwrite``: then each rank
    deletes the checkpoints under its ``root`` first."""
    mine = sorted(held_steps(root))
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


def resolve(resume: str, root: Path, rank: int, world_size: int, overwrite: bool = False,
            replicated: bool = False) -> Resume | None:
    """The checkpoint to resume from for ``resume=none|latest|PATH`` (collective). ``replicated``: every rank
    dir holds the whole state (lora), so another world size reads one dir per rank instead of all of them."""
    if resume == "none":
        check_fresh(root, rank, world_size, overwrite)
        return None
    if resume == "latest":
        return agree_latest(root, rank, world_size, replicated)
    path = Path(resume).expanduser()
    everyone = _gather((held(path), socket.gethostname(), str(path)))
    views = [view for view, _, _ in everyone]
    writer = reshard.pick(views, replicated)
    if writer is not None:
        here = frozenset(x for x, w in views[rank].items() if w == writer)
        step = json.loads((path / f"rank-{reshard.sources(writer[0], rank, world_size, replicated, here)[0]}"
                           / "meta.json").read_text())["step"]
        return Resume(path, int(step), writer[0], world_size, replicated, available=here)
    other = [w for w in reshard.writers(views) if w[0] != world_size]
    if other:
        raise ConfigError(f"resume={resume}: {_unreadable(path, other[0], views, everyone, replicated)}")
    same = reshard.writers(views)
    missing = sorted(reshard.missing(views, same[0], replicated)) if same else list(range(world_size))
    raise RecipeError(f"resume={resume}: no complete checkpoint for rank(s) {missing} "
                      f"(expected {path}/rank-R/meta.json on each rank's node)")


def load(resume: Resume, state: dict, rank: int) -> dict:
    """Load this rank's part of checkpoint ``resume`` into ``state`` (in place); return its primary dir's meta.

    Same world size: this rank's own dir, as written. Another world size: the dirs ``resume.sources(rank)``
    merged into one checkpoint, resharded by DCP's load planner onto this rank's state (mnft.recipes.reshard)."""
    sources = resume.sources(rank)
    if resume.world_size == resume.new_world_size:  # its own dir, or (replicated) the one a lost rank left
        dcp.load(state, checkpoint_id=resume.path / f"rank-{sources[0]}", no_dist=True)
    else:
        dcp.load(state, storage_reader=reshard.MergedReader(resume.path, sources), no_dist=True)
    return json.loads((resume.path / f"rank-{sources[0]}" / "meta.json").read_text())


def announce(resume: Resume, meta: dict, global_batch: int, position: dict, log) -> None:
    """Rank 0 at a resume: a note on a newer step passed over, and one line plus a ``reshard`` event in
    metrics.jsonl when the world size or the global batch (micro x accum x world) differs from the checkpoint's."""
    if resume.skipped:
        print(f"mnft.recipes: note: {resume.skipped}; resuming from the older {resume.path.name}", flush=True)
    before = meta.get("global_batch")
    if resume.world_size == resume.new_world_size and before in (None, global_batch):
        return
    word = "resumed" if resume.world_size == resume.new_world_size else "resharded"
    print(f"{word}: {resume.path.name} was written by {resume.world_size} ranks, resuming on "
          f"{resume.new_world_size}: global batch {before if before is not None else '?'} -> {global_batch} rows "
          f"per step; data continues epoch {position['epoch']} at row {position['offset']}", flush=True)
    log.event("reshard", step=resume.step, from_world_size=resume.world_size, to_world_size=resume.new_world_size,
              from_global_batch=before, to_global_batch=global_batch, data=dict(position))
