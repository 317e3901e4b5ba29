#!/usr/bin/env python3
"""`mnft board` (issue 28): the first paint of the page for a lab of 64 hosts and 200 runs. Results in docs/board.md.

The board is served as `mnft board` serves it (mnft.board.app over mnft.board.state.Board), from a thread of this
process, with its look at the hosts faked: 64 hosts' lab views (4 GPUs each, about half held by a few users'
runs, some in use outside mnft, a line on some hosts, one host not answering) made by tests/boardfakes.py, and
200 run records in a temporary runs directory (run.json with attempts and where the time went, summary.json,
metrics.jsonl), as `train` and `logs` leave them. Debian's chromium, driven by Playwright, opens the page in a
fresh browser context each time (no cache); measured per load, from the navigation's start:

  drawn   the board's own mark (performance.mark "board-drawn"): the lab's tiles and the runs' table are in the DOM,
          at the next frame after both arrived over the event stream — what "first paint" means for the board
  fcp     the browser's first-contentful-paint (the page's frame, before the data)
  dom     DOMContentLoaded: the page's HTML, CSS and scripts (uPlot included) loaded and run

    python bench/board.py [--hosts 64] [--runs 200] [--repeat 7] [--out /tmp/board.json] [--screenshot /tmp/board.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the fakes beside the tests

import boardfakes  # noqa: E402

CHROMIUM = "/usr/bin/chromium"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--screenshot", type=Path, help="save the page as the last load drew it")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="mnft-board-bench-") as tmp:
        work = Path(tmp)
        os.environ["MNFT_RUNS_DIR"] = str(work / "runs")
        names = [f"gpu-node-{i:02d}" for i in range(1, args.hosts + 1)]
        inventory = boardfakes.inventory(work / "lab.yaml", args.hosts, names)
        t = time.monotonic()
        boardfakes.write_runs(work / "runs", args.runs, names)
        made = time.monotonic() - t
        views = boardfakes.lab_views(names, args.gpus, down=(names[5],))
        from mnft.board.state import Board

        t = time.monotonic()
        board = Board(inventory, look=lambda: views)
        first_read = time.monotonic() - t
        loads = []
        with boardfakes.Served(board) as served, sync_playwright() as pw:
            deadline = time.monotonic() + 30
            while board.rounds < 1 and time.monotonic() < deadline:  # the lab's first answer is in
                time.sleep(0.05)
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                for _ in range(args.repeat + 1):  # the first load warms chromium itself up: not counted
                    context = browser.new_context(viewport={"width": args.width, "height": args.height})
                    page = context.new_page()
                    received = []
                    page.on("response", lambda r, got=received: got.append(r))
                    page.goto(served.url)
                    page.wait_for_selector("html[data-drawn]", timeout=30000)
                    figures = page.evaluate("""() => ({
                        drawn: performance.getEntriesByName('board-drawn')[0].startTime,
                        fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime,
                        dom: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd,
                        tiles: document.querySelectorAll('.tile').length,
                        rows: document.querySelectorAll('#runs-body tr').length,
                    })""")
                    loads.append(figures)
                    if args.screenshot:
                        page.screenshot(path=str(args.screenshot))
                    context.close()
            finally:
                browser.close()
        counted = loads[1:]
        result = {
            "hosts": args.hosts, "gpus_per_host": args.gpus, "runs": args.runs, "viewport": f"{args.width}x{args.height}",
            "tiles": counted[0]["tiles"], "run_rows": counted[0]["rows"],
            "drawn_ms_median": round(statistics.median(x["drawn"] for x in counted), 1),
            "drawn_ms_range": [round(min(x["drawn"] for x in counted), 1), round(max(x["drawn"] for x in counted), 1)],
            "fcp_ms_median": round(statistics.median(x["fcp"] for x in counted if x["fcp"] is not None), 1),
            "dom_content_loaded_ms_median": round(statistics.median(x["dom"] for x in counted), 1),
            "runs_first_read_s": round(first_read, 3), "records_written_s": round(made, 3), "repeat": len(counted),
            "lab_json_bytes": len(board.lab.text), "runs_json_bytes": len(board.runs.text),
        }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
