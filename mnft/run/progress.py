"""What a person sees while a run goes: one progress line per metric record (step, loss, rate, the straggler
when one is named), the ranks' output lines, and a quiet tick when nothing else is said for a while."""

from __future__ import annotations

import time

from rich.console import Console
from rich.text import Text

from mnft.core.output import clip_end, fmt_loss


def progress_text(data: dict, elapsed: float | None = None) -> str:
    """One line of a step record: what the job's metrics say (the step when the format gives it)."""
    parts = []
    if data.get("step") is not None:  # "~": read from the job's progress bar, its records carry no step
        total = f"/{data['max_steps']}" if data.get("step_about") and data.get("max_steps") else ""
        parts.append(f"step {'~' if data.get('step_about') else ''}{data['step']}{total}")
    parts.append(f"loss {fmt_loss(data.get('loss'))}")
    if isinstance(data.get("tokens_per_s"), (int, float)):
        parts.append(f"{data['tokens_per_s']:.0f} tokens/s")
    for key, fmt in (("lr", "{:.3g}"), ("grad_norm", "{:.3g}"), ("epoch", "{:.2f}")):
        if isinstance(data.get(key), (int, float)):
            parts.append(f"{key} " + fmt.format(data[key]))
    if "skipped_steps" in data:
        parts.append(f"skipped {data.get('skipped_steps', 0)}")
    if elapsed is not None:
        parts.append(f"{elapsed:.0f}s")
    return "  ".join(parts)


class Display:
    """Live output: each line prefixed with host and rank; rank 0's metrics as a progress line.

    On a terminal the progress line is a rich status line updated in place. Without one (CI, nohup, a pipe) a
    plain `progress: …` line is printed for the first step, then every `every_steps` steps or `every_s` seconds,
    whichever comes first, and for the last step. A job whose metrics are not found shows the time it has run
    and its last line instead.
    """

    status = None  # a rich Status line, on a terminal

    def __init__(self, console: Console, width: int, every_steps: int = 50, every_s: float = 30.0, clock=time.monotonic,
                 on_stragglers=lambda found: None) -> None:
        self.console = console
        self.on_stragglers = on_stragglers  # the named stragglers changed (mnft.run.train.Live)
        self.attempt = ""  # "attempt 2/4" after an automatic restart, shown with the progress
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.width = width
        self.last_metric: dict = {}
        self.last_text = ""
        self.every_steps, self.every_s, self.clock = every_steps, every_s, clock
        self.started = clock()
        self._printed_at: float | None = None
        self._printed_step: int | None = None
        self._ticked_at: float | None = None  # the last line printed without metrics
        self._count = 0
        self.bar: tuple[int, int | None] | None = None  # HF's bar: (step, total)
        self.summary: dict | None = None  # the job's summary record, shown by `end`
        self.step_times: list[tuple[float, int | None]] = []  # (wall time a step record arrived, its step), for goodput
        from mnft.run.straggler import Watch

        self.watch = Watch()
        self._named: set[str] = set()

    def line(self, host: str, rank: int | None, text: str) -> None:
        label = f"{host} r{rank}" if rank is not None else f"{host}"
        self.console.print(Text.assemble((f"{label:<{self.width}}| ", "dim"), text), highlight=False, soft_wrap=True)
        if text.strip():
            self.last_text = clip_end(text, 120)
            if not self.last_metric and self.status is not None:
                self.status.update(f"running {self.clock() - self.started:.0f}s, no metrics yet: {self.last_text}")

    def metric(self, data: dict) -> None:
        if data.get("event") == "progress":  # HF's training bar: the step its step-less records are at, about
            self.bar = (data["step"], data.get("total"))
            return
        if data.get("event") == "summary":  # shown when the attempt ends (`end`), after the lines the job printed before it
            if data.get("final_loss") is not None:
                self.summary = data
            return
        if "loss" not in data:
            return
        if data.get("step") is None and self.bar is not None:
            data = dict(data, step=self.bar[0], step_about=True, max_steps=data.get("max_steps") or self.bar[1])
        self.last_metric = data
        self._count += 1
        step = data.get("step") if isinstance(data.get("step"), int) else self._count
        self.step_times.append((time.time(), step if data.get("step") is not None else None))
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if self.status is not None:
            self.status.update(self._prefix() + progress_text(data) + self._straggler_suffix())
        elif not self.console.is_terminal:
            now, step = self.clock(), int(data["step"]) if data.get("step") is not None else self._count
            due = (
                self._printed_at is None
                or step - (self._printed_step or 0) >= self.every_steps
                or now - self._printed_at >= self.every_s
                or (data.get("max_steps") is not None and step >= data["max_steps"])
            )
            if due:
                self._printed_at, self._printed_step = now, step
                self.console.print("progress: " + self._prefix() + progress_text(data), highlight=False, soft_wrap=True)

    def end(self) -> None:
        """The attempt ended: the job's summary, if it wrote one. Not printed as it arrives: a job's metrics file (the
        recipes' summary) is followed apart from its output, so the summary came before the last lines the job had
        printed before writing it (`checkpoint step-200 complete`)."""
        data, self.summary = self.summary, None
        if data is not None:
            rate = f", {data['tokens_per_s']:.0f} tokens/s" if isinstance(data.get("tokens_per_s"), (int, float)) else ""
            self.console.print(Text.assemble(("summary", "bold"), f": loss {fmt_loss(data.get('initial_loss'))} -> "
                                             f"{fmt_loss(data.get('final_loss'))}{rate} over {data.get('steps')} steps"))

    def _prefix(self) -> str:
        return f"{self.attempt}  " if self.attempt else ""

    def _straggler_suffix(self) -> str:
        from mnft.run.straggler import text

        return ("  | " + text(self.watch.current)) if self.watch.current else ""

    def sample(self, host: str, sample: dict) -> None:
        """A host's utilisation and its ranks' recent timings: name a straggler when it appears and when it is gone."""
        self.watch.update(host, sample)
        named = {s.host for s in self.watch.current}
        for found in self.watch.current:
            if found.host not in self._named:
                self.console.print(Text(f"straggler {found.host}: {found.why}", style="bold yellow"), highlight=False, soft_wrap=True)
        for host_name in self._named - named:
            self.console.print(f"straggler {host_name}: back within the others' pace", highlight=False, soft_wrap=True)
        if named != self._named:
            self.on_stragglers(self.watch.current)
        self._named = named
        if self.status is not None and self.last_metric:
            self.status.update(self._prefix() + progress_text(self.last_metric) + self._straggler_suffix())

    def tick(self) -> None:
        """Without metrics and without a terminal: the run's time and last line every `every_s` seconds."""
        if self.last_metric or self.console.is_terminal:
            return
        now = self.clock()
        if self._ticked_at is None:
            self._ticked_at = now
        elif now - self._ticked_at >= self.every_s:
            self._ticked_at = now
            self.console.print(f"progress: {self._prefix()}running {now - self.started:.0f}s, no metrics found; last line: {self.last_text}",
                               highlight=False, soft_wrap=True)
