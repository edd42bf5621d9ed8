"""Container log files in the CRI format that containerd writes and the kubelet reads (stdlib
only: the launcher imports it by path).

    2026-12-04T05:53:07.123456789Z stdout F a whole line
    2026-12-04T05:53:07.123456789Z stderr P the first 16 KiB of a longer line...

Why this format instead of the raw output: the kubelet API answers `timestamps`, `sinceSeconds`
and `sinceTime` from a time per line, and this is where a real node keeps it (one file, no side
file to keep in step). The launcher (our containerd-shim) writes it; `plain()` gives back the
output as `kubectl logs` prints it, for the agent's own readers (`DevCluster.logs`, the harness).
A line that is not in the format (a launcher's own crash output) is read as a stdout line with
time 0, so nothing written to the file is ever lost to a reader.
"""

from __future__ import annotations

import calendar
import functools
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: containerd's limit: a longer line is split into partial (P) records
MAX_RECORD_BYTES = 16 * 1024
_RECORD = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z (stdout|stderr) ([FP]) ")


def rfc3339_nano(ns: int, *, trim: bool = False) -> str:
    """`ns` (Unix nanoseconds) as RFC3339Nano; trim=True drops trailing zeros as Go does."""
    secs, frac = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    digits = f"{frac:09d}"
    if trim:
        digits = digits.rstrip("0")
    return f"{base}.{digits}Z" if digits else f"{base}Z"


def parse_time(text: str) -> int:
    """RFC3339 (UTC, 'Z', optional fraction) -> Unix nanoseconds; ValueError otherwise."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", text)
    if not m:
        raise ValueError(f"not an RFC3339 UTC time: {text!r}")
    secs = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    return secs * 1_000_000_000 + int((m.group(2) or "").ljust(9, "0"))


@dataclass(frozen=True)
class Record:
    time_ns: int
    stream: str  # "stdout" | "stderr"
    partial: bool
    content: bytes  # without the newline

    def plain(self) -> bytes:
        """What a reader of the container's output sees (a full line gets its newline back)."""
        return self.content if self.partial else self.content + b"\n"


@functools.lru_cache(maxsize=1024)
def _epoch_seconds(stamp: bytes) -> int:
    # strptime is most of a line's parsing time; the lines of one second share their prefix
    return calendar.timegm(time.strptime(stamp.decode(), "%Y-%m-%dT%H:%M:%S"))


def parse_line(line: bytes) -> Record:
    line = line.rstrip(b"\n")
    m = _RECORD.match(line)
    if not m:
        return Record(0, "stdout", False, line)
    ns = _epoch_seconds(m.group(1)) * 1_000_000_000 + int((m.group(2) or b"").ljust(9, b"0"))
    return Record(ns, m.group(3).decode(), m.group(4) == b"P", line[m.end() :])


def records(data: bytes) -> Iterator[Record]:
    """The records of complete lines in `data` (an unfinished last line is left out)."""
    for line in data.splitlines(keepends=True):
        if line.endswith(b"\n"):
            yield parse_line(line)


def split_complete(data: bytes) -> tuple[bytes, bytes]:
    """`data` as (its complete lines, the unfinished last line a reader keeps for later)."""
    end = data.rfind(b"\n") + 1
    return data[:end], data[end:]


def tail_start(data: bytes, lines: int) -> int:
    """Where the last `lines` complete lines of `data` (which ends with a newline) begin."""
    if lines <= 0:
        return len(data)
    pos = len(data) - 1
    for _ in range(lines):
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0:
            return 0
    return pos + 1


def plain(data: bytes) -> bytes:
    return b"".join(r.plain() for r in records(data))


class StreamWriter:
    """Turns one stream's output into CRI records: whole lines as F, a line longer than
    MAX_RECORD_BYTES in P pieces; an unfinished line waits for its end (or for close())."""

    def __init__(self, fd: int, stream: str) -> None:
        self.fd, self.stream = fd, stream
        self.pending = b""

    def _format(self, content: bytes, tag: str, ns: int) -> bytes:
        return f"{rfc3339_nano(ns)} {self.stream} {tag} ".encode() + content + b"\n"

    def feed(self, chunk: bytes) -> None:
        ns = time.time_ns()
        data = self.pending + chunk
        out = []
        *lines, self.pending = data.split(b"\n")
        for line in lines:
            while len(line) > MAX_RECORD_BYTES:
                out.append(self._format(line[:MAX_RECORD_BYTES], "P", ns))
                line = line[MAX_RECORD_BYTES:]
            out.append(self._format(line, "F", ns))
        while len(self.pending) > MAX_RECORD_BYTES:
            out.append(self._format(self.pending[:MAX_RECORD_BYTES], "P", ns))
            self.pending = self.pending[MAX_RECORD_BYTES:]
        if out:
            # one write of whole records to an O_APPEND file: never interleaved mid-line with the
            # other stream's writer or an exec hook's
            os.write(self.fd, b"".join(out))

    def close(self) -> None:
        """End of the stream: an unfinished last line is written as a whole one (containerd)."""
        if self.pending:
            os.write(self.fd, self._format(self.pending, "F", time.time_ns()))
            self.pending = b""
