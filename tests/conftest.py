"""Shared fixtures. The `cluster` suite (-m cluster) runs on a simulated cluster from testbed.

Fixtures:
  testbed                 session: the testbed module, or a skip with the reason this machine can't run it
  cluster                 session: 4 hosts h1..h4 + an outsider, built once, always torn down
  healthy_cluster         function: the session cluster, restored after the test (link up, original host keys,
                          sshd running, stray processes killed) — use it in any test that breaks a host
  fresh_cluster_factory   function: factory(n_hosts=2, outsider=False, prefix=None) -> a private Cluster for
                          destructive tests; every cluster it built is torn down after the test
  chromium                module: Debian's chromium driven by Playwright (tests/boardfakes.py says when it can't)
  hanging_host            function: a local TCP port that accepts connections and never says a word (a wedged sshd,
                          a firewall answering the SYN): .port, .accepted (the connections it took, held open)
  torch_image             session: images.torch_image(), the CPU-torch image (built once per machine, cached)
  tiny_images             session: (images.tiny_image("a"), images.tiny_image("b")): two different ≈ 2 MB images
  container_cluster       module: 2 hosts h1, h2, each with its own podman (containers=True), always torn down
  (the last three skip without podman, runc and conmon, and fail instead under MNFT_REQUIRE_CLUSTER=1)
  (autouse) lease_dir     function: MNFT_LEASE_DIR in a fresh directory, so a `connection: local` host's lease is
                          the test's own, not this machine's /run/lock (shared with every other test run)
  (autouse) own_mnft_home function: MNFT_HOME in a fresh directory (a test that names its own keeps it), so the
                          index of runs a recorded run is added to (mnft.run.records) is never the developer's ~/.mnft

Every test marked `cluster` gets a pytest-timeout (CLUSTER_TIMEOUT seconds) unless it sets its own, so a hung
ssh or torchrun fails the test instead of blocking CI. Nothing heavy (and no mnft module) is imported here at
import time: collection works whatever state the rest of the package is in.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_TIMEOUT = 600  # seconds, per cluster test (a recovery test on a loaded 2-core CI box takes 2-3 min)
SESSION_HOSTS = 4

if str(ROOT) not in sys.path:  # tests run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def lease_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's machine-wide lease directory (mnft.onhost.leasehost) for the hosts it runs on this machine."""
    directory = tmp_path_factory.mktemp("leases")
    monkeypatch.setenv("MNFT_LEASE_DIR", str(directory))
    return directory


@pytest.fixture(autouse=True)
def own_mnft_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's $MNFT_HOME (the user's runs index, code snapshots, caches), never the developer's ~/.mnft."""
    directory = tmp_path_factory.mktemp("mnft-home")
    monkeypatch.setenv("MNFT_HOME", str(directory))
    return directory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("cluster") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CLUSTER_TIMEOUT))


def _testbed():
    """Import testbed, or skip with the reason the machine cannot run it."""
    import testbed

    try:
        testbed.check_prerequisites()
    except testbed.ClusterUnavailable as exc:
        if os.environ.get("MNFT_REQUIRE_CLUSTER") == "1":  # CI installs the prerequisites: a skip there is a failure
            pytest.fail(f"simulated cluster unavailable although MNFT_REQUIRE_CLUSTER=1: {exc}")
        pytest.skip(f"simulated cluster unavailable: {exc}")
    return testbed


class _TerminateAsInterrupt:
    """While a cluster exists, SIGTERM (CI cancelling, `timeout`) unwinds like Ctrl-C so finalizers tear it
    down; atexit in testbed is the last resort. SIGKILL leaves leftovers: cleanup_stale() at next start."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self.previous = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


@pytest.fixture(scope="session")
def testbed():
    """The testbed module, or a skip saying why this machine cannot run it."""
    return _testbed()


@pytest.fixture(scope="session")
def cluster(testbed, tmp_path_factory: pytest.TempPathFactory):
    testbed.Cluster.cleanup_stale()
    with _TerminateAsInterrupt():
        built = testbed.Cluster.create(SESSION_HOSTS, tmp_path_factory.mktemp("cluster"), outsider=True)
        try:
            yield built
        finally:
            built.teardown()


@pytest.fixture
def healthy_cluster(cluster):
    """The session cluster; whatever the test broke on its hosts is repaired afterwards."""
    try:
        yield cluster
    finally:
        cluster.restore()


@pytest.fixture
def lab_scripts(tmp_path: Path) -> Path:
    """The lab's own tree for the cluster tests: a script that ends at once (quick.py), and one that sleeps (long.py)."""
    src = tmp_path / "lab-src"
    src.mkdir()
    (src / "quick.py").write_text("print('done', flush=True)\n")
    (src / "long.py").write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    return src


