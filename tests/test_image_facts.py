"""An image's facts on a host (mnft.onhost.imagehost): which runtime, its version, as whom, CDI and GPUs, and the
image's id; with fake runtimes on PATH (small shell scripts), then against this machine's podman in a storage of
the test's own (a wrapper named podman: --root in tmp_path), never the machine's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mnft.onhost import imagehost

HEX = "ab" * 32
OTHER = "cd" * 32


def fake(bin_dir: Path, name: str, body: str) -> Path:
    """An executable shell script `name` in bin_dir."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def podman(bin_dir: Path, name: str = "podman", images: dict[str, str] | None = None, version: str = "podman version 4.3.1",
           fail: str | None = None) -> Path:
    """A podman (or docker) that knows `images` {ref: id as it prints it}; `fail`: every image command fails so."""
    cases = "".join(f'    "{ref}") echo "{ident}"; exit 0;;\n' for ref, ident in (images or {}).items())
    image = (f'echo "{fail}" >&2; exit 125\n' if fail else
             f'case "$5" in\n{cases}    *) echo "Error: $5: image not known" >&2; exit 125;;\n  esac\n')
    return fake(bin_dir, name, f"""case "$1" in
  --version) echo "{version}";;
  version) echo "24.0.5";;
  image) {image};;
  *) exit 3;;
esac
""")


@pytest.fixture
def path(tmp_path, monkeypatch):
    """PATH holding only the test's fake programs; HOME in tmp_path (the .sif cache); no CDI directories."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(imagehost, "CDI_DIRS", (str(tmp_path / "cdi"),))
    return bin_dir


def test_the_facts_hold_exactly_the_contracts_keys(path):
    podman(path, images={"localhost/train:1": HEX})
    facts = imagehost.facts("auto", "localhost/train:1")
    assert facts == {"runtime": "podman", "path": str(path / "podman"), "version": "4.3.1", "uid": os.getuid(), "gid": os.getgid(),
                     "home": os.path.expanduser("~"), "rootless": os.getuid() != 0, "cdi": False, "gpus": False,
                     "image": {"ref": "localhost/train:1", "present": True, "id": "sha256:" + HEX}, "error": None}


def test_auto_takes_podman_before_docker_and_docker_before_apptainer(path):
    podman(path, "docker", images={"r": "sha256:" + HEX}, version="Docker version 24.0.5, build ced0996")
    fake(path, "apptainer", 'echo "apptainer version 1.2.5"\n')
    assert imagehost.facts("auto", "r")["runtime"] == "docker"
    assert imagehost.facts("auto", "r")["image"] == {"ref": "r", "present": True, "id": "sha256:" + HEX}
    podman(path, images={"r": OTHER})
    facts = imagehost.facts("auto", "r")
    assert (facts["runtime"], facts["image"]["id"]) == ("podman", "sha256:" + OTHER)


def test_a_docker_whose_daemon_does_not_answer_is_passed_over_with_the_reason(path):
    fake(path, "docker", """case "$1" in
  --version) echo "Docker version 28.2.2, build e6534b4";;
  version) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1;;
