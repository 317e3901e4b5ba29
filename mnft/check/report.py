"""The check as a person reads it (a row per host, versions that differ in red, then each problem with its fix),
or as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mnft.check.findings import GIB, CheckReport, reference_host
from mnft.check.rules import PYTHON_SIDE, comparable, image_reference, python_reference, short_id
from mnft.core.output import STATUS_STYLE, console, plain, print_json, status_text
from mnft.hosts.fleet import Status

if TYPE_CHECKING:  # imported where the table is made: `check --json` never loads rich (a command's start, issue 30)
    from rich.text import Text


def _gpus(facts: dict) -> str:
    gpus = (facts.get("nvidia") or {}).get("gpus") or []
    if not gpus:
        return "0"
    names = {g.get("name") for g in gpus}
    return f"{len(gpus)}× {', '.join(sorted(n for n in names if n))}"


def _code(code: dict | None) -> Text:
    """The workdir's code hash (short) and whether it matches the local tree; '-' when there is no workdir."""
    from rich.text import Text

    if not code or not code.get("exists") or not code.get("hash"):
        return Text("-" if not code or not code.get("error") else "?", style="dim")
    same = code.get("matches")
    return Text(code["hash"][:10] + (" =" if same else " ≠"), style="green" if same else "bold red")


def _image(facts: dict, reference: str | None) -> Text:
    """The image's id on the host (short), red where it differs from the reference's; why not, where there is none."""
    from rich.text import Text

    container = facts.get("container")
    if not isinstance(container, dict):
        return Text("?", style="bold red")
    if not container.get("runtime"):
        return Text("no runtime", style="bold red")
    found = container.get("image") or {}
    if not found.get("present"):
        return Text("absent", style="bold red")
    differs = reference is not None and found.get("id") != reference
    return Text(short_id(found.get("id")), style="bold red" if differs else "")


def print_check(report: CheckReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
        return
    from rich.table import Table
    from rich.text import Text

    inv = report.inventory
    ref_name = reference_host(inv, report.facts)
    reference = comparable(report.facts[ref_name]) if ref_name is not None else {}
    image = next((((f.get("image_probe") or {}).get("image")) for f in report.facts.values() if "container" in f), None)
    py_name, image_id = ref_name, None
    if image:  # Python, torch, CUDA and NCCL are the image's: compared with the first host whose image answered
        py_name = python_reference(inv, report.facts, image)
        py_reference = comparable(report.facts[py_name]) if py_name is not None else {}
        reference = {k: (py_reference.get(k) if k in PYTHON_SIDE else v) for k, v in reference.items()}
        image_ref = image_reference(inv, report.facts)
        image_id = (((report.facts.get(image_ref) or {}).get("container") or {}).get("image") or {}).get("id") if image_ref else None
    title = f"check: {len(inv.hosts)} hosts, master {inv.master_name} ({report.master_addr or '?'}:{report.port or inv.rendezvous_port})"
    table = Table(title=plain(title + (f", image {image}" if image else "")))
    columns = ["rank", "host", "status", "python", "torch", "cuda", "nccl", "driver", "gpus/slots", "disk free", "iface", "reach master", "clock", "code"]
    if image:
        columns.insert(3, "image")
    for col in columns:
        table.add_column(col)
    for host in inv.hosts:
        status = report.status(host.name)
        facts = report.facts.get(host.name)
        if facts is None:
            outcome = report.outcomes[host.name]
            table.add_row(str(host.rank), plain(host.name), status_text(status), Text(outcome.error or "", style="dim"), *[""] * (len(columns) - 4))
            continue
        mine = comparable(facts)

        def cell(key: str) -> Text:
            value = mine[key]
            known = not image or key not in PYTHON_SIDE or (facts.get("image_probe") or {}).get("ok")
            differs = bool(reference) and known and host.name != (py_name if key in PYTHON_SIDE else ref_name) and value != reference.get(key)
            return Text(str(value) if value is not None else "-", style="bold red" if differs else "")

        disk = facts.get("disk") or {}
        free = disk.get("free_bytes")
        reach = report.reach.get(host.name)
        iface = host.iface or (reach.iface if reach else None) or "-"
        reach_text = Text("-") if reach is None else Text("yes" if reach.ok else "NO", style="green" if reach.ok else "bold red")
        skew = report.skew.get(host.name)
        row = [
            str(host.rank),
            plain(host.name + (" *" if host.name == inv.master_name else "")),
            status_text(status),
            cell("python"),
            cell("torch"),
            cell("cuda"),
            cell("nccl"),
            cell("driver"),
            plain(f"{_gpus(facts)}/{host.slots}"),
            f"{free / GIB:.1f} GiB" if isinstance(free, int) else "-",
            plain(iface),
            reach_text,
            f"{skew:+.2f}s" if skew is not None else "-",
            _code(report.code.get(host.name)),
        ]
        if image:
            row.insert(3, _image(facts, image_id))
        table.add_row(*row)
    out = console()
    out.print(table)
    if ref_name is not None and ref_name != inv.master_name:
        out.print(plain(f"versions compared with {ref_name}, the first host that answered (the master {inv.master_name} did not)", style="yellow"))
    if report.supervision is not None:  # never a problem: attached runs do not need it
        out.print(plain(report.supervision.get("line") or "", style="green" if report.supervision.get("ok") else "cyan"))
    problems = report.problems
    # a host reached whose probe failed has a problem of its own (rules.probe_failed: its fix)
    unreachable = [report.outcomes[h.name] for h in inv.hosts if report.outcomes[h.name].status is not Status.OK
                   and not (report.outcomes[h.name].status is Status.FAILED and any(p.host == h.name for p in problems))]
    if not problems and not unreachable:
        out.print(Text("every host can join the job", style="green"))
        return
    for outcome in unreachable:
        out.print(Text.assemble((f"{outcome.host}: {outcome.status.value}", STATUS_STYLE[outcome.status.value]), f": {outcome.error}"))
    for p in problems:
        style = {"warning": "yellow", "note": "cyan"}.get(p.severity, "red")
        said = f"\n    {'note' if p.severity == 'note' else 'fix'}: {p.fix}" if p.fix else ""  # a note that needs nothing done: no fix line
        out.print(Text.assemble((f"{p.host}: {p.field}", style), f": {p.message}{said}"))
