"""Resuming a checkpoint on another world size: which old ``rank-R`` dirs each new rank reads (pure), and a DCP
``StorageReader`` that presents those dirs as one checkpoint so that DCP's own load planner does the resharding.

Each rank of a world of W saves ``step-N/rank-R/`` with ``no_dist=True`` (see checkpointing): its own
``.metadata`` names every tensor with its *global* shape and the chunk (offsets, sizes) that this rank holds --
for FSDP2 (``full``) its ``Shard(0)`` slice of every parameter and of the AdamW moments, for DDP (``lora``) the
whole adapters and optimizer state. The union of the W metadata files is therefore exactly the metadata a
collective save of the same state would have written. ``MergedReader`` reads those files, merges them (every
chunk once, each pointing at the ``rank-R/__0_0.distcp`` it lives in), checks that the chunks cover every tensor,
and hands the result to ``dcp.load``. DCP's ``DefaultLoadPlanner`` then computes, for this rank's DTensors on the
*new* device mesh, which saved chunks overlap them and reads just those byte ranges (``resharding.py`` in DCP):
no tensor slicing of ours. Why not load with a process group instead? A collective ``dcp.load`` reads one global
``.metadata`` from one directory, and these checkpoints have W of them, one per node that need not share a
filesystem; merging the metadata keeps the per-rank layout (and same-world resumes) exactly as they are.

Entries that every old rank saved alike (the scheduler, the step counters, a replicated tensor) or that belong to
one rank (its data position, its RNG state) are taken from the new rank's *primary* source: the old rank of the
same number while it existed, else rank 0. ``lora``'s dirs are full replicas, so a new rank reads one dir: its
own old rank's when it is there, else any other of the same save; ``full`` reads all W.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from mnft.recipes.config import RecipeError

Writer = tuple[int, "str | None"]  # a generation of rank dirs: (world size that wrote it, id of that save)


def sources(old_world: int, rank: int, world_size: int, replicated: bool, available=None) -> tuple[int, ...]:
    """The old ranks whose dirs new ``rank`` reads, its primary first (same world: only its own). Replicated
    state (lora) needs one dir only: its own when ``available`` (the old ranks readable here) has it, else the
    lowest that is -- a spare in a lost host's place finds only the other ranks' dirs."""
    own = rank < old_world and (available is None or rank in available)
    if old_world == world_size and (own or not replicated):
        return (rank,)
    if replicated:
        return (rank if own else (min(available) if available else 0),)
    primary = rank if rank < old_world else 0
    return (primary, *(r for r in range(old_world) if r != primary))


def missing(views: Sequence[dict[int, Writer]], writer: Writer, replicated: bool) -> dict[int, list[int]]:
    """New rank -> the old rank dirs of ``writer``'s generation it needs but cannot read. ``views[r]``: the dirs
    new rank r can read, old rank -> the generation that wrote it."""
    out = {}
    for rank, view in enumerate(views):
        here = {x for x, w in view.items() if w == writer}
        lacking = [x for x in sources(writer[0], rank, len(views), replicated, here) if view.get(x) != writer]
        if lacking:
            out[rank] = lacking
    return out


def writers(views: Sequence[dict[int, Writer]]) -> list[Writer]:
    """The saves present in ``views``: those of this world size first (no resharding), then the others, the most
    widely held first."""
    world_size = len(views)
    seen: dict[Writer, int] = {}
    for view in views:
        for old_rank, writer in view.items():
            if old_rank < writer[0]:
                seen[writer] = seen.get(writer, 0) + 1
    return sorted(seen, key=lambda w: (w[0] != world_size, -seen[w], w[0], str(w[1])))


def pick(views: Sequence[dict[int, Writer]], replicated: bool) -> Writer | None:
    """The generation every new rank can resume from (its needed dirs all readable), or None."""
    return next((w for w in writers(views) if not missing(views, w, replicated)), None)


def describe_missing(lacking: dict[int, list[int]], hosts: Sequence[str], paths: Sequence[str]) -> str:
    """``host:path lacks rank-1, rank-2 (new rank 0)``, one clause per place that lacks something."""
    places: dict[tuple[str, str], tuple[set[int], list[int]]] = {}
    for rank, old in sorted(lacking.items()):
        wanted, ranks = places.setdefault((hosts[rank], paths[rank]), (set(), []))
        wanted.update(old)
        ranks.append(rank)
    clauses = [f"{host}:{path} lacks {', '.join(f'rank-{x}' for x in sorted(wanted))} "
               f"(new rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
               for (host, path), (wanted, ranks) in places.items()]
    return "; ".join(clauses[:4]) + (f"; and {len(clauses) - 4} more" if len(clauses) > 4 else "")


class MergedReader(FileSystemReader):
    """``dcp.load`` storage reader over ``step-N/rank-R`` dirs of one save, as if it were one checkpoint.

    ``ranks`` are read in order: an entry that several dirs hold (same key, same chunk offsets) comes from the
    first that has it, so put the primary first. The metadata is merged and checked here, when the reader is
    made: DCP turns any exception of ``read_metadata`` into an AssertionError of its own."""

    def __init__(self, step_path: Path, ranks: Sequence[int]):
        super().__init__(step_path)
        self.step_path, self.ranks = Path(step_path), list(ranks)
        self.metadata = self._merge()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return dataclasses.replace(self.metadata, storage_meta=StorageMeta(load_id=self.load_id))

    def _merge(self) -> Metadata:
        merged: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, object] = {}
        planner_data: dict = {}
        version = None
        for rank in self.ranks:
            with open(self.step_path / f"rank-{rank}" / ".metadata", "rb") as f:
                meta: Metadata = pickle.load(f)
            version = version or meta.version
            planner_data.update(meta.planner_data or {})
            located = {key: dataclasses.replace(info, relative_path=f"rank-{rank}/{info.relative_path}")
                       for key, info in meta.storage_data.items()}
            for fqn, item in meta.state_dict_metadata.items():
                if isinstance(item, BytesStorageMetadata):
                    if fqn not in merged:
                        merged[fqn] = item
                        storage[MetadataIndex(fqn)] = located[MetadataIndex(fqn)]
                    continue
                have = merged.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
                if have.size != item.size:
                    raise RecipeError(f"checkpoint {self.step_path}: {fqn} has shape {list(item.size)} in rank-{rank} "
                                      f"but {list(have.size)} in another rank dir (dirs of different runs?)")
                offsets = {tuple(c.offsets) for c in have.chunks}
                for chunk in item.chunks:
                    if math.prod(chunk.sizes) == 0 and math.prod(item.size) != 0:
                        continue  # an empty shard (uneven split): nothing to read
                    if tuple(chunk.offsets) in offsets:
                        continue  # replicated on several old ranks: the first (primary) copy is read
                    have.chunks.append(chunk)
                    offsets.add(tuple(chunk.offsets))
                    key = MetadataIndex(fqn, chunk.offsets)
                    storage[key] = located[key]
        for fqn, item in merged.items():
            if isinstance(item, TensorStorageMetadata):
                covered, total = sum(math.prod(c.sizes) for c in item.chunks), math.prod(item.size)
                if covered != total:
                    dirs = ", ".join(f"rank-{r}" for r in self.ranks)
                    raise RecipeError(f"checkpoint {self.step_path}: the dirs {dirs} hold {covered} of the {total} "
                                      f"elements of {fqn} (a rank dir is missing or from another run)")
        return Metadata(merged, planner_data=planner_data, storage_data=storage, version=version)
