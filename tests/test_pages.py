"""edge.pages: the model files' mapped pages, counted and given back without changing what they read."""
from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

import edge
from edge.pages import mappings, page_counts, release, resident_bytes

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and os.path.exists("/proc/self/pagemap")),
                                reason="reads /proc/self/maps and pagemap (Linux)")

SIZE = 1 << 20


def test_page_counts_read_the_pagemap_bits():
    """Bit 63 present, 62 swapped out, 61 file page: a present file page is resident and clean; a present page
    without bit 61 is the process's own copy, and so is a swapped-out one (file pages are dropped, not swapped)."""
    P, S, F = 1 << 63, 1 << 62, 1 << 61
    entries = np.array([P | F | 123, P | 7, S | 5, 0, F], np.uint64)  # the low bits: a frame or swap number
    assert page_counts(entries) == (2, 2)
    assert page_counts(np.array([P | F, P | F], np.uint64)) == (2, 0)
    assert page_counts(np.array([], np.uint64)) == (0, 0)


def _mapped_file(d, name="weights.data"):
    """A 1 MB file of random bytes under d, mapped as ONNX Runtime maps external data (private, writable), and
    every page of it read. Skips where the host's pagemap does not show those pages resident (a sandboxed kernel
    such as gVisor): there the module reports nothing and releases nothing."""
    d.mkdir(exist_ok=True)
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = d / name
    path.write_bytes(data)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), SIZE, access=mmap.ACCESS_COPY)
    assert bytes(m[::4096]) == data[::4096]  # one byte of every page: all resident
    if resident_bytes(d) < SIZE:
        m.close()
        pytest.skip("this host's /proc/self/pagemap does not report the pages just read")
    return m, data


def test_clean_pages_are_given_back_and_read_the_same(tmp_path):
    m, data = _mapped_file(tmp_path / "model")
    try:
        assert resident_bytes(tmp_path / "model") >= SIZE
        assert release(tmp_path / "model") >= SIZE
        assert resident_bytes(tmp_path / "model") == 0
        assert m[:] == data  # mapped again from the file, unchanged
        assert resident_bytes(tmp_path / "model") >= SIZE
    finally:
        m.close()


def test_a_mapping_with_written_pages_is_kept(tmp_path):
    """A page copied on write holds the process's own bytes: unmapping it would lose them."""
    m, data = _mapped_file(tmp_path / "model")
    try:
        m[0] = data[0] ^ 0xFF
        before = resident_bytes(tmp_path / "model")
        assert release(tmp_path / "model") == 0
        assert m[0] == data[0] ^ 0xFF and m[1:] == data[1:]
        assert resident_bytes(tmp_path / "model") == before
    finally:
        m.close()


def test_only_files_under_the_directory_are_touched(tmp_path):
    mine, _ = _mapped_file(tmp_path / "model")
    other, _ = _mapped_file(tmp_path / "model-other")  # a name that starts like it: not under it
    try:
        release(tmp_path / "model")
        assert resident_bytes(tmp_path / "model") == 0
        assert resident_bytes(tmp_path / "model-other") >= SIZE
    finally:
        mine.close()
        other.close()


def test_the_engine_gives_back_its_model_file_pages(tiny_dir):
    """After loading and after each request no page of the export's files stays mapped in, and answers do not change
    (pages read again come from the file)."""
    engine = edge.load(tiny_dir, drafter="none", context=128)
    assert mappings(tiny_dir), "ONNX Runtime maps the export's external data"
    assert resident_bytes(tiny_dir) == 0
    first = engine.generate("the quick brown fox", max_tokens=12)
    assert resident_bytes(tiny_dir) == 0
    engine.reset()
    assert engine.generate("the quick brown fox", max_tokens=12).token_ids == first.token_ids
