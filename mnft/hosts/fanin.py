"""Fan-in: many connections to one host's sshd without tripping its MaxStartups, and the retry of those it drops.

sshd drops a new connection at random once it holds `start` connections that have not authenticated yet
(OpenSSH's default, which Debian and Ubuntu ship: `MaxStartups 10:30:100`, 30 % of new connections dropped beyond
10, all beyond 100). sshd writes "Exceeded MaxStartups" instead of its banner and closes: OpenSSH's client prints
`kex_exchange_identification: read: Connection reset by peer` (or `… Connection closed by remote host`) and
`Connection reset by <addr> port 22`, paramiko raises "Error reading SSH protocol banner".

So a step in which hosts connect to hosts is planned, not fired at once:

* `pace(pairs, k)` packs (sender, receiver) pairs into batches in which no host receives more than k
  connections in total, and so never more than k at once, however much the senders drift apart inside a
  batch; the caller puts a barrier between batches. `ring` and `all_pairs` are the usual pair lists (a pair
  list whose every round is a permutation: each host sends one and receives one per round).
* `is_drop` tells a MaxStartups drop from other failures by its wording; `backoff` is the wait before attempt n
  (exponential, with jitter so the retries of many senders do not collide again); `refusal` is the one-line error
  for a host that still drops after every attempt, naming the sshd setting to raise.

The controller's own connections are one per host (`mnft.hosts.fleet`), so they never pile up on one sshd; they
retry a drop too (another program may be connecting at the same time).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

STOCK_MAX_STARTUPS = 10  # OpenSSH's default MaxStartups start (10:30:100)
PER_HOST = 8  # connections a host receives at once from its peers: below 10, with room for the controller's own
ATTEMPTS = 5  # tries of one connection that sshd keeps dropping (4 waits: about 0.5 + 1 + 2 + 4 s, jittered)
MAX_WAIT = 8.0

N = TypeVar("N", bound=Hashable)
Pair = tuple  # (sender, receiver)

SSHD_DROP_LINE = b"Exceeded MaxStartups"  # what sshd writes instead of its banner when it drops a connection
# OpenSSH's and paramiko's words for a connection closed before the SSH banner: what a MaxStartups drop looks like.
_DROP = re.compile(
    r"Exceeded MaxStartups|kex_exchange_identification|ssh_exchange_identification|"
    r"Connection (reset|closed) by \S+ port \d+|"
    r"Error reading SSH protocol banner"
)


# ---------------------------------------------------------------------------------------------- schedules (pure)


def ring(hosts: Sequence[N]) -> list[tuple[N, N]]:
    """Each host to the next, the last to the first: every host sends one connection and receives one."""
    n = len(hosts)
    if n < 2:
        return []
    return [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]


def all_pairs(hosts: Sequence[N]) -> list[tuple[N, N]]:
    """Every ordered pair, round by round: round s is each host i to host i+s (mod n), a permutation, so every
    host receives exactly one connection per round (the usual mistake, every host starting with the first peer,
    sends n-1 connections to one sshd at once)."""
    n = len(hosts)
    return [(hosts[i], hosts[(i + s) % n]) for s in range(1, n) for i in range(n)]


def pace(pairs: Iterable[tuple[N, N]], k: int = PER_HOST, *, sends: int | None = None) -> list[list[tuple[N, N]]]:
    """Batches of the pairs (order kept within a batch) in which no receiver appears more than k times (and, with
    `sends`, no sender more than `sends` times): first fit, so a batch fills before the next begins."""
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    batches: list[list[tuple[N, N]]] = []
    received: list[Counter] = []
    sent: list[Counter] = []
    for pair in pairs:
        sender, receiver = pair
        for i, batch in enumerate(batches):
            if received[i][receiver] < k and (sends is None or sent[i][sender] < sends):
                break
        else:
            batches.append([])
            received.append(Counter())
            sent.append(Counter())
            i = len(batches) - 1
        batches[i].append(pair)
        received[i][receiver] += 1
        sent[i][sender] += 1
    return batches


def fan_in(batch: Iterable[tuple[N, N]]) -> Counter:
    """receiver -> connections it receives in the batch."""
    return Counter(receiver for _, receiver in batch)


# ---------------------------------------------------------------------------------------------- drops and retries


def is_drop(text: str | BaseException | None) -> bool:
    """Whether a failure reads as sshd closing the connection before the SSH banner (a MaxStartups drop): OpenSSH's
    stderr or paramiko's exception. Refusals, timeouts, authentication and host-key failures are not drops."""
    if isinstance(text, BaseException):
        text = f"{text.__class__.__name__}: {text}"
    return bool(text) and _DROP.search(text) is not None


def backoff(attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, …): 0.5, 1, 2, 4 … capped at MAX_WAIT, times a
    jitter between 0.5 and 1.5."""
    return min(MAX_WAIT, 0.5 * 2 ** (attempt - 1)) * (0.5 + rng())


def refusal(host: str, attempts: int = ATTEMPTS) -> str:
    """The error for a host whose sshd still dropped the connection after every attempt."""
    return (f"{host}'s sshd closed the connection before the SSH banner {attempts} times (MaxStartups: too many "
            f"connections not yet authenticated): raise MaxStartups in {host}'s /etc/ssh/sshd_config "
            f"(e.g. MaxStartups 100:30:200; the default is 10:30:100) and reload sshd")


T = TypeVar("T")


def retry_drops(call: Callable[[], T], dropped: Callable[[T], bool], *, attempts: int = ATTEMPTS,
                sleep: Callable[[float], None] = time.sleep) -> tuple[T, int]:
    """call() until its result is not a drop, at most `attempts` times, with `backoff` between: (last result,
    attempts made)."""
    for attempt in range(1, attempts + 1):
        result = call()
        if attempt == attempts or not dropped(result):
            return result, attempt
        sleep(backoff(attempt))
    raise AssertionError("unreachable")
