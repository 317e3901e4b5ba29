"""The latest complete checkpoint of a job, made whole on every host before a resume.

Without a shared filesystem a checkpoint ends up spread over the hosts: HF Trainer on 2 hosts writes model,
optimizer and trainer_state.json on rank 0's host, and only rng_state_1.pth on the other. A resume there finds
no model. So before a resume mnft reads every host's checkpoints directory (read), picks the newest checkpoint
that is complete in the union of the hosts' files by the job's layout (pure), copies each missing file from a
host that has it to the hosts that lack it (rsync through this machine, host keys verified as for sync) and
proves with each host's tree hash that every host now holds the same files (apply, verify). Files of the same
name that differ between hosts are refused: mnft would not know which is right.

Hosts that see one checkpoints directory (a shared home, an NFS mount: found by sync's marks, never assumed) are
one copy: the checkpoint is hashed and verified once per directory, copied only to directories that lack it, never
from a directory onto itself; when every host sees one directory nothing is hashed or copied. The hosts of a
shared directory must list the same files of the checkpoint: those that differ are listed again for SHARED_WAIT
seconds (an NFS client serves a directory from its attribute cache for a while), then the resume is refused
naming them. Detection decides: a host whose mark could not be left is read as a directory of its own and said
so, and hosts the inventory declares shared_fs whose directories were found apart get a warning, never a refusal
(shared_fs asserts that the workdir and data_dir are shared: docs/inventory.md).

Layouts (the job's resume.layout): hf `checkpoint-N` holding trainer_state.json (written last); torchtune
`epoch_N` (else `step_N`) holding recipe_state.pt (main), or, as the released 0.6.1 writes it, `epoch_N/` with
`recipe_state/recipe_state.pt` beside it, written after the epoch's files; sana the target of `latest.pth` (replaced only after a save
completed); glob a pattern and a marker file; mnft (the recipes) `step-N/rank-R/` each complete when its
meta.json exists (written last), the newest step every rank of the world that wrote it completed; for lora
(DDP: every rank holds the same adapters and optimizer state) a step some ranks completed when no step has them
all. A host lost for good takes its own files with it, so only what the others hold can be made whole.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rich.console import Console
from rich.text import Text

from mnft.core.errors import ExitCode, MnftError
from mnft.core.output import command
from mnft.hosts import pyrun
from mnft.hosts.fleet import Fleet, Status
from mnft.hosts.settings import Host
from mnft.run.job import ResumeRule
from mnft.sync.mirror import detect_sharing, hash_command, hash_stdin
from mnft.sync.rsync import RSYNC_IO_TIMEOUT, SshSettings, classify, remote_spec, run_rsync, ssh_command

LAYOUT_RULES = {
    "hf": (re.compile(r"^checkpoint-(\d+)$"), "trainer_state.json"),
    "torchtune": (re.compile(r"^(?:epoch|step)_(\d+)$"), "recipe_state.pt"),
}
SANA_LINK = "latest.pth"
TORCHTUNE_STATE_DIR, TORCHTUNE_STATE = "recipe_state", "recipe_state.pt"  # torchtune 0.6.1: beside the epochs
MNFT_STEP = re.compile(r"^step-(\d+)$")
# which ranks' parts of a step an mnft recipe needs to resume (mnft/recipes/checkpointing.py says the same)
RECIPE_NEEDS = {"lora": "any", "full": "all"}
# seconds the hosts of a shared directory may list it differently (an NFS client's attribute cache), as provision waits
SHARED_WAIT, RELIST_EVERY = 10.0, 1.0


class CheckpointError(MnftError):
    exit_code = ExitCode.FAILED


@dataclass
class Choice:
    """The checkpoint to resume from (None: none complete) and, per host, the files it holds of it."""

    name: str | None
    paths: tuple[str, ...] = ()  # top-level entries of the checkpoints directory that make up the checkpoint
    union: dict[str, int] = field(default_factory=dict)  # file (relative to the checkpoints dir) -> size
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # host -> its files of the checkpoint
    considered: list[str] = field(default_factory=list)  # incomplete newer candidates, for the message
    exclude: tuple[str, ...] = ()  # rsync patterns of files inside the checkpoint that are not part of it


@dataclass
class Found:
    name: str | None
    copied: dict[str, int] = field(default_factory=dict)  # host -> files copied to it
    bytes_copied: int = 0
    note: str = ""
    shared: list[list[str]] = field(default_factory=list)  # the hosts of each checkpoints directory seen by more than one
    warnings: list[str] = field(default_factory=list)  # marks that could not be left; declared shared_fs found apart

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "copied": self.copied, "bytes_copied": self.bytes_copied, "note": self.note, "shared": self.shared,
                "warnings": self.warnings}


# ------------------------------------------------------------------------------------------------ choose (pure)


def _files(entry_name: str, entry: dict) -> dict[str, int]:
    """An entry's files relative to the checkpoints directory (a path leaving it is refused: it would be copied
    to, and from, outside the checkpoints directory of another host)."""
    out = {}
    for rel, size in (entry.get("files") or {}).items():
        path = entry_name if rel == "" else f"{entry_name}/{rel}"
        if path.startswith("/") or ".." in path.split("/") or "\0" in path or "\n" in path:
            raise CheckpointError(f"a host listed the checkpoint file {path!r}, which is not a plain path inside the checkpoints directory")
        out[path] = size
    return out


def _number(name: str) -> tuple[int, str]:
    found = re.findall(r"\d+", name)
    return (int(found[-1]) if found else -1, name)


def candidates(rule: ResumeRule, names: set[str]) -> list[str]:
    """The entry names the layout counts as checkpoints, newest first."""
    if rule.layout in LAYOUT_RULES:
        pattern = LAYOUT_RULES[rule.layout][0]
        found = [n for n in names if pattern.match(n)]
        if rule.layout == "torchtune":  # the newest epoch_N, else the newest step_N (research: torchtune's rule)
            epochs = sorted((n for n in found if n.startswith("epoch_")), key=_number, reverse=True)
            steps = sorted((n for n in found if n.startswith("step_")), key=_number, reverse=True)
            return epochs + steps
        return sorted(found, key=_number, reverse=True)
    if rule.layout == "glob":
        return sorted((n for n in names if fnmatch.fnmatchcase(n, rule.pattern or "")), key=_number, reverse=True)
    return []


SANA_SAVE = re.compile(r"^epoch_\d+_step_\d+(?:\.pth)?$")  # what Sana's save writes beside latest.pth


def saved(rule: ResumeRule, names: set[str] | frozenset[str]) -> list[str]:
    """The entries of a checkpoints directory the job's layout names as checkpoints (what its saves wrote, complete
    or cut short: a save's time was spent either way), newest first; none for the layout none. Pure: names in
    (the top-level entries, as the agent's pack lists them)."""
    if rule.layout in LAYOUT_RULES or rule.layout == "glob":
        return candidates(rule, set(names))
    if rule.layout == "mnft":
        return sorted((n for n in names if MNFT_STEP.match(n)), key=_number, reverse=True)
    if rule.layout == "sana":
        return sorted((n for n in names if SANA_SAVE.match(n)), key=_number, reverse=True)
    return []


def step_of(name: str | None) -> int | None:
    """The training step a checkpoint's name gives (checkpoint-40, step_40, step-40, epoch_1_step_500.pth), if any:
    torchtune's epoch_N names an epoch, not a step (None: the resumed attempt's first step record tells)."""
    if not name or re.fullmatch(r"epoch_\d+", os.path.basename(name.rstrip("/"))):
        return None
    found = re.findall(r"\d+", os.path.basename(name.rstrip("/")))
    return int(found[-1]) if found else None


def choose(rule: ResumeRule, listings: dict[str, dict], needs: str = "all") -> Choice:
    """The newest checkpoint complete in the union of every host's files. Pure: listings (the agent's
    `checkpoints` answer per host) in, the choice out. needs: for the mnft layout, "any" or "all" ranks."""
    entries = {host: (listing.get("entries") or {}) for host, listing in listings.items()}
    if rule.layout == "sana":
        return _choose_sana(entries)
    if rule.layout == "mnft":
        return _choose_mnft(entries, needs)
    marker = LAYOUT_RULES[rule.layout][1] if rule.layout in LAYOUT_RULES else rule.marker
    names = {name for e in entries.values() for name, v in e.items() if v.get("dir")}
    if rule.layout == "torchtune" and not any(f"{n}/{marker}" in _files(n, e[n]) for e in entries.values() for n in candidates(rule, names) if n in e):
        return _choose_torchtune_released(entries, names)
    considered = []
    for name in candidates(rule, names):
        held = {host: _files(name, e[name]) for host, e in entries.items() if name in e}
        union: dict[str, int] = {}
        for files in held.values():
            union.update(files)
        if f"{name}/{marker}" in union:
            return Choice(name, (name,), union, {h: held.get(h, {}) for h in listings}, considered)
        considered.append(name)
    return Choice(None, considered=considered)


def _choose_torchtune_released(entries: dict[str, dict], names: set[str]) -> Choice:
    """torchtune 0.6.1 (released): each save writes epoch_N/ (the model or adapter files), then, for every epoch
    but the last, recipe_state/recipe_state.pt at the top of the output directory (one file, overwritten: the
    state of the newest epoch saved before it). The checkpoint to resume is the newest epoch_N whose files are
    not newer than that recipe state on the host that wrote both (rank 0's); the run's last epoch has none and
    is not resumable, nor is an epoch whose save was cut short. Both entries are the checkpoint (copied together)."""
    state_at = {host: e[TORCHTUNE_STATE_DIR].get("newest") for host, e in entries.items()
                if f"{TORCHTUNE_STATE_DIR}/{TORCHTUNE_STATE}" in _files(TORCHTUNE_STATE_DIR, e.get(TORCHTUNE_STATE_DIR) or {})}
    epochs = sorted((n for n in names if re.fullmatch(r"epoch_\d+", n)), key=_number, reverse=True)
    considered = []
    for name in epochs:
        done = any(isinstance(t, (int, float)) and isinstance((entries[h].get(name) or {}).get("newest"), (int, float))
                   and entries[h][name]["newest"] <= t for h, t in state_at.items())
        if done:
            paths = (name, TORCHTUNE_STATE_DIR)
            held = {host: {**(_files(name, e[name]) if name in e else {}),
                           **(_files(TORCHTUNE_STATE_DIR, e[TORCHTUNE_STATE_DIR]) if TORCHTUNE_STATE_DIR in e else {})} for host, e in entries.items()}
            union: dict[str, int] = {}
            for files in held.values():
                union.update(files)
            return Choice(name, paths, union, held, considered)
        considered.append(name)
    return Choice(None, considered=considered)


def _choose_mnft(entries: dict[str, dict], needs: str) -> Choice:
    """The recipes' step-N/rank-R/: the newest step that every rank of the world that wrote it completed (its
    meta.json) in the union of the hosts' files, so that each rank continues its own state and RNG stream.

    lora (needs "any": every rank holds the same adapters and optimizer state) also resumes from a step that only
    some ranks completed, when no step of the newest step's world has them all: a host lost for good took its
    parts of every step with it. A step whose save a crash cut short on a host that is still there is passed
    over for the one before it: resuming it would give that rank another rank's replica and a new RNG stream,
    and the run would no longer be the one it would have been without the crash."""
    names = sorted({name for e in entries.values() for name, v in e.items() if v.get("dir") and MNFT_STEP.match(name)},
                   key=_number, reverse=True)
    steps: list[tuple[str, dict[int, int]]] = []  # newest first: the steps some rank completed, rank -> world size
    for name in names:
        metas: dict[int, int] = {}
        for e in entries.values():
            for rel, meta in ((e.get(name) or {}).get("meta") or {}).items():
                match = re.fullmatch(r"rank-(\d+)/meta\.json", rel)
                if match and isinstance(meta.get("world_size"), int):
                    metas[int(match.group(1))] = meta["world_size"]
        if metas:
            steps.append((name, metas))

    def whole(metas: dict[int, int]) -> bool:
        return set(range(max(metas.values()))) <= set(metas)

    if needs == "any" and steps:  # the newest step's world with every rank, else that step from replicas
        world = max(steps[0][1].values())
        chosen = next(((n, m) for n, m in steps if max(m.values()) == world and whole(m)), steps[0])
    else:
        chosen = next(((n, m) for n, m in steps if whole(m)), None)
    considered = [n for n in names if chosen is None or _number(n) > _number(chosen[0])]
    if chosen is None:
        return Choice(None, considered=considered)
    name, metas = chosen
    held = {host: _files(name, e[name]) for host, e in entries.items() if name in e}
    union: dict[str, int] = {}
    for files in held.values():
        union.update({p: size for p, size in files.items() if _complete_rank(p, metas)})
    return Choice(name, (name,), union, {h: {p: v for p, v in held.get(h, {}).items() if p in union} for h in entries}, considered,
                  exclude=("rank-*.tmp-*",))


def _complete_rank(path: str, metas: dict[int, int]) -> bool:
    """A file of a rank part that is complete (a crashed save's rank-R.tmp-* is not copied)."""
    match = re.match(r"^step-\d+/rank-(\d+)/", path)
    return bool(match) and int(match.group(1)) in metas


def _choose_sana(entries: dict[str, dict]) -> Choice:
    """Sana: latest.pth is a link to the newest complete checkpoint (a .pth file under DDP, a directory under
    FSDP); the link is replaced only after the save returned."""
    for host, e in entries.items():
        link = (e.get(SANA_LINK) or {}).get("link")
        if not link:
            continue
        name = os.path.basename(link.rstrip("/"))
        if name not in e:
            continue
        held = {h: {**_files(name, x[name]), **({SANA_LINK: 0} if SANA_LINK in x else {})} for h, x in entries.items() if name in x}
        union: dict[str, int] = {SANA_LINK: 0}
        for files in held.values():
            union.update(files)
        return Choice(name, (name, SANA_LINK), union, {h: held.get(h, {}) for h in entries}, [])
    return Choice(None)


def directories(order: Sequence[str], groups: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """The checkpoints directories the hosts see: each group of hosts that see one (sync's shared groups) under
    its first host, every other host alone; in inventory order."""
    out: dict[str, tuple[str, ...]] = {}
    for name in order:
        members = tuple(n for n in order if n in groups.get(name, ())) or (name,)
        out.setdefault(members[0], members)
    return out


def declared_apart(hosts: Sequence[Host], groups: Mapping[str, Sequence[str]],
                   unmarked: Mapping[str, str] | None = None) -> tuple[str | None, list[str]]:
    """Hosts the inventory declares shared_fs whose checkpoints directory is not the one most declared hosts see,
    and the first host of that directory (ties: inventory order). A host whose mark could not be left is neither
    blamed nor taken as the reference: its own failure is said instead."""
    declared = [h.name for h in hosts if h.shared_fs and h.name not in (unmarked or {})]
    if len(declared) < 2:  # one declared host asserts nothing
        return None, []

    def seen_with(name: str) -> set[str]:
        return set(groups.get(name, ())) | {name}

    reference = max(declared, key=lambda name: (len(seen_with(name) & set(declared)), -declared.index(name)))
    return reference, [name for name in declared if name not in seen_with(reference)]


def unseen(choice: Choice, dirs: Mapping[str, Sequence[str]]) -> list[str]:
    """Hosts of a shared directory that list other files of the checkpoint than its first host: they do not
    see that directory as it is (a stale or missing mount), so it cannot be read as one copy."""
    out = []
    for first, members in dirs.items():
        mine = set(choice.held.get(first, {}))
        for name in members[1:]:
            theirs = set(choice.held.get(name, {}))
            if theirs != mine:
                lacks, extra = sorted(mine - theirs), sorted(theirs - mine)
                out.append(f"{name} shares {first}'s directory but " + " and ".join(
                    f"{what} {len(paths)} file(s), e.g. {paths[0]}" for what, paths in (("lacks", lacks), ("holds another", extra)) if paths))
    return out


def lagging(choice: Choice, dirs: Mapping[str, Sequence[str]]) -> list[str]:
    """The hosts of shared directories that lack a file of the checkpoint another host of their directory lists:
    their listing may be an NFS client's cached one, older than the newest save."""
    out = []
    for members in (m for m in dirs.values() if len(m) > 1):
        listed = set().union(*(choice.held.get(name, {}) for name in members))
        out += [name for name in members if set(choice.held.get(name, {})) != listed]
    return out


def settle(rule: ResumeRule, listings: Mapping[str, dict], dirs: Mapping[str, Sequence[str]], relist: Callable[[list[str]], dict[str, dict]],
           needs: str = "all", *, wait: float = SHARED_WAIT, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> tuple[Choice, dict[str, dict]]:
    """The choice, once the hosts of each shared directory list the same files of it: the lagging hosts are
    listed again (relist: names -> their listings), every RELIST_EVERY seconds for `wait` seconds at most, and
    the checkpoint chosen again from what they list then. Returns the choice and the listings it was made from."""
    listings = dict(listings)
    choice = choose(rule, listings, needs)
    deadline = clock() + wait
    while choice.name is not None and (behind := lagging(choice, dirs)) and clock() < deadline:
        sleep(RELIST_EVERY)
        listings.update(relist(behind))
        choice = choose(rule, listings, needs)
    return choice, listings


def transfers(choice: Choice, groups: Mapping[str, Sequence[str]] | None = None) -> dict[str, dict[str, str]]:
    """For each directory that lacks files of the checkpoint (a host's, or the one the hosts of a group see,
    under its first host): file -> the host to copy it from (the first that has it, in inventory order, never
    a host of the same directory: a directory is not copied onto itself)."""
    dirs = directories(list(choice.held), groups or {})
    directory_of = {name: first for first, members in dirs.items() for name in members}
    plan: dict[str, dict[str, str]] = {}
    for first in dirs:
        files = choice.held[first]
        for path in sorted(choice.union):
            if path not in files:
                source = next((h for h, f in choice.held.items() if path in f and directory_of[h] != first), None)
                if source is not None:  # (else only a host of this directory lists it: unseen() refuses that)
                    plan.setdefault(first, {})[path] = source
    return plan


def conflicts(trees: dict[str, dict[str, tuple[int, str]]]) -> list[str]:
    """Files of the same name whose content differs between hosts (by the tree hash)."""
    seen: dict[str, tuple[str, tuple[int, str]]] = {}
    out = []
    for host, files in trees.items():
        for path, value in files.items():
            if path in seen and tuple(seen[path][1]) != tuple(value):
                out.append(f"{path} differs between {seen[path][0]} and {host}")
            else:
                seen.setdefault(path, (host, value))
    return out


# ------------------------------------------------------------------------------------------------ read, apply


def _agent_json(fleet: Fleet, hosts: list[Host], args_of) -> dict[str, dict]:
    results = fleet.run(lambda h: pyrun.command(h, *args_of(h), site=False), stdin=pyrun.payload("agent"), hosts=hosts)
    return _parsed(results)


def _parsed(results) -> dict[str, dict]:
    out, bad = {}, []
    for r in results:
        if r.ok:
            try:
                out[r.host] = pyrun.last_json(r.stdout)
                continue
            except (ValueError, IndexError):
                r.error = "no answer"
        bad.append(f"{r.host}: {r.status.value}: {r.error}")
    if bad:
        raise CheckpointError("cannot read the checkpoints on every host (" + "; ".join(bad) + "): a resume needs every host's files")
    return out


def hash_rules(paths: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[str]:
    """Tree hash rules that read the checkpoint's entries of the checkpoints directory and nothing else (the
    treehash's syntax: a bare pattern excludes, `+ PATTERN` includes, the first match decides)."""
    return list(exclude) + [r for p in paths for r in (f"+ /{p}", f"+ /{p}/**")] + ["*"]


def _hash_trees(fleet: Fleet, hosts: list[Host], dirs: dict[str, str], paths: tuple[str, ...],
                exclude: tuple[str, ...] = ()) -> dict[str, dict[str, tuple[int, str]]]:
    """Each host's files of the checkpoint with sizes and sha256 (sync's tree hash, limited to the checkpoint)."""
    stdin = hash_stdin(hash_rules(paths, exclude))
    results = fleet.run(lambda h: hash_command(h, dirs[h.name], if_exists=True), stdin=stdin, hosts=hosts)
    trees = {}
    for host, data in _parsed(results).items():
        if data.get("errors"):
            raise CheckpointError(f"{host}: cannot read the checkpoint: " + "; ".join(f"{k}: {v}" for k, v in data["errors"].items()))
        trees[host] = {rel: tuple(v) for rel, v in (data.get("files") or {}).items()}
    return trees


def _difference(host: str, files: dict[str, tuple[int, str]], union: dict[str, tuple[int, str]]) -> str:
    """How a host's files of the checkpoint differ from what every host should hold, naming the first file."""
    lacks = sorted(p for p in union if p not in files)
    extra = sorted(p for p in files if p not in union)
    other = sorted(p for p in union if p in files and tuple(files[p]) != tuple(union[p]))
    parts = [f"{kind} {len(paths)} file(s), e.g. {paths[0]}" for kind, paths in
             (("lacks", lacks), ("holds another", extra), ("holds other content in", other)) if paths]
    return f"{host} " + " and ".join(parts)


def _rsync(argv: list[str]) -> None:
    outcome = run_rsync(argv)
    status, error = classify(outcome.exit_code, outcome.stderr)
    if status is not Status.OK:
        raise CheckpointError(f"copying the checkpoint failed: {error}")


def _copy(fleet: Fleet, dirs: dict[str, str], plan: dict[str, dict[str, str]]) -> int:
    """Pull each needed file from its source host into a local staging tree, push to the hosts that lack it."""
    ssh = SshSettings.for_inventory(fleet.inventory)
    total = 0
    with tempfile.TemporaryDirectory(prefix="mnft-ckpt-") as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        pulls: dict[str, set[str]] = {}
        for files in plan.values():
            for path, source in files.items():
                pulls.setdefault(source, set()).add(path)
        for source, paths in pulls.items():
            host = fleet.inventory.host(source)
            listing = Path(tmp) / f"pull-{source}"
            listing.write_bytes(b"".join(p.encode() + b"\0" for p in sorted(paths)))
            _rsync(_rsync_base(host, ssh, listing) + [remote_spec(host, dirs[source]), str(stage) + "/"])
        for target, files in plan.items():
            host = fleet.inventory.host(target)
            listing = Path(tmp) / f"push-{target}"
            listing.write_bytes(b"".join(p.encode() + b"\0" for p in sorted(files)))
            _rsync(_rsync_base(host, ssh, listing) + ["--mkpath", str(stage) + "/", remote_spec(host, dirs[target])])
            total += sum((stage / p).lstat().st_size for p in files)
    return total


def _rsync_base(host: Host, ssh, listing: Path) -> list[str]:
    argv = ["rsync", "-a", "-s", "--from0", f"--files-from={listing}", f"--timeout={RSYNC_IO_TIMEOUT}"]
    if not host.is_local:
        argv += ["-e", ssh_command(host, ssh)]
    return argv


def prepare(fleet: Fleet, rule: ResumeRule, dirs: dict[str, str], console: Console, needs: str = "all", *,
            sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> Found:
    """Find the job's latest complete checkpoint and make it the same in every checkpoints directory, reading and
    verifying a directory that several hosts see once. sleep, clock: for the re-listing of a shared directory."""
    hosts = [fleet.inventory.host(name) for name in dirs]
    groups, unmarked = detect_sharing(fleet, hosts, dirs) if len(hosts) > 1 else ({}, {})
    warnings = [f"{name}: no mark could be left for the checkpoints directory {dirs[name]} ({why}): "
                + (f"read with {', '.join(n for n in groups[name] if n != name)}, whose marks it sees" if name in groups else "read as a directory of its own")
                for name, why in unmarked.items()]
    reference, apart = declared_apart(hosts, groups, unmarked)
    if apart:
        warnings.append(f"{', '.join(apart)} declared shared_fs, but the checkpoints directory {dirs[apart[0]]} there is not the one {reference} "
                        f"sees: resumed as found, {'a directory' if len(apart) == 1 else 'directories'} of {'its' if len(apart) == 1 else 'their'} "
                        f"own (a mount missing there? `{command('check')}` verifies shared_fs)")
    for warning in warnings:
        console.print(Text(f"warning: {warning}", style="yellow"))
    places = directories([h.name for h in hosts], groups)
    shared = [list(members) for members in places.values() if len(members) > 1]

    def relist(names: list[str]) -> dict[str, dict]:
        return _agent_json(fleet, [fleet.inventory.host(n) for n in names], lambda h: ("checkpoints", dirs[h.name]))

    choice, _ = settle(rule, relist([h.name for h in hosts]), places, relist, needs, sleep=sleep, clock=clock)
    if choice.name is None:
        note = (f"no complete checkpoint ({rule.layout}) in {', '.join(sorted(set(dirs.values())))}"
                + (f" (incomplete: {', '.join(choice.considered[:5])})" if choice.considered else "") + ": the run starts fresh")
        console.print(Text(f"{note}", style="yellow"))
        return Found(None, note=note, shared=shared, warnings=warnings)
    mismatch = unseen(choice, places)
    if mismatch:
        raise CheckpointError(f"checkpoint {choice.name} cannot be read as one copy: {'; '.join(mismatch[:3])} (listed again for "
                              f"{SHARED_WAIT:g} s): is the shared filesystem mounted on every host?")
    sharing = "; ".join(f"{', '.join(members)} share one directory" for members in shared)
    if len(places) == 1:  # one directory: nothing to compare, nothing to copy
        note = f"one directory for {', '.join(places[hosts[0].name])}: read once, nothing copied" if len(hosts) > 1 else "one host"
        console.print(f"resuming from {choice.name} ({note})", highlight=False)
        return Found(choice.name, note=note, shared=shared, warnings=warnings)
    firsts = [fleet.inventory.host(name) for name in places]
    trees = _hash_trees(fleet, firsts, dirs, choice.paths, choice.exclude)
    clash = conflicts(trees)
    if clash:
        raise CheckpointError(f"checkpoint {choice.name} cannot be made whole: " + "; ".join(clash[:3]) + " (remove the wrong copy by hand)")
    plan = transfers(choice, groups)
    copied = {host: len(files) for host, files in plan.items()}
    total = _copy(fleet, dirs, plan) if plan else 0
    after = _hash_trees(fleet, firsts, dirs, choice.paths, choice.exclude)
    union = {}
    for files in trees.values():
        union.update(files)
    differ = [_difference(h, files, union) for h, files in after.items() if dict(files) != union]
    if differ:
        raise CheckpointError(f"checkpoint {choice.name} differs between hosts after copying ({', '.join(differ)})")
    shown = ", ".join(f"{n} file(s) to {h}" + (f" (for {', '.join(places[h])})" if len(places[h]) > 1 else "") for h, n in copied.items()) \
        or "every directory held all of it"
    verified = f"verified in {len(places)} directories ({sharing})" if sharing else f"verified on {len(hosts)} hosts"
    console.print(f"resuming from {choice.name}: {shown}; {verified}", highlight=False)
    return Found(choice.name, copied, total, note=f"{shown}; {verified}", shared=shared, warnings=warnings)