@pytest.fixture
def fresh_cluster_factory(testbed, tmp_path_factory: pytest.TempPathFactory):
    built = []

    def make(n_hosts: int = 2, *, outsider: bool = False, prefix: str | None = None, **options):
        """A private cluster; `options` go to Cluster.create (e.g. stock_sshd=True)."""
        one = testbed.Cluster.create(n_hosts, tmp_path_factory.mktemp("fresh"), outsider=outsider, prefix=prefix, **options)
        built.append(one)
        return one

    with _TerminateAsInterrupt():
        try:
            yield make
        finally:
            for one in built:
                one.teardown()


@pytest.fixture(scope="module")
def slurm_bed(testbed, tmp_path_factory: pytest.TempPathFactory):
    """A real Slurm (tests/slurmbed.py) on 3 simulated hosts h1..h3 sharing one home (the shared filesystem a Slurm
    run needs), slurmctld in the outsider's namespace; built once per module, always torn down. Skips (fails under
    MNFT_REQUIRE_CLUSTER=1) when Slurm's packages are missing."""
    import slurmbed

    try:
        slurmbed.check_prerequisites()
    except testbed.ClusterUnavailable as exc:
        if os.environ.get("MNFT_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"Slurm test bed unavailable although MNFT_REQUIRE_CLUSTER=1: {exc}")
        pytest.skip(f"Slurm test bed unavailable: {exc}")
    with _TerminateAsInterrupt():
        built = testbed.Cluster.create(3, tmp_path_factory.mktemp("slurm"), outsider=True, shared_home=("h1", "h2", "h3"))
        slurm = None
        try:
            slurm = slurmbed.Slurm.start(built)
            yield slurm
        finally:
            if slurm is not None:
                slurm.stop()
            built.teardown()


def _require_containers(testbed) -> None:
    """Skip, or fail under MNFT_REQUIRE_CLUSTER=1, unless hosts can have a podman of their own."""
    try:
        testbed.check_container_prerequisites()
    except testbed.ClusterUnavailable as exc:
        if os.environ.get("MNFT_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"containers on the simulated cluster unavailable although MNFT_REQUIRE_CLUSTER=1: {exc}")
        pytest.skip(f"containers on the simulated cluster unavailable: {exc}")


@pytest.fixture(scope="session")
def torch_image(testbed):
    """The test bed's CPU-torch image (tests/images.py): this machine's Python with torch, transformers, peft…
    Built on the first use on a machine (≈ 15-30 s, ≈ 1 GB in /var/cache/mnft-test-images), found there after."""
    _require_containers(testbed)
    import images

    return images.torch_image()


@pytest.fixture(scope="session")
def tiny_images(testbed, tmp_path_factory: pytest.TempPathFactory):
    """Two tiny images of different content (so different ids): localhost/mnft-tiny:a and :b."""
    _require_containers(testbed)
    import images

    directory = tmp_path_factory.mktemp("tiny-images")
    return images.tiny_image("a", directory), images.tiny_image("b", directory)


@pytest.fixture(scope="module")
def container_cluster(testbed, tmp_path_factory: pytest.TempPathFactory):
    """2 hosts h1, h2 (no outsider), each with its own podman and storage, empty; built once per module."""
    _require_containers(testbed)
    with _TerminateAsInterrupt():
        built = testbed.Cluster.create(2, tmp_path_factory.mktemp("containers"), outsider=False, containers=True)
        try:
            yield built
        finally:
            built.teardown()


class HangingHost:
    """127.0.0.1:port accepts every connection and never speaks; the connections are held open until the end."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def inventory(self, path: Path, name: str = "wedged") -> Path:
        path.write_text(f"hosts:\n  {name}: {{address: 127.0.0.1, port: {self.port}, user: nobody}}\n")
        return path

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def hanging_host():
    host = HangingHost()
    yield host
    host.close()


@pytest.fixture(scope="module")
def chromium():
    """Debian's chromium driven by Playwright, once per test module (skips, or fails on CI, without them)."""
    from boardfakes import CHROMIUM, require_browser

    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
