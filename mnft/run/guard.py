"""What one `invoke train` holds, and leaves right however it ends: the hosts' leases and the record's end.

* The leases (mnft.hosts.leases): the run's devices (--gpus G of them, or every one) and its workdir, taken on
  every host of the inventory (spares too) once the run is recorded and before anything is checked, synced or
  started; devices another run holds, a workdir in use, a host under setup or provision, or a lease file mnft will
  not use refuse the run (`refused`, exit 1, the hosts untouched), unless it waits in line (--wait). They are held
  on a connection of their own for the whole run (through every attempt) and let go at its end; a run's keepers
  hold their host's leases on until the run ends there (a detached run's too).
* An interrupt (Ctrl-C or SIGTERM, mnft.core.interrupts) in any phase (check, sync, launch, supervision, the wait
  before a restart) ends with run.json `interrupted` and the reason, after the phase's own unwinding tore the gang
  down and ended mnft's children; a run that was started on the hosts is told how to continue (as a stopped one).
* Being told (mnft.run.notify, `--notify CMD`): when the run got its devices after waiting in line, and once it
  has ended, whatever the end, after its record is final and its leases are let go (a detached run's end is not
  this process's to see: `mnft wait RUN --notify CMD` tells it).
"""

from __future__ import annotations

import time
from typing import Callable

from mnft.core import interrupts
from mnft.hosts import leases
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Inventory
from mnft.run import notify as notifying
from mnft.run import records


STARTED = ("starting", "running")  # an interrupted run in these states was started on the hosts: it can be continued


class Guard:
    def __init__(self, notify: notifying.Notify | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.notify = notify
        self.warn = warn or (lambda text: None)
        self.record: records.RunRecord | None = None
        self.leases: leases.Leases | None = None
        self.fleet: Fleet | None = None
        self.code = None  # the run's code, fixed in this machine's snapshot store (mnft.sync.snapshot.Fixed), held to the end

    def __enter__(self) -> "Guard":
        return self

    def hold(self, record: records.RunRecord | None, inventory: Inventory, run_id: str, scope: leases.Scope | None = None,
             on_wait: Callable[[str, dict], None] | None = None, image: str | None = None) -> None:
        """The run is `record` (None: a dry run, which takes no lease); take on every host its devices (scope.gpus
        of them, or every one) and its workdir, waiting in line when asked to, or refuse."""
        self.record = record
        if record is None:
            return
        self.fleet = Fleet(inventory)
        waited: list[float] = []

        def in_line(host: str, reply: dict) -> None:
            waited.append(time.time())
            if on_wait is not None:
                on_wait(host, reply)

        self.leases = leases.Leases("train", run_id, scope or leases.Scope(), on_wait=in_line, image=image, supervised=bool(record.data.get("supervisor")))
        if scope is not None and scope.wait is not None:
            record.update(state="waiting")
        t_asked = time.time()
        try:
            self.leases.take(self.fleet, inventory.hosts)
        except leases.HostBusy as exc:
            record.update(state="refused", reason=str(exc))
            raise
        record.update(state="checking", devices={host: [d.get("index") for d in found] for host, found in self.leases.devices.items()},
                      leases={host: paths for host, paths in self.leases.paths.items()})
        if waited:  # it waited in line: told that it starts now
            record.update(waited_s=round(time.time() - t_asked, 1))
            notifying.tell(self.notify, "started", record, self.warn)

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is not None and issubclass(kind, KeyboardInterrupt) and self.record is not None:
                how, during = interrupts.describe(), self.record.data.get("state")
                phase = f" while {during}" if during in ("checking", "syncing", "starting", "running") else ""
                asked = records.stop_requested(self.record)  # `mnft stop` of a supervised run: its supervisor got SIGINT
                if asked is not None:
                    self.record.update(state="stopped", reason=f"stopped by `mnft stop` ({asked.get('by')}){phase}")
                else:
                    self.record.update(state="interrupted", reason=f"interrupted ({how}){phase}", interrupted={"signal": how, "during": during, "at": time.time()})
                if during in STARTED:  # it ran on the hosts: how to continue it, as a stopped run is told
                    from mnft.run.control import job_of
                    from mnft.run.rerun import resume_hint

                    self.warn(f"run {self.record.run_id} interrupted; {resume_hint(self.record.run_id, job_of(self.record.data))}")
        finally:
            try:
                if self.leases is not None:
                    self.leases.release()
                if self.fleet is not None:
                    self.fleet.close()
            finally:
                self._told_end(exc)

    def _told_end(self, exc: BaseException | None) -> None:
        """The notify command for the run's end: after the record's final state is written and the leases are let go."""
        record = self.record
        if self.notify is None or record is None:
            return
        if record.data.get("detach") and record.data.get("state") == "running":
            self.warn(f"note: run {record.run_id} is detached: its end is told by `mnft wait {record.run_id} --notify CMD`")
            return
        data = None
        if record.data.get("state") in notifying.GOING:  # an error before the run reached an end of its own: told as failed
            data = dict(record.data, reason=record.data.get("reason") or (str(exc) if exc is not None else None))
        notifying.tell(self.notify, "ended", record, self.warn, data)
