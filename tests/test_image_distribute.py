"""`sync --image`'s plan, with data: facts in, who is the source, who receives, who verifies a shared copy, who
refuses (mnft.image.distribute.plan); and the bad input that stops it before any host is asked."""

from __future__ import annotations

import pytest

from mnft.core.errors import InputError
from mnft.image.distribute import CONTROLLER, plan, stage_dir, with_sharing
from mnft.image.facts import check_image

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
C = "sha256:" + "c" * 64
REF = "localhost/train:1"
ORDER = ["h1", "h2", "h3", "h4"]


def facts(ident: str | None, error: str | None = None, runtime: str | None = "podman") -> dict:
    return {"runtime": runtime, "path": "/usr/bin/podman", "version": "4.3.1", "uid": 0, "gid": 0, "home": "/root",
            "rootless": False, "cdi": False, "gpus": False,
            "image": {"ref": REF, "present": ident is not None, "id": ident}, "error": error}


def actions(p) -> dict[str, str]:
    return {name: hp.action for name, hp in p.hosts.items()}


def test_the_controllers_copy_is_the_reference_and_every_host_lacking_it_receives_it():
    p = plan(REF, ORDER, {"h1": facts(A), "h2": facts(None), "h3": facts(None), "h4": facts(A)}, {}, facts(A))
    assert (p.reference, p.source, p.refusal) == (A, CONTROLLER, None)
    assert actions(p) == {"h1": "none", "h2": "receive", "h3": "receive", "h4": "none"}
    assert p.receivers == ["h2", "h3"]


def test_without_the_controller_the_first_host_in_inventory_order_holding_it_is_the_source():
    p = plan(REF, ORDER, {"h1": facts(None), "h2": facts(B), "h3": facts(B), "h4": facts(None)}, {}, facts(None))
    assert (p.reference, p.source) == (B, "h2")
    assert p.receivers == ["h1", "h4"]
    assert plan(REF, ORDER, {"h1": facts(None), "h2": facts(B), "h3": facts(B), "h4": facts(None)}, {}, None).source == "h2"


def test_nothing_to_do_when_every_host_holds_the_reference():
    p = plan(REF, ORDER, {n: facts(A) for n in ORDER}, {}, None)
    assert p.receivers == [] and p.refusal is None and set(actions(p).values()) == {"none"}


def test_a_host_holding_another_image_is_a_refusal_naming_it_and_the_reference():
    p = plan(REF, ORDER, {"h1": facts(A), "h2": facts(B), "h3": facts(None), "h4": facts(C)}, {}, None)
    assert p.refusal == (f"{REF}: h2 has sha256:bbbbbbbbbbbb, h4 has sha256:cccccccccccc, h1 has sha256:aaaaaaaaaaaa: "
                         "pass --force to replace theirs with the reference (or make the reference the image you want)")
    refused = plan(REF, ORDER, {"h1": facts(B), "h2": facts(None), "h3": facts(None), "h4": facts(None)}, {}, facts(A))
    assert refused.refusal.startswith(f"{REF}: h1 has sha256:bbbbbbbbbbbb, this machine has sha256:aaaaaaaaaaaa: pass --force")


def test_force_makes_the_hosts_holding_another_image_receive_the_reference():
    p = plan(REF, ORDER, {"h1": facts(A), "h2": facts(B), "h3": facts(None), "h4": facts(C)}, {}, None, force=True)
    assert p.refusal is None and p.receivers == ["h2", "h3", "h4"]
    assert p.hosts["h2"].reason == "replaces sha256:bbbbbbbbbbbb (--force)" and p.hosts["h2"].held == B


def test_no_copy_anywhere_is_bad_input_naming_where_it_looked():
    p = plan(REF, ORDER, {"h1": facts(None), "h2": facts(None, "podman not found on PATH (/usr/bin)", runtime=None)},
             {"h3": "unreachable", "h4": "host key rejected"}, facts(None))
    assert p.refusal == (f"{REF}: no host has it, nor this machine; looked on h1, h2 (podman not found on PATH (/usr/bin)); "
                         "not asked: h3, h4 (not reachable)")
    assert plan(REF, ["h1"], {"h1": facts(None)}, {}, None).refusal == f"{REF}: no host has it, nor this machine (it has no container runtime); looked on h1"


