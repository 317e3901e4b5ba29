"""Training metrics from what a job already writes: its rank-0 output lines, a log file, trainer_state.json,
TensorBoard event files. Pure parsers (text in, records out) plus the readers for files `invoke logs` collected.

A record is `{"step": int | None, "loss": float | "nan" | "inf", …}` with the job's other numbers under their own
names (`lr` for any learning rate). A step of None means the format does not say it (HF Trainer's console lines:
their step is in trainer_state.json's log_history). A summary (HF's `{'train_runtime': …}`) is
`{"event": "summary", …}`.

Formats (research/user_scripts.md):
  hf         `{'loss': 2.3145, 'grad_norm': 1.873, 'learning_rate': 4.9e-05, 'epoch': 0.01}` (Python dict repr)
  torchtune  `Step 10 | loss:1.2345 lr:2e-05 tokens_per_second_per_gpu:123.4` (its log file); tqdm `1|10|Loss: 1.23`
  sana       `… Epoch: 0 | Global Step: 50 | … lr:1.0e-04, Cap: …, s:(1024, 1024), loss:0.1234, grad_norm:0.5` (ANSI colours)
  jsonl      one JSON object a line with a loss (mnft's recipes: format mnft)
  regex      a user regex with named groups: loss required, step and any others optional
  plain      what scripts print by hand: `name value` / `name: value` / `name=value` pairs, one of them a loss
             (`step 21 loss 0.2474`, nanoGPT's `iter 100: loss 2.3456, time 12.34ms, mfu 1.23%`, `Epoch 1 Step 20
             Loss 0.5`, a tqdm or Lightning bar's postfix `…| 45/100 [00:01<00:02, 30.1it/s, train_loss=0.123]`);
             the step is `step`/`iter`/`iteration`/`global_step`'s value, else a tqdm bar's count (Lightning's,
             counted from the epoch: epoch × total + count), else none; a loss named for evaluation (`val`,
             `eval`, `test`, `best`) is not the training loss, nor a line that begins with such a word; a script's
             closing summary is no step either (HF's `  train_loss               =     4.7523` block after
             train()). The corpus it is tested on: tests/data/metric-lines/corpus.py
  auto       jsonl, hf, torchtune, sana, plain: the first that matches a line
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.run.timeline import bar_step

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|NaN|Inf|-inf)"
TORCHTUNE_STEP = re.compile(r"^Step (\d+) \| (.*)$")
TORCHTUNE_PAIR = re.compile(r"([A-Za-z_][\w/]*):(" + NUMBER + r")(?=\s|$)")
TORCHTUNE_TQDM = re.compile(r"^(\d+)\|(\d+)\|Loss: (" + NUMBER + r")")
SANA_STEP = re.compile(r"Global Step: (\d+)")
SANA_VALUE = {key: re.compile(r"(?<![\w/])" + key + r":\s*(" + NUMBER + r")") for key in ("loss", "lr", "grad_norm")}
SANA_EPOCH = re.compile(r"Epoch: (\d+)")
LR_NAMES = ("learning_rate", "lr")
# plain: a name, then `:`/`=`/spaces (a `[` allowed: `Step [100/600]`), then a number (thousands with commas: tps: 1,234),
# then perhaps a unit; the name of a loss may come as two words (`train loss`, `Eval Loss`), joined first
PLAIN_NUMBER = r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|" + NUMBER
PLAIN_PAIR = re.compile(r"(?<![\w/.-])([A-Za-z][\w/.-]*?)(?:\s*[:=]\s*|\s+)\[?(" + PLAIN_NUMBER + r")(%|ms|s|GiB|MiB|GB|MB)?(?![\w.])")
PLAIN_QUALIFIED = re.compile(r"\b(train|training|val|valid|validation|eval|test|best|avg|average|mean|running|total)[ _](loss)\b", re.IGNORECASE)
PLAIN_STEPS = ("step", "global_step", "globalstep", "iter", "iteration", "it")
NOT_TRAINING = ("val", "valid", "validation", "eval", "test", "best")
EVALUATION_LINE = re.compile(r"^\W*(?:test|val|valid|validation|validating|eval|evaluation|evaluating)\b", re.IGNORECASE)
# HF's end-of-run metrics block (Trainer.log_metrics, printed by run_clm.py and its kin after train()):
# `***** train metrics *****`, then `  train_loss               =     4.7523` a key a line: the run's totals, no step
HF_METRICS_ROW = re.compile(r"(?:^|\s)\s(?:train|eval|test|predict)_\w+ +=  *\S+\s*$")
TQDM_PERCENT = re.compile(r"\s*\d{1,3}%\|")
TQDM_BAR = re.compile(r"\|\s*(\d{1,18})/(\d{1,18})\s*\[")
LIGHTNING_EPOCH = re.compile(r"^\s*Epoch (\d+):")
MAX_METRIC_LINE = 64 * 1024  # characters: a longer line is output, never a metrics record
HF_SUMMARY_KEYS = ("train_runtime", "train_loss")


def number(value: Any) -> float | str | None:
    """A finite float, "nan"/"inf"/"-inf" as text (JSON has no NaN), or None for what is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        value = float(value)
    elif isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    else:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def record(step: Any, values: dict[str, Any]) -> dict[str, Any] | None:
    """A step record from a format's raw values: numbers only, the learning rate as `lr`; None without a loss."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        n = number(value)
        if n is not None:
            out["lr" if key in LR_NAMES else key] = n
    if "loss" not in out:
        return None
    out["step"] = step_number(step)
    return out


def step_number(value: Any) -> int | None:
    """A step as a job printed it, if it is one: a whole number from 0 to 2**63 (1e999, -5, 'x', 2.5: None)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if not value.isdigit() or len(value) > 19:
            return None
    try:
        number = float(value) if not isinstance(value, int) else value
    except (TypeError, ValueError, OverflowError):
        return None
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        return None
    return int(number) if 0 <= number < 2**63 else None


def compile_regex(regex: Any, where: str) -> re.Pattern:
    if not isinstance(regex, str) or not regex:
        raise InputError(f"{where}: metrics.regex: give a regular expression with a named group 'loss', e.g. step (?P<step>\\d+) loss (?P<loss>\\S+)")
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise InputError(f"{where}: metrics.regex {regex!r}: {exc}") from None
    if "loss" not in pattern.groupindex:
        raise InputError(f"{where}: metrics.regex {regex!r} needs a named group 'loss' ((?P<loss>…)); 'step' and others are optional")
    return pattern


# ------------------------------------------------------------------------------------------------ one line


def hf_line(text: str) -> dict[str, Any] | None:
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")) or "'" not in text:
        return None
    try:
        data = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        data = _hf_with_nan(text)
    if not isinstance(data, dict):
        return None
    if any(k in data for k in HF_SUMMARY_KEYS) and "loss" not in data:
        summary = {k: number(v) for k, v in data.items() if number(v) is not None}
        return {"event": "summary", **summary}
    return record(data.get("step"), {k: v for k, v in data.items() if k != "step"})


def _hf_with_nan(text: str) -> Any:
    """HF prints a NaN loss as `nan` (not a Python literal): read those values as floats."""
    try:
        return ast.literal_eval(re.sub(r"(?<=: )(-?(?:nan|inf))(?=[,}])", r"'\1'", text))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def torchtune_line(text: str) -> dict[str, Any] | None:
    text = text.strip()
    match = TORCHTUNE_STEP.match(text)
    if match:
        return record(match.group(1), dict(TORCHTUNE_PAIR.findall(match.group(2))))
    match = TORCHTUNE_TQDM.match(text)
    if match:
        return record(match.group(2), {"epoch": match.group(1), "loss": match.group(3)})
    return None


def sana_line(text: str) -> dict[str, Any] | None:
    text = ANSI.sub("", text)
    step = SANA_STEP.search(text)
    if not step:
        return None
    values = {}
    for key, pattern in SANA_VALUE.items():
        found = pattern.findall(text)
        if found:
            values[key] = found[-1]  # the caption comes before the numbers and may itself say "loss:"
    epoch = SANA_EPOCH.search(text)
    if epoch:
        values["epoch"] = epoch.group(1)
    return record(step.group(1), values)


def plain_line(text: str) -> dict[str, Any] | None:
    """`name value` pairs as scripts print them by hand, one of them a training loss (see the module's doc)."""
    text = PLAIN_QUALIFIED.sub(lambda m: f"{m.group(1)}_{m.group(2)}", ANSI.sub("", text))
    if EVALUATION_LINE.match(text):  # `Test set: Average loss: 0.0274, …`: an evaluation, not a training step
        return None
    if HF_METRICS_ROW.search(text):  # `  train_loss = 4.7523`: HF's closing metrics block, the run's mean loss
        return None
    pairs: dict[str, str] = {}
    for key, value, unit in PLAIN_PAIR.findall(TQDM_PERCENT.sub("|", text)):  # `train:  40%|███|`: the bar's share is no value
        key = key.lower() + (f"_{unit.lower()}" if unit in ("ms", "s") else "")
        pairs.setdefault(key, value.replace(",", ""))
    loss = _training_loss(pairs)
    if loss is None:
        return None
    step = next((pairs.pop(k) for k in PLAIN_STEPS if k in pairs), None)
    bar = TQDM_BAR.search(text)
    if step is None and bar:
        count, total = int(bar.group(1)), int(bar.group(2))
        epoch = LIGHTNING_EPOCH.match(text)  # Lightning's bar counts the epoch's batches: from the epoch's start
        step = str(int(epoch.group(1)) * total + count if epoch else count)
    values = {k: v for k, v in pairs.items() if k != loss}
    values["loss"] = pairs[loss]
    return record(step, values)


def _training_loss(pairs: dict[str, str]) -> str | None:
    """The name of the training loss among a line's pairs: `loss`, else one named for training (train_loss,
    train_loss_step …), else any other loss but one named for evaluation; a per-epoch mean comes last."""
    losses = [k for k in pairs if "loss" in k and not k.startswith(NOT_TRAINING)]
    if not losses:
        return None
    return min(losses, key=lambda k: (k != "loss", not k.startswith(("train", "loss")), k.endswith("_epoch")))


def json_line(text: str) -> dict[str, Any] | None:
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if data.get("event") == "summary":
        return data
    if "event" in data and "loss" not in data:
        return None
    return record(data.get("step", data.get("global_step")), {k: v for k, v in data.items() if k not in ("step", "global_step")})


def regex_line(pattern: re.Pattern, text: str) -> dict[str, Any] | None:
    match = pattern.search(ANSI.sub("", text))
    if not match:
        return None
    groups = {k: v for k, v in match.groupdict().items() if v is not None}
    return record(groups.pop("step", None), groups)


def for_job_output(fmt: str, regex: str | None = None) -> "LineParser":
    """The parser for a job's rank-0 output and metrics-file lines: its format, or any known one (auto) when its
    metrics live in TensorBoard files (read at `logs` time)."""
    return LineParser("auto" if fmt == "tensorboard" else fmt, regex)


class LineParser:
    """Parse one format's lines (or try each known format: auto)."""

    def __init__(self, fmt: str = "auto", regex: str | None = None) -> None:
        self.format = fmt
        if fmt == "regex":
            self.pattern = compile_regex(regex, "metrics")
            self._one = lambda text: regex_line(self.pattern, text)
        else:
            self._one = {"hf": hf_line, "torchtune": torchtune_line, "sana": sana_line, "jsonl": json_line, "mnft": json_line,
                         "plain": plain_line, "auto": self._auto}.get(fmt, lambda text: None)

    @staticmethod
    def _auto(text: str) -> dict[str, Any] | None:
        for parse in (json_line, hf_line, torchtune_line, sana_line, plain_line):
            found = parse(text)
            if found is not None:
                return found
        return None

    def __call__(self, text: str) -> dict[str, Any] | None:
        if len(text) > MAX_METRIC_LINE:  # no format prints a metrics line this long: not parsed (bounded cost)
            return None
        # a progress bar rewrites its line with \r: each piece is a line of its own
        pieces = [piece for piece in reversed(text.split("\r")) if piece.strip()]
        for piece in pieces:
            found = self._one(piece)
            if found is not None:
                return found
        if self.format in ("hf", "auto") and pieces and (bar := bar_step(pieces[0])):
            return {"event": "progress", "step": bar[0], "total": bar[1]}  # HF's training bar: the live global step
        return None

    def lines(self, texts: Iterable[str]) -> list[dict[str, Any]]:
        return [r for r in map(self, texts) if r is not None]


