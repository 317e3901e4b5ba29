"""What uninstall removes where (pure: what each host and this machine hold in, the items to remove or keep out).

OWNED is what mnft puts on a host, one line each, in the order removal goes (what is inside first); the host
script (mnft.onhost.uninstallhost.locations) finds each of them by the same key. What a run or a person wrote is
never mnft's to remove: a job's directory and a run's logs only with --include-outputs, a file in a synced tree
only when it is still exactly as sync placed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Owned:
    key: str
    what: str
    output: bool = False  # what runs wrote: removed only with --include-outputs
    if_empty: bool = False  # a directory that goes only once nothing is left in it


OWNED = (
    Owned("env", "the environment's link (provision)"),
    Owned("env_store", "the environments, wheels, uv and uv's cache (provision)"),
    Owned("snapshots", "code snapshots, <workdir>/.mnft/code (train)"),
    Owned("checkout", "the files sync placed in the workdir, still as placed"),
    Owned("data", "the files sync --data placed in the data_dir, still as placed"),
    Owned("outputs", "the jobs' directories: their code and all they wrote", output=True),
    Owned("runs", "the runs' logs and agent files", output=True),
    Owned("supervised", "detached runs' supervisor directories: their records, consoles and code copies (~/.mnft/supervised)", output=True),
    Owned("supervisor", "the bundle of mnft detached runs' supervisors run (~/.mnft/supervisor)"),
    Owned("cache", "mnft's caches (tree hashes, GPUs, .sif identities)"),
    Owned("marks", "shared-directory marks (.mnft-share)"),
    Owned("mnft_dir", "<workdir>/.mnft", if_empty=True),
    Owned("workdir", "the workdir", if_empty=True),
    Owned("data_dir", "the data_dir", if_empty=True),
)

# on this machine: the wheels provision fetched, the code snapshots train fixed, the tree-hash caches, and the
# record of the environments provisioned on these hosts
CONTROLLER = (
    Owned("wheelhouse", "the wheels provision fetched ($MNFT_HOME/wheelhouse)"),
    Owned("code_store", "the code snapshots train fixed ($MNFT_HOME/code; one a run holds stays)"),
    Owned("hash_cache", "tree-hash caches ($MNFT_HOME/cache)"),
    Owned("supervisor_bundles", "the supervisor bundles built here for detached runs ($MNFT_HOME/supervisor)"),
    Owned("provision_record", "these hosts' entries in the provision record"),
)

OUTPUTS_KEPT = "what runs wrote: kept (--include-outputs removes it)"
SHARED_HERE = ("wheelhouse", "code_store")  # this machine's stores every provisioned host's next provision or run uses


def still_used(items: list["Item"], others: list[str]) -> list["Item"]:
    """This machine's stores kept while hosts this uninstall leaves on (`others`: their provision records) still
    use them: the wheels their next provision relays, the snapshots their runs start from."""
    if not others:
        return items
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    for item in items:
        if item.key in SHARED_HERE and item.action != "keep":
            item.action, item.why = "keep", (f"still used by {len(others)} other provisioned host(s) ({shown}): removed with the last "
                                             "of them (an inventory naming them all)")
    return items


@dataclass
class Item:
    key: str
    what: str
    path: str | None
    bytes: int = 0
    files: int = 0
    action: str = "remove"  # remove | remove if empty | keep
    why: str = ""
    outcome: str = ""  # after apply: removed | kept | failed | left (not empty)

    def to_json(self) -> dict:
        return {"key": self.key, "what": self.what, "path": self.path, "bytes": self.bytes, "files": self.files,
                "action": self.action, "why": self.why or None, "outcome": self.outcome or None}


def plan_items(found: Mapping[str, dict], owned: tuple[Owned, ...] = OWNED, include_outputs: bool = False) -> list[Item]:
    """The items of one place (a host, or this machine): each one found there, to remove or to keep and why. A
    place's facts per key: {"path", "kind" (missing: not there), "bytes", "files", "ours", "why", "kept_count"}."""
    items = []
    for entry in owned:
        fact = found.get(entry.key)
        if not fact or fact.get("kind") == "missing":
            continue
        item = Item(entry.key, entry.what, fact.get("path"), int(fact.get("bytes") or 0), int(fact.get("files") or 0))
        if not fact.get("ours"):
            item.action, item.why = "keep", f"not mnft's: {fact.get('why') or 'unknown'}"
        elif entry.output and not include_outputs:
            item.action, item.why = "keep", OUTPUTS_KEPT
        elif entry.if_empty:
            item.action = "remove if empty"
        else:
            kept = int(fact.get("kept_count") or 0)
            if kept:
                item.why = f"{kept} file(s) changed since mnft placed them: kept"
        items.append(item)
    return items


def to_remove(items: list[Item]) -> list[str]:
    return [i.key for i in items if i.action != "keep"]


def freed(items: list[Item]) -> int:
    return sum(i.bytes for i in items if i.action == "remove")


def settle(items: list[Item], reply: Mapping[str, object] | None) -> list[Item]:
    """Each item's outcome from the host's answer to remove ({"removed", "errors", "skipped"}); None: not applied."""
    if reply is None:
        return items
    removed, errors, skipped = set(reply.get("removed") or ()), dict(reply.get("errors") or {}), dict(reply.get("skipped") or {})
    for item in items:
        if item.action == "keep":
            item.outcome = "kept"
        elif item.key in errors:
            item.outcome, item.why = "failed", str(errors[item.key])
        elif item.key in skipped:
            item.outcome, item.why = "kept", f"not mnft's now: {skipped[item.key]}"
        elif item.key in removed:
            item.outcome = "removed"
        else:
            item.outcome = "left" if item.action == "remove if empty" else "removed"  # not empty / gone meanwhile
            if item.outcome == "left":
                item.why = "not empty: what is left there is not mnft's"
    return items