def test_hosts_not_read_are_skipped_with_why_and_a_host_without_a_runtime_cannot_receive():
    p = plan(REF, ORDER, {"h1": facts(A), "h2": facts(None, "no container runtime found on PATH (podman, docker, apptainer, singularity)", None)},
             {"h3": "unreachable: connection refused", "h4": "the image facts script printed no JSON: boom"}, None)
    assert actions(p) == {"h1": "none", "h2": "skip", "h3": "skip", "h4": "skip"}
    assert p.hosts["h2"].reason.startswith("no container runtime found") and p.hosts["h3"].reason == "unreachable: connection refused"
    assert p.receivers == []


def test_a_sif_reaches_hosts_without_a_runtime_and_hosts_sharing_its_directory_get_one_copy():
    sif = "~/images/train.sif"
    no_runtime = "no container runtime found on PATH (apptainer, singularity)"
    f = {"h1": facts(A, no_runtime, None), "h2": facts(None, no_runtime, None), "h3": facts(None), "h4": facts(None)}
    p = plan(sif, ORDER, f, {}, None, shared={"h2": ("h2", "h4"), "h4": ("h2", "h4")})
    assert p.sif and (p.source, p.reference) == ("h1", A)
    assert actions(p) == {"h1": "none", "h2": "receive", "h3": "receive", "h4": "verify"}
    assert p.hosts["h4"].via == "h2" and p.receivers == ["h2", "h3"] and p.verifiers == ["h4"]
    # sharing found later (the staging directories seen beside the file) applies the same way
    assert actions(with_sharing(plan(sif, ORDER, f, {}, None), {"h3": ("h2", "h3", "h4")}))["h3"] == "verify"


def test_a_sif_path_that_is_a_directory_on_a_host_is_refused():
    f = {"h1": facts(A), "h2": facts(None, "/root/images/train.sif is not a file")}
    p = plan("/root/images/train.sif", ["h1", "h2"], f, {}, None)
    assert p.refusal == "/root/images/train.sif: h2: /root/images/train.sif is not a file: a .sif image is a file"


def test_the_staging_directory_is_beside_a_sif_and_in_var_tmp_for_an_image():
    assert stage_dir(REF, "/home/ann", "0a1b", "h2") == "/var/tmp/mnft-image-0a1b-h2"
    assert stage_dir("~/img/t.sif", "/home/ann", "0a1b", "h2") == "/home/ann/img/.mnft-image-0a1b-h2"
    assert stage_dir("/data/t.sif", "/home/ann", "0a1b", "h2") == "/data/.mnft-image-0a1b-h2"


@pytest.mark.parametrize("bad", ["", "   ", "-rf", "--privileged", "a b", "a\nb", "ref\t1", "x" * 5000])
def test_bad_image_references_are_one_line_of_bad_input(bad):
    with pytest.raises(InputError) as caught:
        check_image(bad)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("--image")


@pytest.mark.parametrize("good", ["localhost/train:1", "nvcr.io/nvidia/pytorch:24.05-py3", "train@sha256:" + "a" * 64, "~/img/t.sif", "/d/t.sif",
                                  "$(id)", "a;rm"])
def test_references_pass_as_they_are_and_are_quoted_on_every_command_line(good):
    from mnft.hosts.inventory import parse
    from mnft.image.facts import script_command

    assert check_image(good) == good
    host = parse("hosts:\n  h1: {}\n", None).hosts[0]
    rendered = script_command(host, "facts", "auto", good).render()
    import shlex

    home = good.startswith("~/")  # the host's shell makes ~/ its user's home ("$HOME"/…), as for every path of mnft's
    assert shlex.split(rendered)[-1] == ("$HOME" + good[1:] if home else good)  # one word, whatever it holds


