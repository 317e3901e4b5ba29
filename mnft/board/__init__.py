"""`mnft board`: the lab and its runs at a glance, in a browser. Read-only, served by the controller on 127.0.0.1.

It shows what `mnft lab`, `status` and `logs` know, from the same functions (one source of truth): the lab's
devices as tiles, free / held / in use outside mnft, with the line; every run of this controller's runs/ and
every other controller's run the lab shows; a run's page with its loss curve, where its time went, each host's
state and last lines, and its first failure named with its fix. It stands above run and hosts (beside perf and
slurm), and nothing imports it but the command line.

    app      the ASGI app (Starlette, served by uvicorn): its routes, the event stream, who may read it (the Host,
             Origin and Sec-Fetch-Site a request carries; GET only) and the security headers (a strict CSP)
    state    what every open page sees: one poller thread asks the hosts (the lab, the hosts of the runs going on)
             and keeps each answer as versioned JSON
    runs     a run's row and page from what mnft records of it (run.json, live.json, live-metrics.jsonl,
             metrics.jsonl, summary.json, collected output) and its hosts' answer; a sweep's row and page from its
             record and its points' (mnft.run.sweep's table and best point); the other controllers' runs from the lab
    static/  index.html, board.js (builds the page with createElement and textContent only), board.css, and uPlot
             1.6.32 (uPlot.iife.min.js, uPlot.min.css, MIT: uPlot.LICENSE), vendored as files: no build step, no CDN
"""
