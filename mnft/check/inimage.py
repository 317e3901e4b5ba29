"""`check --image`: every host's facts, the image's identity there, and the probe run inside the image, in one
command per host; the facts merged so that the rules compare the Python, torch, CUDA and NCCL the job will see.

One SSH command per host (`probe.py image-facts` on the host's Python), its stdin and stdout a conversation:

    → the probe's payload (imagehost with it); {the host's runtime setting, the image}
    ← {the image's facts}: imagehost's, read in a thread of the probe while the probe reads the host's
    → {the probe's command line inside the image, the probe's source}       (only where the runtime has the image)
    ← {the host's facts}: without its Python's packages; its clock read last, for the skew, as without an image
    ← {the command's exit code and output}: the probe's `python` mode inside the image, started while the host's
       facts were still being read (the last two lines come in the order they are ready)

The command line inside is built here, from the facts the host has just sent, by mnft.image.runtime.probe_argv: the
same module train builds its containers with, so the check looks inside the image the way the run will start it.
A host without a runtime or without the image sends no command: the rules name what it lacks.
"""

from __future__ import annotations

import base64
import time
from typing import Sequence

from mnft.check.rules import probe_skew
from mnft.check.session import cut_short, no_reply, request_line, since, start
from mnft.core.errors import InputError
from mnft.hosts import pyrun
from mnft.hosts.connection import CommandTimeout, OutputTooLarge, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Results, Status
from mnft.hosts.settings import Host
from mnft.onhost import imagehost
from mnft.image.facts import FACTS_TIMEOUT, runtime_setting
from mnft.image.runtime import Runtime, probe_argv

IMAGE_PYTHON = "python3"  # the interpreter the probe (and the job's torchrun) runs in inside the image: on its PATH
PYTHON_KEYS = ("python", "torch", "nccl", "cudnn", "dists", "modules")  # the facts the image's Python gives
INSIDE_MARGIN = 5.0  # seconds of the command's timeout kept for the reply once the probe inside has ended
ERROR_CHARS = 300  # a reason quoted from a host, at most


def inside_command(host: Host, container: dict | None, image: str, modules: Sequence[str] = ()) -> list[str] | None:
    """The probe's command line inside the image on this host, from its image facts; None where it cannot run
    there (no runtime, the image absent, GPUs the runtime cannot give: the rules say which)."""
    if not isinstance(container, dict) or not container.get("runtime") or not (container.get("image") or {}).get("present"):
        return None
    try:
        rt = Runtime.from_facts(container)
        prefix = probe_argv(rt, rt.runs(image), [IMAGE_PYTHON])  # podman/docker: by the id just read, as train runs it
    except (InputError, KeyError, TypeError, ValueError):  # podman without CDI on a GPU host: the cdi rule
        return None
    wanted = ("--modules", ",".join(modules)) if modules else ()
    return list(pyrun.command(host, "python", *wanted, python=prefix).argv)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= ERROR_CHARS else last[:ERROR_CHARS] + "…"


def inside_reply(ran: dict | None) -> tuple[dict | None, str | None]:
    """The probe's facts from inside the image, or None and why not (one line: the runtime's or Python's last word)."""
    if ran is None:
        return None, None
    if not isinstance(ran, dict):
        return None, "the host's answer about the probe inside the image is not a JSON object"
    if ran.get("error"):
        return None, _one_line(str(ran["error"]))
    if ran.get("exit_code") != 0:
        said = _one_line(str(ran.get("stderr") or "")) or _one_line(str(ran.get("stdout") or ""))
        return None, said or f"exit code {ran.get('exit_code')}"
    try:
        data = pyrun.last_json(str(ran.get("stdout") or ""))
    except ValueError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("python"), dict):
        return None, "printed no JSON: " + (_one_line(str(ran.get("stdout") or "")) or "no output")
    return data, None


def _is_container_facts(c: object) -> bool:
    """imagehost's answer has the shape its contract says (the rules and train read it without asking again)."""
    if not isinstance(c, dict) or not isinstance(c.get("image"), dict):
        return False
    strings = (c.get("runtime"), c.get("path"), c.get("error"), c["image"].get("id"))
    return all(v is None or isinstance(v, str) for v in strings) and isinstance(c["image"].get("present"), bool)


def merge(host_facts: dict, container: dict | None, image: str, ran: dict | None = None,
          container_error: str | None = None) -> dict:
    """One host's facts as the rules read them with an image: the host's own (disk, NICs, GPUs, driver, clock), its
    Python as `host_python` (the agent's: the standard library is all it needs), the image's facts as `container`
    (imagehost's contract, read by train to build the container's command line), and Python, torch, NCCL,
    cuDNN, distributions and the job's modules as seen INSIDE the image (None where the probe did not run there).
    `image_probe` says whether it ran, and why not."""
    facts = dict(host_facts)
    facts["host_python"] = host_facts.get("python")
    facts["container"] = container if _is_container_facts(container) else None
    inner, error = inside_reply(ran)
    if facts["container"] is None and error is None:
        if container is not None and not container_error:
            container_error = "not the answer imagehost gives (its contract: mnft/onhost/imagehost.py)"
        error = _one_line(container_error or "") or "no answer"  # why the image's facts are missing
    facts["image_probe"] = {
        "image": image,
        "python": IMAGE_PYTHON,
        "ran": ran is not None,
        "ok": inner is not None,
        "error": error,
        "seconds": ran.get("seconds") if isinstance(ran, dict) else None,
    }
    for key in PYTHON_KEYS:
        facts[key] = (inner or {}).get(key)
    errors = dict(host_facts.get("errors") or {})
    errors.update({f"image.{k}": v for k, v in ((inner or {}).get("errors") or {}).items()})
    facts["errors"] = errors
    return facts


def gather_image_facts(fleet: Fleet, image: str, modules: Sequence[str] = (),
                       hosts: list[Host] | None = None) -> tuple[Results, dict[str, dict], dict[str, float]]:
    """gather_facts' counterpart with an image: outcomes, merged facts and each host's clock skew vs this machine."""
    head = pyrun.payload("probe")  # the bootstrap's input: on the host's Python, then on the image's
    shipped = base64.b64encode(head).decode()
    # a .sif not seen before is hashed whole, once (then its id is cached on the host): its facts may take longer
    timeout = max(fleet.timeouts.command, FACTS_TIMEOUT) if imagehost.is_path_image(image) else fleet.timeouts.command
    facts: dict[str, dict] = {}
    skew: dict[str, float] = {}

    def one(host: Host) -> HostResult:
        started = time.monotonic()
        begun = start(fleet, host, pyrun.command(host, "image-facts", "--workdir", host.workdir).render(), timeout, started)
        if isinstance(begun, HostResult):
            return begun
        process, before = begun
        deadline = time.monotonic() + timeout
        left = lambda: max(0.0, deadline - time.monotonic())
        got: dict = {}  # "container", "facts", "ran": each line as it comes, in the order the host has them ready
        asked, said, after = False, [], None
        finished = False
        try:
            process.write(head + request_line({"runtime": runtime_setting(host), "image": image}))
            while "facts" not in got or "container" not in got or (asked and "ran" not in got):
                line, said = process.json_reply(left())
                if line is None or not any(key in line for key in ("facts", "container", "ran")):
                    break  # the command ended, timed out, or the probe reported its own failure
                if "facts" in line:
                    got["facts"], after = line["facts"], time.time()
                if "container" in line:
                    got["container"], got["container_error"] = line["container"], line.get("container_error")
                    argv = inside_command(host, line["container"], image, modules)
                    if argv is not None:  # the look inside starts while the host's facts are still being read
                        process.write(request_line({"argv": argv, "payload": shipped, "timeout": max(1.0, left() - INSIDE_MARGIN)}))
                        asked = True
                if "ran" in line:
                    got["ran"] = line["ran"]
            if not isinstance(got.get("facts"), dict):
                return no_reply(host.name, process, line, said, left(), started)
            process.close_stdin()
            try:
                code = process.wait(timeout=min(5.0, max(1.0, left()))).exit_code
                finished = True
            except CommandTimeout:  # the host's facts are here: what did not answer is said below
                code = None
        except (CommandTimeout, OutputTooLarge, Unreachable) as exc:
            return cut_short(fleet, host, exc, timeout, started)
        finally:
            if not finished:
                process.terminate()
        why = "no answer from the host within {:g}s".format(timeout) if left() <= 0 else "no answer from the host: " + (said[-1] if said else "its command ended")
        ran = got.get("ran") if not asked or isinstance(got.get("ran"), dict) else {"exit_code": None, "error": why}
        merged = merge(got["facts"], got.get("container"), image, ran, got.get("container_error") or (None if "container" in got else why))
        facts[host.name] = merged
        if (seen := probe_skew(merged, before, after)) is not None:
            skew[host.name] = seen
        return HostResult(host.name, Status.OK, code, seconds=since(started))

    results = fleet.map(one, hosts)
    return results, {name: facts[name] for name in results.by_host if name in facts}, skew

