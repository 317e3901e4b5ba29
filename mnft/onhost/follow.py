"""Following a file as it grows (the run's output, its metrics, its ranks' timings), for the run agent
(mnft.onhost.agent). Standard library only.
"""

import glob
import os

from .runfiles import _is_glob


TAIL_CHUNK = 4 << 20  # bytes read from a followed file at one poll
MAX_LINE = 64 << 10  # bytes: a longer line is cut (mnft never parses a metrics line this long)


class _Tail:
    """New complete lines of a file. from_end: skip what it holds now (a resumed job appends to its old
    metrics.jsonl: those lines are history, not this run's progress). A file that shrank is read again from 0.
    A path with glob characters follows the newest matching file (torchtune's logs/log_<time>.txt); a file that
    appears only after the start is read from its beginning."""

    def __init__(self, path, from_end=False):
        self.pattern, self.pos, self.buf, self.cutting = path, 0, b"", False
        self.path = self._resolve()
        self.skipped = set()
        if from_end:
            for old in (glob.glob(path) if _is_glob(path) else [path]):
                self.skipped.add(old)
            try:
                self.pos = os.path.getsize(self.path) if self.path else 0
            except OSError:
                pass

    def _resolve(self):
        if not _is_glob(self.pattern):
            return self.pattern
        found = [p for p in glob.glob(self.pattern) if os.path.isfile(p)]
        return max(found, key=lambda p: (os.path.getmtime(p), p)) if found else None

    def lines(self):
        current = self._resolve()
        if current != self.path:  # a newer file of the pattern: read it from its start
            self.path, self.pos, self.buf, self.cutting = current, 0, b"", False
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.pos:
                    self.pos, self.buf = 0, b""
                fh.seek(self.pos)
                data = fh.read(TAIL_CHUNK)  # bounded: a huge write is read over several polls
        except OSError:
            return []
        self.pos += len(data)
        self.buf += data
        if self.cutting:  # the rest of a line already cut: dropped up to its end
            end = self.buf.find(b"\n")
            self.buf, self.cutting = (b"", True) if end < 0 else (self.buf[end + 1:], False)
        *done, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_LINE:  # a line without end: what fits is a line, the rest of it is dropped
            done.append(self.buf[:MAX_LINE] + b" [line cut: longer than %d bytes]" % MAX_LINE)
            self.buf, self.cutting = b"", True
        return [line.decode("utf-8", "replace") for line in done]
