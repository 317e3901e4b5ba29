"""Reading an image's identity on every host: `mnft.onhost.imagehost`'s facts, one round-trip per host, in parallel.

    gather(fleet, hosts, image, runtime_of)  ->  (outcomes, {host name: facts})

A host that answered is in the facts (its "error", if any, says what it lacks: no runtime, the runtime failed);
one that did not (unreachable, its key rejected, no JSON) is only in the outcomes, as everywhere in mnft
(mnft.hosts.fleet's HostResult, mnft.hosts.pyrun.reply). check reads the same facts inside its own probe's
round-trip (imagehost's `facts` function run from the probe's source); `controller_facts` reads this machine's.
"""

from __future__ import annotations

import getpass
import sys
from typing import Callable, Sequence

from mnft.core.errors import InputError
from mnft.hosts import pyrun
from mnft.hosts.command import Command
from mnft.hosts.fleet import Fleet, HostResult, Results
from mnft.hosts.settings import Host, Inventory

CONTROLLER = "controller"  # this machine, where it is the source of an image
FACTS_TIMEOUT = 900.0  # a .sif not seen before is hashed whole (10 GB at ~1 GB/s), once


def runtime_setting(host: Host) -> str:
    """The runtime the inventory names for a host (`container_runtime:`), else "auto"."""
    return host.container_runtime or "auto"


def check_image(image: str) -> str:
    """An image reference or .sif path fit for a command line: bad input otherwise (one line, exit 2)."""
    if not isinstance(image, str) or not image.strip():
        raise InputError("--image: give an image reference (e.g. localhost/train:1) or a .sif path")
    if image.startswith("-"):
        raise InputError(f"--image {image[:80]!r}: must not start with '-'")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in image):
        raise InputError(f"--image {image[:80]!r}: must not hold white space or control characters")
    if len(image) > 4096:
        raise InputError(f"--image: {len(image)} characters is not an image reference")
    return image


def script_command(host: Host, *args: str) -> Command:
    return pyrun.command(host, *args, site=False)


def payload() -> bytes:
    return pyrun.payload("imagehost")


def gather(fleet: Fleet, hosts: Sequence[Host], image: str, runtime_of: Callable[[Host], str] = runtime_setting,
           timeout: float = FACTS_TIMEOUT) -> tuple[Results, dict[str, dict]]:
    """Each host's image facts (imagehost's contract), in parallel; the hosts that gave none only in the outcomes."""
    results = fleet.run(lambda h: script_command(h, "facts", runtime_of(h), image), stdin=payload(), hosts=list(hosts), timeout=timeout)
    facts = {}
    for result in results:
        data = pyrun.reply(result, "the image facts script")
        if data is not None:
            facts[result.host] = data
    return results, facts


def controller_facts(image: str, runtime: str = "auto", timeout: float = FACTS_TIMEOUT) -> tuple[HostResult, dict | None]:
    """This machine's facts for the image (its own runtime, run as a local host is: the same bounds on its reply)."""
    with Fleet(local_inventory()) as fleet:
        results, facts = gather(fleet, fleet.inventory.hosts, image, lambda _: runtime, timeout)
    return results[CONTROLLER], facts.get(CONTROLLER)


def local_inventory() -> Inventory:
    """This machine as the one host of an inventory (connection: local), for its own runs of imagehost."""
    return Inventory(None, "mnft", (Host(CONTROLLER, 0, "localhost", user=getpass.getuser(), python=sys.executable, connection="local"),), CONTROLLER)
