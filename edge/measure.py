"""Measuring primitives the exporter, the CLIs and the tools share: one target call's latency by width, and this
process's resident memory (now, and its peak)."""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time


def call_latency(session, sizes: list[int], context: int, reps: int, prog=None) -> list[list[float]]:
    """[[S, median ms], ...] of one call of S rows after `context` committed tokens (nothing is committed), for the
    widths of `sizes` up to the first that does not fit. The widths take turns, one call each per round: a slow
    spell of the host (another process, a frequency change) then lands on every width alike instead of making one
    look cheaper than a narrower one."""
    session.cache.trim(session.cache.length)
    ids = [(7 * i) % 97 + 3 for i in range(context)]
    session.prefill(ids)
    fit = []
    for s in sizes:
        if session.cache.room() < s:
            break
        fit.append(s)
    toks = {s: [(5 * i) % 89 + 3 for i in range(s)] for s in fit}
    for s in fit:
        session.forward(toks[s])  # warm-up: the arena grows to this width once
    ts = {s: [] for s in fit}
    for _ in range(reps):
        for s in fit:
            t = time.perf_counter()
            session.forward(toks[s])
            ts[s].append(1000 * (time.perf_counter() - t))
    out = [[s, round(statistics.median(ts[s]), 3)] for s in fit]
    if prog:
        for s in fit:
            prog.step(f"latency S={s}")
    session.cache.trim(session.cache.length)
    return out


def peak_rss_bytes(children: bool = False) -> int:
    """Peak RSS of this process: VmHWM on Linux (this process image alone; ru_maxrss would also carry the parent's
    RSS at fork time across exec), ru_maxrss elsewhere. children=True: or the largest finished child's, if larger."""
    kib = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib
    try:
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib) if children else own


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MB of 2**20 bytes like the footprint model's. (Not its children:
    a first-run export runs in a child whose ~1.7 GB peak is not the chat's.)"""
    return peak_rss_bytes() / 2**20


def reset_peak_rss() -> bool:
    """Start a new peak: on Linux, VmHWM drops to the current RSS ("5" to /proc/self/clear_refs), so the next
    `peak_rss_bytes` is the peak since now. False where that is not possible (then a peak is the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss
