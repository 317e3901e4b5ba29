"""Resuming on another world size, the pure part: which old rank dirs each new rank reads, when a save counts as
complete, how what is missing is described; and the merged DCP reader (real DCP files, per-rank metadata)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from mnft.recipes import reshard
from mnft.recipes.config import RecipeError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_the_same_world_size_reads_only_its_own_dir():
    assert [reshard.sources(3, r, 3, replicated) for r in range(3) for replicated in (False, True)] == [
        (0,), (0,), (1,), (1,), (2,), (2,)]


def test_replicated_state_reads_its_own_old_rank_or_rank_0():
    assert [reshard.sources(2, r, 3, replicated=True) for r in range(3)] == [(0,), (1,), (0,)]
    assert [reshard.sources(3, r, 2, replicated=True) for r in range(2)] == [(0,), (1,)]


def test_sharded_state_reads_every_old_dir_its_primary_first():
    assert [reshard.sources(3, r, 2, replicated=False) for r in range(2)] == [(0, 1, 2), (1, 0, 2)]
    assert [reshard.sources(2, r, 3, replicated=False) for r in range(3)] == [(0, 1), (1, 0), (0, 1)]


def test_a_save_is_complete_only_when_every_new_rank_reads_what_it_needs_of_that_same_save():
    a, stale = (2, "a"), (2, "old")
    shrink_own_dirs = [{0: a}]  # 2 -> 1 on the node of old rank 0, nothing copied
    assert reshard.pick(shrink_own_dirs, replicated=True) == a
    assert reshard.pick(shrink_own_dirs, replicated=False) is None
    assert reshard.missing(shrink_own_dirs, a, replicated=False) == {0: [1]}
    assert reshard.pick([{0: a, 1: a}], replicated=False) == a
    assert reshard.pick([{0: a, 1: stale}], replicated=False) is None  # never mixes two saves
    grow = [{0: a, 1: a}, {1: a}, {0: a, 1: a}]  # 2 -> 3: new rank 1 holds only its own old dir
    assert reshard.pick(grow, replicated=True) == a
    assert reshard.missing(grow, a, replicated=False) == {1: [0]}


def test_the_same_world_size_needs_each_ranks_own_dir_and_is_preferred():
    assert reshard.pick([{0: (2, "x")}, {0: (2, "x")}], replicated=False) is None  # rank 1 lacks rank-1
    # replicated (lora): a spare in a lost host's place reads another rank's dir, its own when it has it
    assert reshard.pick([{0: (2, "x")}, {0: (2, "x")}], replicated=True) == (2, "x")
    assert reshard.sources(2, 1, 2, True, {0}) == (0,) and reshard.sources(2, 1, 2, True, {0, 1}) == (1,)
    both = [{0: (2, "new"), 1: (3, "old"), 2: (3, "old")}, {0: (3, "old"), 1: (2, "new")}]
    assert reshard.writers(both)[0] == (2, "new")
    assert reshard.pick(both, replicated=True) == (2, "new")


def test_what_is_missing_is_named_with_host_and_path_once_per_place():
    text = reshard.describe_missing({0: [1, 2], 1: [2], 3: [0]}, ["n1", "n1", "n2", "n3"],
                                    ["/o/step-4", "/o/step-4", "/p/step-4", "/q/step-4"])
    assert text == "n1:/o/step-4 lacks rank-1, rank-2 (new ranks 0, 1); n3:/q/step-4 lacks rank-0 (new rank 3)"


# ------------------------------------------------------------------ the merged reader, on real DCP files

def shard_dirs(step: Path, full: torch.Tensor, world: int) -> None:
    """What ``world`` ranks of FSDP2 write with no_dist: each its Shard(0) chunk of ``full`` in its own
    ``rank-R`` dir, with metadata naming the global shape and the chunk's offset (a replicated ``step`` too)."""
    for rank, part in enumerate(full.chunk(world)):
        out = step / f"rank-{rank}"
        dcp.save({"w": part.clone(), "step": torch.tensor(float(rank))}, checkpoint_id=out, no_dist=True)
        meta = pickle.loads((out / ".metadata").read_bytes())
        offset = [sum(len(p) for p in full.chunk(world)[:rank])] + [0] * (full.dim() - 1)
        item = meta.state_dict_metadata["w"]
        chunk = ChunkStorageMetadata(torch.Size(offset), item.chunks[0].sizes)
        meta.state_dict_metadata["w"] = TensorStorageMetadata(item.properties, full.size(), [chunk])
        meta.storage_data = {(MetadataIndex("w", offset) if k.fqn == "w" else k): v for k, v in meta.storage_data.items()}
        (out / ".metadata").write_bytes(pickle.dumps(meta))


def test_merged_reader_lets_dcp_reassemble_and_reshard_the_old_shards(tmp_path):
    full = torch.arange(30.0).reshape(6, 5)
    shard_dirs(tmp_path, full, world=3)
    whole = {"w": torch.zeros(6, 5), "step": torch.tensor(-1.0)}
    dcp.load(whole, storage_reader=reshard.MergedReader(tmp_path, [2, 0, 1]), no_dist=True)
    assert torch.equal(whole["w"], full)
    assert whole["step"].item() == 2.0  # an entry every dir holds comes from the primary (listed first)


def test_merged_reader_refuses_shards_that_do_not_cover_a_tensor(tmp_path):
    shard_dirs(tmp_path, torch.arange(12.0).reshape(4, 3), world=2)
    with pytest.raises(RecipeError, match=r"the dirs rank-0 hold 6 of the 12 elements of w \(a rank dir is missing"):
        reshard.MergedReader(tmp_path, [0])


def test_merged_reader_skips_empty_shards_of_an_uneven_split(tmp_path):
    shard_dirs(tmp_path, torch.arange(6.0).reshape(2, 3), world=2)
    empty = tmp_path / "rank-2"  # a third rank whose Shard(0) chunk of a 2-row tensor is empty
    dcp.save({"w": torch.zeros(0, 3), "step": torch.tensor(2.0)}, checkpoint_id=empty, no_dist=True)
    meta = pickle.loads((empty / ".metadata").read_bytes())
    item = meta.state_dict_metadata["w"]
    meta.state_dict_metadata["w"] = TensorStorageMetadata(item.properties, torch.Size([2, 3]), [
        dataclasses.replace(item.chunks[0], offsets=torch.Size([0, 0]))])
    (empty / ".metadata").write_bytes(pickle.dumps(meta))
    whole = {"w": torch.zeros(2, 3), "step": torch.tensor(0.0)}
    dcp.load(whole, storage_reader=reshard.MergedReader(tmp_path, [2, 0, 1]), no_dist=True)
    assert torch.equal(whole["w"], torch.arange(6.0).reshape(2, 3))
