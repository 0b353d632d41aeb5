"""edge/measure.py's peak RSS: VmHWM in KiB (not the current RSS, not ru_maxrss while /proc answers), ru_maxrss in
KiB on Linux and bytes on macOS otherwise, the largest child's only when asked, and the reset through clear_refs."""
from __future__ import annotations

import io
import sys
from types import SimpleNamespace

from edge import measure


def _fake_proc(monkeypatch, status: str | None, self_kib: int, children_kib: int, platform: str = "linux"):
    """/proc/self/status reads `status` (None: no such file); getrusage reports the given ru_maxrss values."""
    writes = []

    def fake_open(path, mode="r"):
        if path == "/proc/self/status" and status is not None and mode == "r":
            return io.StringIO(status)
        if path == "/proc/self/clear_refs" and status is not None and mode == "w":
            buf = io.StringIO()
            buf.close = lambda: writes.append(buf.getvalue())
            return buf
        raise FileNotFoundError(path)

    usage = {0: self_kib, -1: children_kib}
    fake_resource = SimpleNamespace(RUSAGE_SELF=0, RUSAGE_CHILDREN=-1,
                                    getrusage=lambda who: SimpleNamespace(ru_maxrss=usage[who]))
    monkeypatch.setattr(measure, "open", fake_open, raising=False)
    monkeypatch.setattr(measure, "resource", fake_resource)
    monkeypatch.setattr(sys, "platform", platform)
    return writes


STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t   5000 kB\nVmRSS:\t   3000 kB\n"


def test_peak_rss_is_vmhwm_in_kib_not_the_current_rss_or_ru_maxrss(monkeypatch):
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=1)
    assert measure.peak_rss_bytes() == 5000 * 1024


def test_peak_rss_falls_back_to_ru_maxrss_in_kib_on_linux_and_bytes_on_macos(monkeypatch):
    _fake_proc(monkeypatch, None, self_kib=7000, children_kib=1)
    assert measure.peak_rss_bytes() == 7000 * 1024
    _fake_proc(monkeypatch, "Name:\tpython\nVmRSS:\t 3000 kB\n", self_kib=7000, children_kib=1)  # no VmHWM line
    assert measure.peak_rss_bytes() == 7000 * 1024
    _fake_proc(monkeypatch, None, self_kib=7000, children_kib=1, platform="darwin")
    assert measure.peak_rss_bytes() == 7000


def test_peak_rss_counts_the_largest_child_only_when_asked(monkeypatch):
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=8000)
    assert measure.peak_rss_bytes() == 5000 * 1024
    assert measure.peak_rss_bytes(children=True) == 8000 * 1024
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=10)
    assert measure.peak_rss_bytes(children=True) == 5000 * 1024


def test_reset_peak_rss_writes_5_to_clear_refs_and_says_when_it_cannot(monkeypatch):
    writes = _fake_proc(monkeypatch, STATUS, 1, 1)
    assert measure.reset_peak_rss() is True and writes == ["5"]
    _fake_proc(monkeypatch, None, 1, 1)  # no /proc (macOS) or not writable
    assert measure.reset_peak_rss() is False