esac
""")
    facts = imagehost.facts("auto", "localhost/train:1")
    assert facts["runtime"] is None and facts["image"]["present"] is False
    assert facts["error"].startswith("no container runtime found on PATH (podman, docker, apptainer, singularity); docker at ")
    assert "Cannot connect to the Docker daemon" in facts["error"]
    fake(path, "apptainer", 'echo "apptainer version 1.2.5"\n')
    assert imagehost.facts("auto", "localhost/train:1")["runtime"] == "apptainer"
    named = imagehost.facts("docker", "localhost/train:1")  # named, it is used and its silence is the error
    assert named["runtime"] == "docker" and "its daemon does not answer" in named["error"]


def test_no_runtime_at_all_is_one_line(path):
    facts = imagehost.facts("auto", "localhost/train:1")
    assert facts["runtime"] is None and facts["path"] is None and facts["version"] is None
    assert facts["error"] == "no container runtime found on PATH (podman, docker, apptainer, singularity)"
    assert imagehost.facts("podman", "x")["error"].startswith("podman not found on PATH")
    assert "use auto, one of podman" in imagehost.facts("runc", "x")["error"]
    assert "no such executable" in imagehost.facts("/opt/nothing/podman", "x")["error"]


def test_a_runtime_named_by_its_path_is_known_by_its_name_or_by_its_answer(path, tmp_path):
    podman(tmp_path / "opt", "podman-4.9", images={"r": HEX}, version="podman version 4.9.3")
    facts = imagehost.facts(str(tmp_path / "opt" / "podman-4.9"), "r")
    assert (facts["runtime"], facts["version"], facts["image"]["present"]) == ("podman", "4.9.3", True)
    podman(tmp_path / "opt", "ctr-wrapper", images={"r": HEX}, version="podman version 5.0.0")
    assert imagehost.facts(str(tmp_path / "opt" / "ctr-wrapper"), "r")["runtime"] == "podman"
    fake(tmp_path / "opt", "mystery", 'echo "mystery 1.0"\n')
    assert "is none of podman" in imagehost.facts(str(tmp_path / "opt" / "mystery"), "r")["error"]


def test_an_absent_image_is_not_an_error_and_a_failing_runtime_is_its_last_line(path):
    podman(path, images={"localhost/train:1": HEX})
    facts = imagehost.facts("auto", "localhost/train:2")
    assert facts["image"] == {"ref": "localhost/train:2", "present": False, "id": None} and facts["error"] is None
    podman(path, fail="Error: database is locked " + "x" * 5000)
    facts = imagehost.facts("auto", "localhost/train:1")
    assert facts["image"]["present"] is False
    assert facts["error"].startswith(f"{path / 'podman'} image inspect failed (exit code 125): Error: database is locked")
    assert len(facts["error"]) < 500 and "\n" not in facts["error"]


def test_an_id_that_is_not_a_digest_is_not_believed(path):
    podman(path, images={"r": "latest"})
    facts = imagehost.facts("auto", "r")
    assert facts["image"]["present"] is False and "gave no image id" in facts["error"]


def test_a_hung_runtime_is_ended_by_its_timeout(path, monkeypatch):
    fake(path, "podman", "exec sleep 30\n")
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    monkeypatch.setattr(imagehost, "QUICK_TIMEOUT", 0.5)
    facts = imagehost.facts("podman", "r")
    assert facts["error"].endswith("--version: no answer (timed out)")


def test_rootless_is_podman_run_by_a_user_other_than_root(path, monkeypatch):
    podman(path, images={"r": HEX})
    monkeypatch.setattr(imagehost.os, "getuid", lambda: 1000)
    assert imagehost.facts("auto", "r")["rootless"] is True
    monkeypatch.setattr(imagehost.os, "getuid", lambda: 0)
    assert imagehost.facts("auto", "r")["rootless"] is False


def test_cdi_is_a_spec_naming_nvidia_gpus_and_gpus_is_what_nvidia_smi_lists(path, tmp_path):
    podman(path, images={"r": HEX})
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "other.yaml").write_text("cdiVersion: 0.5.0\nkind: example.com/fpga\n")
    assert imagehost.facts("auto", "r")["cdi"] is False
    (tmp_path / "cdi" / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n")
    assert imagehost.facts("auto", "r")["cdi"] is True
    fake(path, "nvidia-smi", 'echo "No devices were found"; exit 6\n')
    assert imagehost.facts("auto", "r")["gpus"] is False
    fake(path, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"\n')
    assert imagehost.facts("auto", "r")["gpus"] is True


def test_a_sif_is_known_by_its_sha256_hashed_once_while_the_file_is_unchanged(path, tmp_path, monkeypatch):
    import hashlib

    sif = tmp_path / "images" / "train.sif"
    sif.parent.mkdir()
    sif.write_bytes(b"sif" * 1000)
    fake(path, "apptainer", 'echo "apptainer version 1.2.5"\n')
    podman(path, images={})  # a .sif is a file: podman is not asked
    facts = imagehost.facts("auto", str(sif))
    assert facts["runtime"] == "apptainer" and facts["version"] == "1.2.5"
    assert facts["image"] == {"ref": str(sif), "present": True, "id": "sha256:" + hashlib.sha256(sif.read_bytes()).hexdigest()}

    def no_reading(path):
        raise AssertionError("hashed again")

    monkeypatch.setattr(imagehost, "sha256_file", no_reading)
    assert imagehost.facts("auto", str(sif))["image"]["id"] == facts["image"]["id"]  # from ~/.cache/mnft/sif-ids.json
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    sif.write_bytes(b"other" * 1000)
    assert imagehost.facts("auto", str(sif))["image"]["id"] == "sha256:" + hashlib.sha256(sif.read_bytes()).hexdigest()
    cache = json.loads((tmp_path / "home" / ".cache" / "mnft" / "sif-ids.json").read_text())
    assert len(cache) == 1, "the entry of the file's earlier content is gone"


def test_a_sif_in_the_home_a_missing_one_and_a_directory(path, tmp_path):
    fake(path, "singularity", 'echo "singularity-ce version 3.11.4"\n')
    home = tmp_path / "home"
    (home / "img").mkdir(parents=True)
    (home / "img" / "a.sif").write_bytes(b"x")
    facts = imagehost.facts("auto", "~/img/a.sif")
    assert (facts["runtime"], facts["version"], facts["image"]["present"]) == ("singularity", "3.11.4", True)
    assert imagehost.facts("auto", "~/img/b.sif")["image"] == {"ref": "~/img/b.sif", "present": False, "id": None}
    facts = imagehost.facts("auto", str(home / "img"))
    assert facts["image"]["present"] is False and facts["error"].endswith("img is not a file")
    bare = imagehost.facts("auto", str(home / "img" / "a.sif"))
    assert bare["image"]["present"] is True


def test_a_cache_past_its_cap_or_not_json_is_started_afresh(path, tmp_path, monkeypatch):
    cache = tmp_path / "home" / ".cache" / "mnft" / "sif-ids.json"
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert imagehost._load_cache() == {}
    cache.write_text(json.dumps({"k": "sha256:" + HEX}))
    assert imagehost._load_cache() == {"k": "sha256:" + HEX}
    monkeypatch.setattr(imagehost, "CACHE_BYTES", 8)
    assert imagehost._load_cache() == {}


def test_the_script_prints_one_json_line_and_refuses_a_wrong_call(path):
    podman(path, images={"r": HEX})
    env = dict(os.environ)
    done = as_host("facts", "auto", "r", env=env)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1
    assert json.loads(done.stdout)["image"]["id"] == "sha256:" + HEX
    wrong = as_host("facts", "auto", env=env)
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage: imagehost.py")


def as_host(*args: str, env: dict) -> subprocess.CompletedProcess:
    """imagehost as a host runs it: `python -S -c BOOTSTRAP ARGS`, its payload on stdin."""
    from mnft.hosts import pyrun

    done = subprocess.run([sys.executable, "-S", "-c", pyrun.BOOTSTRAP, *args], input=pyrun.payload("imagehost"), capture_output=True,
                          env=env, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def test_another_host_module_runs_the_facts_from_the_same_module():
    """check's probe computes them in its own round-trip: imagehost ships inside the probe's payload and is imported."""
    from mnft.hosts import payload

    assert "imagehost" in payload.closure("probe") and callable(imagehost.facts)


def test_gather_reads_each_host_through_pyrun(path, tmp_path, monkeypatch):
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import parse
    from mnft.image import facts

    podman(path, images={"localhost/train:1": HEX})
    fake(tmp_path / "other", "podman", 'echo "boom" >&2; exit 1\n')
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  h1:\n    connection: local\n  h2:\n    connection: local\n    address: 127.0.0.2\n"
                   f"    container_runtime: {tmp_path / 'other' / 'podman'}\n")
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    inventory = parse(inv.read_text(), inv)
    with Fleet(inventory) as fleet:
        outcomes, found = facts.gather(fleet, inventory.hosts, "localhost/train:1")
    assert all(r.ok for r in outcomes)
    assert found["h1"]["image"]["id"] == "sha256:" + HEX
    assert found["h2"]["runtime"] == "podman" and found["h2"]["version"] is None  # named, found, and failing: said so
    assert found["h2"]["error"].endswith("--version failed (exit code 1): boom") and found["h2"]["image"]["present"] is False


def test_container_runtime_is_validated_in_the_inventory(tmp_path):
    from mnft.core.errors import InputError
    from mnft.hosts.inventory import parse

    for good in ("podman", "apptainer", "/opt/podman/bin/podman"):
        assert parse(f"hosts:\n  h1:\n    container_runtime: {good}\n", None).hosts[0].container_runtime == good
    assert parse("hosts:\n  h1: {}\n", None).hosts[0].container_runtime is None
    for bad in ("runc", "podman run", "./podman", "/"):
        with pytest.raises(InputError, match="container_runtime"):
            parse(f"hosts:\n  h1:\n    container_runtime: {bad}\n", None)


# ------------------------------------------------------------------------------------------------ this machine's podman


def _podman_works() -> bool:
    if not shutil.which("podman"):
        return False
    try:
        return subprocess.run(["podman", "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_podman = pytest.mark.skipif(not _podman_works(), reason="podman is not installed here")


@pytest.fixture
def short_dirs():
    """Directories with short paths (podman refuses a runroot longer than 50 characters), removed afterwards."""
    import tempfile

    made = []

    def make() -> Path:
        made.append(Path(tempfile.mkdtemp(prefix="mnft-pt-", dir="/tmp")))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def own_podman(bin_dir: Path, root: Path) -> Path:
    """`podman` that uses a storage of the test's own (vfs, `root` a short path): the machine's images stay as they are."""
    real = shutil.which("podman")
    return fake(bin_dir, "podman", f'exec {real} --root {root}/root --runroot {root}/run --storage-driver vfs --runtime runc "$@"\n')


@needs_podman
def test_real_podman_an_image_saved_on_one_host_and_loaded_on_another_keeps_its_id(tmp_path, monkeypatch, short_dirs):
    from images import tiny_image

    a, b = tiny_image("a", tmp_path), tiny_image("b", tmp_path)
    own_podman(tmp_path / "h1", short_dirs())
    own_podman(tmp_path / "h2", short_dirs())
    monkeypatch.setenv("PATH", f"{tmp_path / 'h1'}:/usr/bin:/bin")
    done = subprocess.run(["podman", "load", "-i", str(a.archive)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = imagehost.facts("auto", a.ref)
    assert (facts["runtime"], facts["error"]) == ("podman", None)
    assert facts["image"] == {"ref": a.ref, "present": True, "id": "sha256:" + a.id}
    stage = tmp_path / "mnft-image-0123"
    stage.mkdir()
    saved = imagehost.save("auto", a.ref, str(stage))  # a docker-archive: an oci-archive would change this image's id
    assert saved["ok"] and saved["bytes"] > 0

    monkeypatch.setenv("PATH", f"{tmp_path / 'h2'}:/usr/bin:/bin")
    assert imagehost.facts("auto", a.ref)["image"]["present"] is False
    loaded = imagehost.load("auto", a.ref, str(stage), "sha256:" + a.id)
    assert loaded["ok"] and loaded["id"] == "sha256:" + a.id and not stage.exists()
    assert imagehost.facts("auto", a.ref)["image"]["id"] == "sha256:" + a.id

    # an archive that is another image than the one wanted: refused, and what it brought is removed
    stage.mkdir()
    shutil.copy(b.archive, stage / imagehost.ARCHIVE)
    with pytest.raises(imagehost.Failure, match=f"the loaded image is sha256:{b.id}, not sha256:{a.id}: removed"):
        imagehost.load("auto", "localhost/mnft-tiny:b", str(stage), "sha256:" + a.id)
    assert not stage.exists()
    assert imagehost.facts("auto", "localhost/mnft-tiny:b")["image"]["present"] is False
    assert imagehost.facts("auto", a.ref)["image"]["id"] == "sha256:" + a.id


# ------------------------------------------------------------------------------------------------ staging, a .sif placed


def test_prepare_makes_a_fresh_staging_directory_and_sees_the_others_of_its_sync_beside_it(tmp_path):
    shared = tmp_path / "img"
    first = imagehost.prepare(str(shared / ".mnft-image-0a1b-h2"))
    assert first["ok"] and first["seen"] == [] and (shared / ".mnft-image-0a1b-h2").stat().st_mode & 0o777 == 0o700
    (shared / ".mnft-image-ffff-h9").mkdir()  # another sync's: not this one's
    second = imagehost.prepare(str(shared / ".mnft-image-0a1b-h3"))
    assert second["seen"] == ["h2"], "h3 sees h2's directory: they share it"
    with pytest.raises(FileExistsError):
        imagehost.prepare(str(shared / ".mnft-image-0a1b-h3"))  # never one that exists
    with pytest.raises(imagehost.Failure, match="not a staging directory"):
        imagehost.prepare(str(tmp_path / "elsewhere"))
    assert imagehost.clean([str(shared / ".mnft-image-0a1b-h2"), str(shared / ".mnft-image-0a1b-h3")])["ok"]
    assert sorted(os.listdir(shared)) == [".mnft-image-ffff-h9"]
    with pytest.raises(imagehost.Failure):
        imagehost.clean([str(tmp_path)])  # only mnft's staging directories are removed


def test_a_sif_is_staged_by_a_link_and_placed_only_when_its_sha256_is_the_one_wanted(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = tmp_path / "src" / "train.sif"
    source.parent.mkdir()
    source.write_bytes(b"sif image" * 100)
    want = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
    stage = tmp_path / "src" / ".mnft-image-0a1b-h1"
    stage.mkdir()
    saved = imagehost.save("auto", str(source), str(stage))
    assert saved["ok"] and os.path.samefile(saved["file"], source)  # a hard link: no copy of 10 GB

    target = tmp_path / "dst" / "train.sif"
    arrived = tmp_path / "dst" / ".mnft-image-0a1b-h2"
    arrived.mkdir(parents=True)
    shutil.copy(source, arrived / imagehost.SIF_FILE)
    placed = imagehost.place(str(target), str(arrived), want)
    assert placed == {"ok": True, "id": want, "error": None} and target.read_bytes() == source.read_bytes() and not arrived.exists()
    assert imagehost.sif_image(str(target))[1] == want

    arrived.mkdir()
    (arrived / imagehost.SIF_FILE).write_bytes(b"tampered")
    with pytest.raises(imagehost.Failure, match=f"the file received is sha256:[0-9a-f]{{64}}, not {want}: removed"):
        imagehost.place(str(target), str(arrived), want)
    assert not arrived.exists() and target.read_bytes() == source.read_bytes()
