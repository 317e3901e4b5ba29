"""Instruction data: JSONL -> token ids with the prompt masked out of the loss, optional packing, and a
resumable stream of micro-batches drawn by a ``DistributedSampler`` (``set_epoch``, ``drop_last``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from mnft.recipes.config import RecipeError

BUNDLED = Path(__file__).parent / "assets" / "instruct.jsonl"
PROMPT = "### Instruction:\n{instruction}\n### Response:\n"
IGNORE = -100  # label of a token that is not trained (prompt, padding)


def read_jsonl(path: Path) -> list[dict[str, str]]:
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise RecipeError(f"dataset {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecipeError(f"dataset {path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("instruction"), str) or not isinstance(
                row.get("response"), str):
            raise RecipeError(f"dataset {path}:{n}: expected {{\"instruction\": str, \"response\": str}}")
        rows.append(row)
    if not rows:
        raise RecipeError(f"dataset {path}: no examples")
    return rows


def tokenize(tokenizer, row: dict[str, str], max_seq_len: int) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``: labels copy the response (+ EOS) and are IGNORE over the prompt."""
    prompt = tokenizer(PROMPT.format(**row), add_special_tokens=False)["input_ids"]
    response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id] + prompt
    ids = (prompt + response)[:max_seq_len]
    labels = ([IGNORE] * len(prompt) + response)[:max_seq_len]
    return ids, labels


def pack(examples: list[tuple[list[int], list[int]]], max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Greedily concatenate whole examples into rows of at most ``max_seq_len`` tokens (order kept).

    Attention is not reset at example boundaries (plain causal mask): fine for short, independent examples.
    """
    rows, ids, labels = [], [], []
    for e_ids, e_labels in examples:
        if ids and len(ids) + len(e_ids) > max_seq_len:
            rows.append((ids, labels))
            ids, labels = [], []
        ids, labels = ids + e_ids, labels + e_labels
    if ids:
        rows.append((ids, labels))
    return rows


def build(tokenizer, path: str | None, max_seq_len: int, packing: bool) -> list[tuple[list[int], list[int]]]:
    examples = [tokenize(tokenizer, row, max_seq_len) for row in read_jsonl(Path(path) if path else BUNDLED)]
    return pack(examples, max_seq_len) if packing else examples


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that carry loss: a label at position t is predicted from position t-1, so the first never is."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


@dataclass
class Batches:
    """This rank's micro-batches, epoch after epoch; ``position`` is all that is needed to resume, on any world size.

    An epoch's order is the ``DistributedSampler`` permutation (``shuffle``, ``seed + epoch``). Rank r of W takes the
    permutation's positions ``start + r + W*j`` for as many j as every rank can (``drop_last``: the ragged tail is
    left), ``micro_batch_size`` at a time. From ``start = 0`` that is exactly what ``DistributedSampler(W, r,
    drop_last=True)`` deals rank r. After k micro-batches on every rank the epoch's consumed rows are the contiguous
    prefix ``[0, start + W*k*micro_batch_size)`` of the permutation, so the position is stored as that global
    ``offset``: a resume on W' ranks continues the epoch at ``start = offset`` (no row repeated or skipped, except
    the tail too short for W' ranks), and the next epoch starts at 0 as usual.
    """

    rows: list
    micro_batch_size: int
    rank: int
    world_size: int
    seed: int
    pad_id: int
    epoch: int = 0
    start: int = 0  # position in the epoch's permutation where this world began (0, or where a resume continued)
    index: int = 0  # micro-batches this rank took since start

    def __post_init__(self) -> None:
        per_rank = len(self.rows) // self.world_size
        if per_rank < self.micro_batch_size:
            raise RecipeError(f"dataset has {len(self.rows)} rows: too few for {self.world_size} ranks x "
                              f"micro_batch_size {self.micro_batch_size}")
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        """This rank's rows for the rest of the epoch: positions start + rank + world_size*j of the permutation."""
        sampler = DistributedSampler(self.rows, num_replicas=1, rank=0, shuffle=True, seed=self.seed, drop_last=False)
        sampler.set_epoch(self.epoch)
        permutation = list(sampler)  # the sampler's own shuffle: the order every world size deals from
        per_rank = (len(permutation) - self.start) // self.world_size
        return permutation[self.start + self.rank::self.world_size][:per_rank]

    def next(self) -> dict:
        """The next micro-batch (collated tensors, plus ``rows``: the dataset row ids in it)."""
        if self._order is None:
            self._order = self._epoch_order()
        if (self.index + 1) * self.micro_batch_size > len(self._order):  # drop the ragged tail
            self.epoch, self.start, self.index, self._order = self.epoch + 1, 0, 0, None
            return self.next()
        take = self._order[self.index * self.micro_batch_size: (self.index + 1) * self.micro_batch_size]
        self.index += 1
        return {**collate([self.rows[i] for i in take], self.pad_id), "rows": take}

    def position(self) -> dict[str, int]:
        """The epoch and the global offset into its permutation: the same on every rank, valid on any world size."""
        return {"epoch": self.epoch, "offset": self.start + self.world_size * self.index * self.micro_batch_size}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.start, self.index, self._order = int(position["epoch"]), int(position["offset"]), 0, None