def test_sync_image_refuses_bad_input_before_any_host_is_asked(tmp_path, monkeypatch):
    from mnft.hosts.inventory import parse
    from mnft.image import distribute

    def asked(*args, **kwargs):
        raise AssertionError("a host was asked")

    monkeypatch.setattr(distribute, "gather", asked)
    monkeypatch.setattr(distribute, "controller_facts", asked)
    inventory = parse("hosts:\n  h1:\n    connection: local\n", None)
    (tmp_path / "dir.sif").mkdir()
    for bad, said in [("", "--image: give"), ("-x", "must not start with '-'"), ("a b", "white space"),
                      (str(tmp_path / "dir.sif"), "not a file"), ("images/t.sif", "absolute, or ~/")]:
        with pytest.raises(InputError, match=said):
            distribute.sync_image(inventory, bad)


# ------------------------------------------------------------------------------------------------ on this machine
# Local hosts (connection: local), each with a podman storage of its own (a wrapper named as its container_runtime)
# or a home of its own (a wrapper as its python): sync --image end to end, without the test bed.

import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402


def _podman_works() -> bool:
    try:
        return bool(shutil.which("podman")) and subprocess.run(["podman", "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_podman = pytest.mark.skipif(not _podman_works(), reason="podman is not installed here")


@pytest.fixture
def short_dirs():
    import tempfile

    made = []

    def make() -> Path:
        made.append(Path(tempfile.mkdtemp(prefix="mnft-pt-", dir="/tmp")))  # podman: a runroot of at most 50 characters
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _stages() -> set[str]:
    return {p for p in os.listdir("/var/tmp") if p.startswith("mnft-image-")}


@needs_podman
def test_on_this_machine_a_host_lacking_the_image_gets_it_and_one_holding_another_is_refused_then_replaced(tmp_path, short_dirs):
    from images import tiny_image

    from mnft.hosts.inventory import parse
    from mnft.image.distribute import sync_image

    tag = f"d{os.getpid()}"  # this machine's own storage (the controller's) has no image of this name
    wanted, other = tiny_image(tag, tmp_path), tiny_image(tag + "x", tmp_path)
    runtimes = {}
    for name in ("h1", "h2", "h3"):
        root = short_dirs()
        runtimes[name] = _script(tmp_path / name / "podman",
                                 f'exec {shutil.which("podman")} --root {root}/root --runroot {root}/run --storage-driver vfs --runtime runc "$@"\n')
    for name, image in (("h1", wanted), ("h3", other)):
        subprocess.run([runtimes[name], "load", "-i", str(image.archive)], capture_output=True, check=True, timeout=120)
    subprocess.run([runtimes["h3"], "tag", other.ref, wanted.ref], check=True, timeout=60)
    text = "hosts:\n" + "".join(f"  {n}:\n    connection: local\n    address: 127.0.0.{i + 1}\n    container_runtime: {runtimes[n]}\n"
                                for i, n in enumerate(runtimes))
    inventory = parse(text, None)
    before = _stages()

    with pytest.raises(InputError, match=f"h3 has sha256:{other.id[:12]}, h1 has sha256:{wanted.id[:12]}: pass --force"):
        sync_image(inventory, wanted.ref)
    held = subprocess.run([runtimes["h2"], "images", "-q"], capture_output=True, text=True, timeout=60).stdout
    assert held.strip() == "", "refused: nothing changed on any host"

    report = sync_image(inventory, wanted.ref, force=True)
    assert report.ok and (report.source, report.reference) == ("h1", "sha256:" + wanted.id)
    assert {n: h.status for n, h in report.hosts.items()} == {"h1": "ok", "h2": "changed", "h3": "changed"}
    assert all(h.id == "sha256:" + wanted.id for h in report.hosts.values())
    # no mesh: this machine fetched the archive from h1 once, and sent what the hosts' rows say (issue 36: the fetch
    # was counted as sent, the total twice a row's for one receiver)
    assert report.fetched_bytes == report.archive_bytes > 0
    assert report.controller_bytes == sum(h.controller_bytes for h in report.hosts.values()) > 0
    for name in ("h2", "h3"):
        ident = subprocess.run([runtimes[name], "image", "inspect", "--format", "{{.Id}}", wanted.ref], capture_output=True, text=True, timeout=60)
        assert ident.stdout.strip() == wanted.id
    assert _stages() == before, "no staging directory left behind"
    again = sync_image(inventory, wanted.ref)
    assert again.ok and {h.status for h in again.hosts.values()} == {"ok"}
