"""edge.tools.soak (edge/tools/soak.py): its flags are refused before anything runs."""
from __future__ import annotations

from helpers import run_module


def test_soak_bad_flags_fail_before_running(tmp_path):
    for flags, needle in ((["--turns", "0"], "--turns"), (["--every", "0"], "--every"), (["--group", "0"], "--group"),
                          (["--drafter", "bogus"], "--drafter"), (["--max-tokens", "0"], "--max-tokens"),
                          (["--model-dir", str(tmp_path / "nope")], "no such model directory")):
        r = run_module(["edge.tools.soak", *flags], timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (flags, r.stderr)
        assert needle in r.stderr, (flags, r.stderr)
