"""The kernel log's records, and the NVIDIA driver's Xid lines among them: the program `mnft setup`'s kernel_log
step installs, root-owned, for the lab's members to run through sudo where kernel.dmesg_restrict=1 keeps them from
/dev/kmsg (Debian's and Ubuntu's default).

Run as that program (`sudo -n /usr/local/libexec/mnft-kernel-xids`, no arguments: the sudoers rule allows none) it
reads /dev/kmsg and prints only the records whose message is an NVRM Xid line, in /dev/kmsg's own record form
("prio,seq,usec,flags;message"), so nothing else of the kernel log (other users' USB sticks, OOM kills with command
lines, audit lines) reaches anyone. It reads at most MAX_BYTES and never writes anything.

Standalone (tests/test_architecture.py): it imports nothing of mnft, so its file is the whole program; the host
package reads /dev/kmsg through the same kmsg_records (kernellog). Python 3.8 syntax, standard library only.
"""

import errno
import os
import sys

KMSG = "/dev/kmsg"
MAX_BYTES = 8 << 20
XID_MARK = "NVRM: Xid (PCI:"  # how the driver's Xid line begins: a line that only holds it (a process name in a segfault line) is not one


def kmsg_records(path=KMSG, limit=MAX_BYTES):
    """The kernel log's records as (usec since boot, message, the record's line). /dev/kmsg answers one record per
    read and EAGAIN at its end; a plain file (a saved log, the test bed's stand-in) is read to its end. OSError when
    it cannot be opened (EPERM under kernel.dmesg_restrict=1)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    chunks, size = [], 0
    try:
        while size < limit:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while we read: go on from the next
                    continue
                if exc.errno == errno.EINVAL:
                    break
                raise
            if not data:
                break
            chunks.append(data if data.endswith(b"\n") else data + b"\n")
            size += len(data)
    finally:
        os.close(fd)
    return parse_records(b"".join(chunks).decode("utf-8", "replace"))


def parse_records(text):
    """[(usec, message, line)] of text in /dev/kmsg's record form; other lines (continuations, junk) are skipped."""
    records = []
    for line in text.splitlines():
        head, sep, message = line.partition(";")
        fields = head.split(",")
        if sep and len(fields) >= 3 and fields[2].isdigit():
            records.append((int(fields[2]), message, line))
    return records


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        sys.stderr.write("mnft-kernel-xids takes no arguments\n")
        return 2
    try:
        records = kmsg_records()
    except OSError as exc:
        sys.stderr.write("mnft-kernel-xids: %s: %s\n" % (KMSG, exc.strerror))
        return 1
    sys.stdout.write("".join(line + "\n" for _, message, line in records if message.startswith(XID_MARK)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