# ------------------------------------------------------------------------------------------------ files


def read_json(path: Path) -> Any:
    """A JSON file a job wrote (trainer_state.json …), or None when it cannot be read or parsed (a job killed
    mid-write leaves half a file); one larger than limits.METRICS_FILE_BYTES is refused in one line, unread."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limits.METRICS_FILE_BYTES:
                raise limits.too_large(path, "metrics file", limits.METRICS_FILE_BYTES, "METRICS_FILE_BYTES")
            data = limits.read_at_most(f, limits.METRICS_FILE_BYTES)
    except OSError:
        return None
    if len(data) > limits.METRICS_FILE_BYTES:
        raise limits.too_large(path, "metrics file", limits.METRICS_FILE_BYTES, "METRICS_FILE_BYTES")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def trainer_state_records(data: Any) -> list[dict[str, Any]]:
    """HF Trainer's trainer_state.json (parsed): its log_history's training entries, each with its step."""
    out = []
    for entry in (data.get("log_history") if isinstance(data, dict) else None) or []:
        if isinstance(entry, dict):
            found = record(entry.get("step"), {k: v for k, v in entry.items() if k != "step"})
            if found is not None:
                out.append(found)
    return out


def trainer_state(path: Path) -> list[dict[str, Any]]:
    """HF Trainer's trainer_state.json: its log_history's training entries, each with its step."""
    return trainer_state_records(read_json(path))


def tensorboard(directory: Path) -> list[dict[str, Any]]:
    """Scalars from TensorBoard event files under a directory, read with the tensorboard package's reader.
    The loss is the first tag that is `loss` or ends in `/loss` (train/loss, Loss/train_loss, …)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise InputError("metrics format tensorboard needs the tensorboard package on this machine: pip install tensorboard") from None
    by_step: dict[int, dict[str, Any]] = {}
    files = sorted(directory.rglob("events.out.tfevents.*"))
    for path in files:
        event_file_framing(path)
    runs = sorted({p.parent for p in files})
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={SCALARS: 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        loss_tag = _loss_tag(tags)
        for tag in tags:
            name = tag.rsplit("/", 1)[-1].lower()
            key = "loss" if name in ("loss", "train_loss") and tag == loss_tag else ("lr" if name in ("lr", "learning_rate") else tag)
            for event in acc.Scalars(tag):
                by_step.setdefault(int(event.step), {})[key] = event.value
    return [r for r in (record(step, values) for step, values in sorted(by_step.items())) if r is not None]


def event_file_framing(path: Path) -> None:
    """A TensorBoard event file is read by the tensorboard package only within limits: at most
    limits.METRICS_FILE_BYTES, and no record claiming more bytes than the file holds (its reader allocates the
    length a record's header claims before reading it: 2**60 would be a MemoryError). A record cut short at the end
    (a job killed mid-write) is left to the reader, which stops there. One line otherwise."""
    import struct

    limit = limits.METRICS_FILE_BYTES
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise limits.too_large(path, "TensorBoard event file", limit, "METRICS_FILE_BYTES")
            offset = 0
            while offset + 12 <= size:  # each record: length (8 bytes), its CRC (4), data, the data's CRC (4)
                f.seek(offset)
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size:
                    raise InputError(f"{path}: not a TensorBoard event file: a record of {length} bytes in a file of {size} "
                                     "(a limit of mnft's input, see docs/security.md)")
                offset += 12 + length + 4
    except OSError:
        return  # unreadable: the reader says so in its way


def _loss_tag(tags: list[str]) -> str | None:
    for tag in tags:
        if tag.lower() == "loss" or tag.lower().endswith("/loss"):
            return tag
    for tag in tags:
        if tag.lower().endswith("train_loss"):
            return tag
    return None


def steps_only(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records (no summaries), numbered where the format gave no step: 1, 2, … in order."""
    steps = (r for r in records if "loss" in r and r.get("event") is None)
    return [dict(r) if r.get("step") is not None else dict(r, step=None, index=index) for index, r in enumerate(steps, 1)]
