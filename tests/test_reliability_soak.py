"""A short memory soak on the real embedded model, in its own process (RSS of this pytest process would count
every other test's models): `python -m edge.tools.soak --turns 60`. The 500-turn figures are in docs/reliability.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_soak_60_turns_stays_within_the_planner_prediction_and_drafter_bounds(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "edge.tools.soak", "--turns", "60", "--json", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["errors"] == [] and rep["turns"] == 60 and rep["interrupted_turns"] == 6
    assert rep["peak_rss_mb"] <= rep["predicted"]["peak_mb"], (rep["peak_rss_mb"], rep["predicted"])
    rss = {row["turn"]: row["rss_mb"] for row in rep["series"]}
    # after the first 20-turn chat everything is warm: later turns must not grow (500 turns: +0.2 MB, 100 → 500)
    assert rss[60] - rss[30] < 8, rss
    assert len({row["recycling_bytes"] for row in rep["series"]}) == 1  # Token Recycling's matrix is fixed-size
    widest = 0
    for row in rep["series"]:
        # lookup follows the chat on the turns it drafts; on turns the memory plan gives another drafter its history
        # stays as it was, so it is bounded by the longest chat so far (each 20-turn chat's last turn is a row)
        widest = max(widest, row["context_tokens"])
        assert row["lookup_history"] <= widest + 1 + rep["max_tokens"], (row, widest)
        assert row["cached_tokens"] <= row["cached_tokens_bound"]
