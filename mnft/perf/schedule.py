"""Pure planning for the perf check: who tests the link with whom in which round, how long, which sizes.

The link matrix is a round-robin tournament (the circle method): every pair of hosts meets exactly once, in
N-1 rounds for an even N (N rounds for an odd N, one host sitting out each round), and within a round the
pairs are disjoint, so no host does two transfers at once. Each meeting tests both directions, one after the
other.
"""

from __future__ import annotations

from typing import Hashable, Sequence, TypeVar

T = TypeVar("T", bound=Hashable)

MiB = 1 << 20


def round_robin(items: Sequence[T]) -> list[list[tuple[T, T]]]:
    """Rounds of disjoint pairs in which every pair of `items` meets exactly once.

    Circle method: the first item stays put, the others rotate one place per round; round r pairs position i
    with position n-1-i. An odd count gets a placeholder, and whoever meets it sits the round out.
    """
    players: list[T | None] = list(items)
    if len(set(players)) != len(players):
        raise ValueError("round_robin: the items must be distinct")
    if len(players) < 2:
        return []
    if len(players) % 2:
        players.append(None)
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = [(players[i], players[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def link_seconds(n_hosts: int, budget: float = 3.0, longest: float = 0.5, shortest: float = 0.1) -> float:
    """Seconds of transfer per direction and pair: the link phase's budget spread over its rounds (two
    directions each), within [shortest, longest]. 2 hosts: 0.5 s; 8 hosts: 0.21 s; 64 hosts: 0.1 s (63 rounds:
    12.6 s of transfers)."""
    rounds = n_hosts - 1 if n_hosts % 2 == 0 else n_hosts
    if rounds < 1:
        return 0.0
    return round(min(longest, max(shortest, budget / (2 * rounds))), 3)


def message_sizes(smallest: int = 1 * MiB, largest: int = 256 * MiB) -> list[int]:
    """all_reduce sizes in bytes, doubling from `smallest` to `largest` (nccl-tests' -b 1M -e 256M -f 2)."""
    if smallest <= 0 or largest < smallest:
        raise ValueError(f"message sizes: need 0 < smallest ≤ largest, got {smallest}, {largest}")
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def bus_factor(world_size: int) -> float:
    """nccl-tests' all_reduce bus bandwidth factor 2(n-1)/n: busbw = algbw × this (0 for a world of one)."""
    return 2 * (world_size - 1) / world_size if world_size > 0 else 0.0
