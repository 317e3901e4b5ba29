"""Fan-in pacing and the retry of MaxStartups drops (mnft.hosts.fanin): hosts in, batches out; failures' wording in,
drop or not out; the connection factory retrying a port that drops before the banner. No sshd here."""

from __future__ import annotations

import random
import socket
import threading
from collections import Counter

import fabric
import paramiko
import pytest

from mnft.hosts import fanin
from mnft.hosts.connection import Timeouts, Unreachable, open_connection
from mnft.hosts.hostkeys import TrustedKeys
from mnft.hosts.settings import Host

HOSTS = [f"h{i}" for i in range(1, 65)]
NO_SSH_CONFIG = fabric.Config(overrides={"load_ssh_configs": False})  # never the developer's ~/.ssh/config


def received(batch) -> Counter:
    return fanin.fan_in(batch)


@pytest.mark.parametrize("n", [2, 3, 16, 64])
def test_every_pair_in_batches_where_no_host_receives_more_than_k(n):
    hosts = HOSTS[:n]
    batches = fanin.pace(fanin.all_pairs(hosts), k=8)
    pairs = [pair for batch in batches for pair in batch]
    assert sorted(pairs) == sorted((a, b) for a in hosts for b in hosts if a != b)  # each ordered pair, once
    assert all(max(received(batch).values()) <= 8 for batch in batches)
    assert len(batches) == -(-(n - 1) // 8)  # rounds are permutations: 8 rounds fill a batch


def test_the_usual_order_every_host_starting_with_the_first_peer_is_split():
    # what setup did before: every node verified h1 first, so h1's sshd received 63 connections at once
    naive = [(a, b) for a in HOSTS for b in HOSTS if a != b]
    first_hops = [(a, next(b for b in HOSTS if b != a)) for a in HOSTS]
    assert received(first_hops)["h1"] == 63
    batches = fanin.pace(naive, k=8)
    assert all(max(received(batch).values()) <= 8 for batch in batches)
    assert sorted(p for b in batches for p in b) == sorted(naive)


def test_many_hosts_to_one_go_in_waves_of_k():
    batches = fanin.pace([(h, "master") for h in HOSTS], k=9)
    assert [len(b) for b in batches] == [9] * 7 + [1]
    assert [pair for batch in batches for pair in batch] == [(h, "master") for h in HOSTS]  # order kept


def test_pacing_keeps_senders_below_their_limit_too():
    batches = fanin.pace([("h1", h) for h in HOSTS[1:]], k=8, sends=4)
    assert all(Counter(s for s, _ in b)["h1"] <= 4 for b in batches) and len(batches) == 16


def test_random_pair_lists_never_exceed_k():
    rng = random.Random(20)
    for _ in range(50):
        pairs = [(rng.choice(HOSTS), rng.choice(HOSTS[:5])) for _ in range(rng.randrange(1, 300))]
        k = rng.randrange(1, 10)
        batches = fanin.pace(pairs, k)
        assert all(max(received(b).values()) <= k for b in batches)
        assert Counter(p for b in batches for p in b) == Counter(pairs)


def test_a_ring_sends_and_receives_one_per_host():
    assert fanin.ring(["a", "b", "c"]) == [("a", "b"), ("b", "c"), ("c", "a")]
    assert fanin.ring(["a", "b"]) == [("a", "b"), ("b", "a")]
    assert fanin.ring(["a"]) == [] and fanin.all_pairs(["a"]) == []


# ---------------------------------------------------------------------------------------------- drops


@pytest.mark.parametrize("text", [
    "kex_exchange_identification: read: Connection reset by peer\r\nConnection reset by 10.213.178.12 port 22\r\n",
    "kex_exchange_identification: Connection closed by remote host\r\nConnection closed by 10.213.178.11 port 22\r\n",
    "ssh_exchange_identification: read: Connection reset by peer",  # OpenSSH before 8.0
    "Connection reset by 10.0.0.11 port 22",  # the last line, as mesh's report shows it
    paramiko.SSHException("Error reading SSH protocol banner"),
    "Exceeded MaxStartups",  # what sshd writes instead of its banner
    "rsync: connection unexpectedly closed (0 bytes received so far) [sender]\nkex_exchange_identification: read: Connection reset by peer",
])
def test_a_maxstartups_drop_is_told_by_its_wording(text):
    assert fanin.is_drop(text)


@pytest.mark.parametrize("text", [
    "root@10.0.0.11: Permission denied (publickey).",
    "Host key verification failed.",
    "ssh: connect to host 10.0.0.11 port 22: Connection refused",
    "ssh: connect to host 10.0.0.11 port 22: Connection timed out",
    "ssh: connect to host 10.0.0.11 port 22: No route to host",
    "Connection to 10.0.0.11 closed by remote host.",  # an established session ended: not before the banner
    "",
    None,
])
def test_other_failures_are_not_drops(text):
    assert not fanin.is_drop(text)


def test_backoff_doubles_with_jitter_and_is_capped():
    assert [fanin.backoff(a, rng=lambda: 0.5) for a in (1, 2, 3, 4, 5, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert fanin.backoff(1, rng=lambda: 0.0) == 0.25 and fanin.backoff(1, rng=lambda: 0.999) < 0.75


def test_a_drop_is_retried_and_a_host_that_keeps_dropping_is_named_with_the_setting():
    waits = []
    answers = iter(["kex_exchange_identification: read: Connection reset by peer", "Connection closed by h1 port 22", "ok"])
    result, attempts = fanin.retry_drops(lambda: next(answers), fanin.is_drop, sleep=waits.append)
    assert (result, attempts, len(waits)) == ("ok", 3, 2)
    result, attempts = fanin.retry_drops(lambda: "Permission denied (publickey).", fanin.is_drop, sleep=waits.append)
    assert attempts == 1  # not a drop: no retry
    message = fanin.refusal("h7")
    assert "h7's sshd" in message and "MaxStartups" in message and "/etc/ssh/sshd_config" in message


class _Server:
    """A TCP port on 127.0.0.1: `greeting` is sent to each connection, then it is closed (b"": at once, as sshd
    past MaxStartups does)."""

    def __init__(self, greeting: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.accepted = 0
        self.greeting = greeting
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.greeting:
                conn.sendall(self.greeting)
            conn.close()

    def host(self) -> Host:
        return Host(name="n1", address="127.0.0.1", rank=0, port=self.sock.getsockname()[1], user="root")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.parametrize("greeting", [b"", b"Exceeded MaxStartups\r\n"])  # closed at once; what sshd 9 writes
def test_a_port_that_closes_before_the_banner_is_retried_then_named_with_maxstartups(greeting):
    server = _Server(greeting)
    waits: list[float] = []
    try:
        with pytest.raises(Unreachable) as caught:
            open_connection(server.host(), TrustedKeys(), Timeouts(connect=3), NO_SSH_CONFIG, attempts=3, sleep=waits.append)
    finally:
        server.close()
    assert len(waits) == 2 and server.accepted == 3 + 3  # 3 attempts, each followed by the probe of what answers
    assert "MaxStartups" in str(caught.value) and "sshd_config" in str(caught.value)


def test_a_port_that_answers_but_is_not_ssh_is_not_retried():
    server = _Server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    waits: list[float] = []
    try:
        with pytest.raises(Unreachable) as caught:
            open_connection(server.host(), TrustedKeys(), Timeouts(connect=3), NO_SSH_CONFIG, attempts=3, sleep=waits.append)
    finally:
        server.close()
    assert waits == [] and "SSH protocol banner" in str(caught.value) and "MaxStartups" not in str(caught.value)


# ---------------------------------------------------------------------------------------------- the other fan-ins


def test_the_relay_sends_each_host_one_copy_per_round():
    from mnft.sync import relay

    for round_ in relay.rounds(HOSTS, relay=True):
        assert max(received(round_).values()) == 1  # a round's receivers are distinct hosts


def test_the_reachability_test_of_check_connects_in_waves_the_listener_queue_holds():
    from mnft.onhost import nettest

    waves = fanin.pace([(f"h{i}", "master") for i in range(300)], nettest.LISTEN_BACKLOG)
    assert [len(w) for w in waves] == [128, 128, 44]


def test_an_rsync_whose_connection_sshd_dropped_is_retried_then_names_maxstartups(tmp_path):
    from mnft.hosts.fleet import Status
    from mnft.sync.rsync import classify, run_rsync

    counter = tmp_path / "tries"
    script = ("echo x >> " + str(counter) + "; echo 'kex_exchange_identification: read: Connection reset by peer' >&2; "
              "echo 'rsync: connection unexpectedly closed (0 bytes received so far) [sender]' >&2; exit 255")
    waits: list[float] = []
    outcome = run_rsync(["sh", "-c", script, "rsync", "root@10.0.0.12:mnft/"], attempts=3, sleep=waits.append)
    assert len(counter.read_text().split()) == 3 and len(waits) == 2
    status, error = classify(outcome.exit_code, outcome.stderr)
    assert status is Status.UNREACHABLE and error.startswith("10.0.0.12's sshd") and "MaxStartups" in error


def test_an_rsync_that_failed_otherwise_is_not_retried(tmp_path):
    from mnft.sync.rsync import run_rsync

    counter = tmp_path / "tries"
    script = "echo x >> " + str(counter) + "; echo 'root@10.0.0.12: Permission denied (publickey).' >&2; exit 255"
    run_rsync(["sh", "-c", script, "rsync", "root@10.0.0.12:mnft/"], attempts=3, sleep=lambda s: None)
    assert len(counter.read_text().split()) == 1
