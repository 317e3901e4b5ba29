"""What a person reads from `check --perf`: a row per host, the all_reduce sweep, the problems with a fix; the
link matrix as a heatmap PNG (matplotlib); the same data as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from mnft.core.output import console, plain
from mnft.perf.gather import PerfReport

VERDICT_STYLE = {"ok": "green", "slow": "bold red", "failed": "red", "skipped": "magenta"}


def _gbps(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def print_perf(perf: PerfReport, out=None) -> None:
    out = out or console()
    ev = perf.evaluation
    m = perf.links
    title = f"perf: {len(perf.hosts)} host{'' if len(perf.hosts) == 1 else 's'}"
    if ev and ev.link_median_gbps is not None:
        title += f", median link {ev.link_median_gbps:.3g} Gbit/s"
    if ev and ev.compute_median_tflops is not None:
        title += f", median compute {ev.compute_median_tflops:.3g} TFLOP/s"
    table = Table(title=plain(title))
    for col in ("host", "iface", "slowest link", "Gbit/s", "worst RTT ms", "compute TFLOP/s", "device", "verdict"):
        table.add_column(col)
    for name in perf.hosts:
        row = ev.rows[name]
        slowest = f"{row.slowest[0]}→{row.slowest[1]}" if row.slowest else "-"
        table.add_row(plain(name), plain(row.iface), plain(slowest), _gbps(row.slowest[2] if row.slowest else None),
                      "-" if row.worst_rtt_ms is None else f"{row.worst_rtt_ms:.3f}",
                      "-" if row.tflops is None else f"{row.tflops:.3g}", plain(row.device),
                      Text(row.verdict, style=VERDICT_STYLE.get(row.verdict, "")))
    out.print(table)
    sweep = perf.allreduce()
    if sweep:
        c = perf.collectives.figures or {}
        t = Table(title=plain(f"all_reduce ({c.get('backend')}, {c.get('world_size')} ranks; nccl-tests' definitions, GB/s)"))
        for col in ("size", "iters", "time us", "algbw GB/s", "busbw GB/s"):
            t.add_column(col, justify="right")
        for r in sweep:
            t.add_row(_size(r["bytes"]), str(r["iters"]), f"{r['time_us']:.0f}", f"{r['algbw_gbps']:.3g}", f"{r['busbw_gbps']:.3g}")
        out.print(t)
        dropped = perf.collectives.dropped()
        if dropped:
            out.print(plain(f"all_reduce sizes not measured (the sweep's {perf.collectives.budget:g}s were spent): "
                            f"{', '.join(_size(n) for n in dropped)}", style="dim"))
    elif perf.skipped_collectives:
        out.print(plain(f"collectives not measured: {perf.skipped_collectives}", style="yellow"))
    if m is not None:
        out.print(plain(f"links: {len(m.rounds)} rounds of disjoint pairs, {m.seconds:g}s per direction, {m.elapsed:.1f}s; "
                        f"whole perf check {perf.elapsed:.1f}s", style="dim"))
    for kind, path in perf.artifacts.items():
        out.print(plain(f"{kind}: {path}", style="dim"))
    if not perf.problems:
        out.print(Text("no host is slower than the others", style="green"))
        return
    for p in perf.problems:
        style = "yellow" if p.severity == "warning" else "red"
        out.print(Text.assemble((f"{p.host}: {p.field}", style), f": {p.message}\n    fix: {p.fix}"))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def write_outputs(perf: PerfReport, directory: Path) -> None:
    """perf.json and, with two hosts or more, links.png (the heatmap) under `directory`; paths in perf.artifacts."""
    directory.mkdir(parents=True, exist_ok=True)
    if perf.links is not None and len(perf.links.hosts) > 1:
        path = directory / "links.png"
        heatmap(perf, path)
        perf.artifacts["heatmap"] = str(path)
    path = directory / "perf.json"
    perf.artifacts["json"] = str(path)
    path.write_text(json.dumps(perf.to_json(), indent=2, default=str) + "\n")


def import_plotting() -> None:
    """Import matplotlib (a second or more of CPU) while the ranks start, rather than after the measurements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def heatmap(perf: PerfReport, path: Path) -> None:
    """Sender rows × receiver columns, colour = Gbit/s (a failed link is grey, the diagonal blank), each cell
    annotated; the hosts the evaluation blames are marked red on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    m = perf.links
    names = m.hosts
    n = len(names)
    grid = np.full((n, n), np.nan)
    for i, s in enumerate(names):
        for j, d in enumerate(names):
            value = m.gbps(s, d)
            if value is not None:
                grid[i, j] = value
    blamed = {p.host for p in perf.problems if p.field == "link" and p.severity == "error"}
    size = max(4.0, 0.55 * n + 2.5)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=np.nanmax(grid) if np.isfinite(grid).any() else 1)
    fig.colorbar(image, ax=ax, label="Gbit/s (counted by the receiver)")
    ax.set_xticks(range(n), names, rotation=90 if n > 8 else 0)
    ax.set_yticks(range(n), names)
    for label in (*ax.get_xticklabels(), *ax.get_yticklabels()):
        if label.get_text() in blamed:
            label.set_color("red")
            label.set_fontweight("bold")
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    if n <= 16:
        top = np.nanmax(grid) if np.isfinite(grid).any() else 1
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                value = grid[i, j]
                text = "fail" if np.isnan(value) else f"{value:.2g}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if np.isnan(value) or value < 0.6 * top else "black")
    ev = perf.evaluation
    median = f", median {ev.link_median_gbps:.3g} Gbit/s" if ev and ev.link_median_gbps is not None else ""
    ax.set_title(f"link matrix: TCP throughput{median}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_perf(fleet, report, as_json: bool, out_dir: Path | None = None, options=None) -> int:
    """`invoke check --perf`: measure, write perf.json and links.png, print the check and the perf report.
    Exit code: the check's (4 unreachable wins), else 1 when a perf rule failed."""
    import sys
    import time

    from mnft.check.report import print_check
    from mnft.core.errors import ExitCode
    from mnft.core.output import print_json
    from mnft.perf.gather import PerfOptions, default_output_dir, measure

    err = console(stderr=True)
    start = time.monotonic()

    def progress(message: str) -> None:
        if not as_json or sys.stderr.isatty():
            err.print(plain(f"[{time.monotonic() - start:5.1f}s] {message}", style="dim"))

    perf = measure(fleet, report, options or PerfOptions(), progress, side_work=import_plotting)
    write_outputs(perf, out_dir or default_output_dir())
    code = report.exit_code()
    if code == ExitCode.OK and perf.failed():
        code = ExitCode.FAILED
    if as_json:
        data = report.to_json()
        data["perf"] = perf.to_json()
        data["exit_code"] = int(code)
        print_json(data)
    else:
        print_check(report, False)
        print_perf(perf)
    return code
