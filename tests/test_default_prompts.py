"""edge-bench's and edge-profile's default prompts ship inside the package (a wheel or a plain clone has no
../shared): the file, its provenance, the wheel's package data, and both commands run on it from another directory."""
import fnmatch
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import edge.tools
from edge.tools import bench, profile

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_prompt_file_is_inside_the_package():
    package = Path(edge.tools.__file__).resolve().parent
    assert bench.DEFAULT_PROMPTS.parent == package and bench.DEFAULT_PROMPTS.is_file()
    assert "shared" not in bench.DEFAULT_PROMPTS.parts
    assert bench._parser().parse_args([]).prompts == str(bench.DEFAULT_PROMPTS)
    assert profile._parser().parse_args([]).prompts == str(bench.DEFAULT_PROMPTS)


def test_the_default_prompts_keep_their_source_and_licence():
    items = bench.read_workload(bench.DEFAULT_PROMPTS)
    cats = {}
    for it in items:
        assert it["source"] and it["license"], it  # where each came from, and on what terms
        cats.setdefault(it["category"], []).append(it["id"])
    assert len(cats) >= 3 and all(len(ids) == 3 for ids in cats.values()), cats
    assert len(bench._select_items(items, str(bench.DEFAULT_PROMPTS), 1, None)) == len(cats)  # --limit 1


def test_the_wheel_carries_the_default_prompts():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = "edge.tools"
    assert package in data["packages"]
    rel = bench.DEFAULT_PROMPTS.relative_to(ROOT / package.replace(".", "/")).as_posix()
    assert any(fnmatch.fnmatch(rel, pat) for pat in data["package-data"][package]), data["package-data"]


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})


def test_bench_and_profile_run_on_the_default_prompts_from_elsewhere(tiny_dir, tmp_path):
    """No prompt file given, run from a directory with no ../shared beside it."""
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", "--model", str(tiny_dir), "--limit", "1", "--reps", "1", "--max-tokens", "4",
              "--modes", "none", "--out", str(out), "--quiet"], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert sorted(doc["summary"]) == sorted({it["category"] for it in bench.read_workload(bench.DEFAULT_PROMPTS)})
    r = _run(["edge.tools.profile", "--model", str(tiny_dir), "--steps", "latency", "--sizes", "1,2",
              "--latency-contexts", "16", "--latency-reps", "1", "--out", str(tmp_path / "p"), "--quiet"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p" / "calibration.json").is_file()
