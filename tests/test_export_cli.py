"""`python -m export.cli` on bad inputs: exit code 2, one line `edge-export: error: ...` on stderr naming the
problem, no traceback, and nothing left in the output location."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from conftest import tiny_export_options
from export import calibration
from export.pipeline import export_model


PROGRESS = re.compile(r"\d+/\d+ \[")  # tqdm's bar ("loading checkpoint:   0%|   | 0/8 [00:00<?, ?step/s]")
STEP = "[export] "  # a step's plain line, in place of the bar when stderr is not a terminal


def expect_one_line_error(r, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines()
             if ln.strip() and not PROGRESS.search(ln) and not ln.startswith(STEP)]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("edge-export: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.stdout == ""
    return lines[0]


def copy_without(src, dst, *names):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def write_gguf(path, arch: str):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_wrong_path(run_export_cli, tmp_path):
    out = tmp_path / "out"
    expect_one_line_error(run_export_cli(tmp_path / "does-not-exist", "-o", out), "does-not-exist",
                          "no such file or directory")
    assert not out.exists()


def test_file_that_is_not_gguf(run_export_cli, tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"certainly not a GGUF header" * 10)
    expect_one_line_error(run_export_cli(junk, "-o", tmp_path / "out"), "model.gguf", "not a readable GGUF")
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"\0" * 64)
    expect_one_line_error(run_export_cli(txt, "-o", tmp_path / "out"), "weights.bin", ".gguf")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_unsupported_architecture_lists_supported(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "gpt2")
    edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    line = expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "GPT2LMHeadModel")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert arch in line


def test_unsupported_gguf_architecture(run_export_cli, tmp_path):
    p = tmp_path / "tiny-gpt2.gguf"
    write_gguf(p, "gpt2")
    expect_one_line_error(run_export_cli(p, "-o", tmp_path / "out"), "'gpt2'", "llama", "qwen2")


def test_missing_tokenizer(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "notok", "tokenizer.json")
    out = tmp_path / "out"
    expect_one_line_error(run_export_cli(d, "-o", out), "tokenizer.json")
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_missing_weights(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "noweights", "*.safetensors")
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "safetensors")


def test_incomplete_weights(run_export_cli, tiny_llama_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_without(tiny_llama_dir, tmp_path / "partial", "*.safetensors")
    w = load_file(str(tiny_llama_dir / "model.safetensors"))
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "weights missing", "down_proj")


def test_untied_config_without_lm_head(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "nohead")
    edit_config(d, tie_word_embeddings=False)
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "lm_head")


def test_no_config(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "noconfig", "config.json")
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "config.json")


def test_truncated_weights(run_export_cli, tiny_llama_dir, tmp_path):
    d = copy_without(tiny_llama_dir, tmp_path / "trunc")
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "model.safetensors")
    st.write_bytes(b"\x05")  # shorter than the 8-byte header length
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "model.safetensors")


@pytest.mark.parametrize("damage", ["not json", "missing key"])
def test_broken_config(run_export_cli, tiny_llama_dir, tmp_path, damage):
    d = copy_without(tiny_llama_dir, tmp_path / "badcfg")
    if damage == "not json":
        (d / "config.json").write_text("{ oops")
    else:
        edit_config(d, num_attention_heads=None)
    expect_one_line_error(run_export_cli(d, "-o", tmp_path / "out"), "config.json")


def expect_usage_error(r, *needles: str) -> None:
    """argparse's convention: a usage line, then `edge-export: error: ...`."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("usage: edge-export") and lines[-1].startswith("edge-export: error: "), r.stderr
    for n in needles:
        assert n in lines[-1], (n, lines[-1])


def test_bad_options(run_export_cli, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    expect_usage_error(run_export_cli("-o", out), "SOURCE")
    expect_usage_error(run_export_cli(tiny_llama_dir, "-o", out, "--precision", "int3"), "--precision")
    expect_usage_error(run_export_cli(tiny_llama_dir, "-o", out, "--block-size", "24"), "--block-size")
    expect_usage_error(run_export_cli(tiny_llama_dir, "-o", out, "--drafter-layers", "0"), "--drafter-layers")
    expect_one_line_error(run_export_cli(tiny_llama_dir, "-o", out, "--drafter-layers", "9", "--max-len", "256",
                                         "--precision", "fp32", "--calib-tokens", "4"), "layers=9", "3")
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_small_max_len(run_export_cli, tiny_llama_dir, tmp_path):
    r = run_export_cli(tiny_llama_dir, "-o", tmp_path / "out", "--max-len", "48", "--precision", "fp32",
                       "--drafter-layers", "1", "--drafter-vocab", "64", "--calib-tokens", "8", "-q")
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert r.returncode == 0


def test_output_under_a_file(run_export_cli, tiny_llama_dir, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    expect_one_line_error(run_export_cli(tiny_llama_dir, "-o", f / "out"), "a-file")


def test_output_that_is_not_an_export_is_never_replaced(run_export_cli, tiny_llama_dir, tmp_path):
    """An export replaces its output directory as a whole: a directory holding anything but an earlier export, the
    source itself, a directory holding the source, or a foreign <out>.partial / <out>.old beside it are refused
    before any work, and nothing in them is touched."""
    user = tmp_path / "notes"
    user.mkdir()
    (user / "important.txt").write_text("keep me")
    expect_one_line_error(run_export_cli(tiny_llama_dir, "-o", user), "notes", "not empty", "no edgespec export")
    assert (user / "important.txt").read_text() == "keep me"
    src = copy_without(tiny_llama_dir, tmp_path / "ck")
    before = sorted(p.name for p in src.iterdir())
    expect_one_line_error(run_export_cli(src, "-o", src), "would replace the source")
    expect_one_line_error(run_export_cli(src, "-o", tmp_path), "would replace the source")
    assert sorted(p.name for p in src.iterdir()) == before
    foreign = tmp_path / "fresh.partial"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x")
    expect_one_line_error(run_export_cli(src, "-o", tmp_path / "fresh"), "fresh.partial", "without edgespec's marker")
    assert (foreign / "mine.txt").exists() and not (tmp_path / "fresh").exists()
    shutil.move(foreign, tmp_path / "fresh.old")
    expect_one_line_error(run_export_cli(src, "-o", tmp_path / "fresh"), "fresh.old", "without edgespec's marker")
    assert (tmp_path / "fresh.old" / "mine.txt").exists() and not (tmp_path / "fresh").exists()


def test_the_default_cache_directory_is_replaced_even_without_its_manifest(tiny_llama_dir, tmp_path):
    """edgespec's own cache (`edge-export --default --force`) is rebuilt even when a damaged export there lost its
    manifest; a user's directory in the same state is refused."""
    from export.pipeline import check_output_dir

    damaged = tmp_path / "smollm2"
    damaged.mkdir()
    (damaged / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no edgespec export"):
        check_output_dir(tiny_llama_dir, damaged)
    check_output_dir(tiny_llama_dir, damaged, cache_dir=True)


def test_reexport_replaces_an_earlier_export(tiny_llama_dir, tmp_path):
    """An earlier export (or an empty directory) is a valid output; the new manifest lists no marker files."""
    from edge.manifest import MANIFEST_NAME

    out = tmp_path / "m"
    out.mkdir()  # empty: fine
    opts = tiny_export_options(drafters=(), parity=False)
    export_model(tiny_llama_dir, out, opts, progress=False)
    (out / "stale.bin").write_text("from an older export")
    m = export_model(tiny_llama_dir, out, opts, progress=False)
    names = {p.name for p in out.iterdir()}
    assert MANIFEST_NAME in names and "stale.bin" not in names and not any(n.startswith(".edgespec") for n in names)
    assert all(not f.path.startswith(".edgespec") for f in m.files)
    assert not (tmp_path / "m.old").exists() and not (tmp_path / "m.partial").exists()


def test_default_does_not_take_a_source(run_export_cli, tiny_llama_dir):
    r = run_export_cli(tiny_llama_dir, "--default")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--default" in r.stderr, r.stderr


def test_an_export_already_in_out_is_replaced_only_with_force(capsys, tiny_llama_dir, tmp_path, monkeypatch):
    """`-o DIR` holding an earlier export once replaced it silently (exit 0) while any other non-empty DIR was
    refused; now it is refused in one line naming what DIR holds and --force, which replaces it. The same for a
    named model exported with -o (the embedded GGUF stood in for by the tiny checkpoint)."""
    from edge.manifest import MANIFEST_NAME, load_manifest
    from export import catalog

    out = tmp_path / "m"
    export_model(tiny_llama_dir, out, tiny_export_options(name="earlier", drafters=(), parity=False), progress=False)
    before = (out / MANIFEST_NAME).read_bytes()
    expect_one_line_error(run_main(capsys, tiny_llama_dir, "-o", out, *FAST), str(out),
                          "already holds an edgespec export", "earlier", str(tiny_llama_dir), "--force")
    monkeypatch.setattr(catalog.Model, "gguf_path", lambda self: tiny_llama_dir)
    expect_one_line_error(run_main(capsys, "--default", "-o", out, *FAST), "already holds", "--force")
    assert (out / MANIFEST_NAME).read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    r = run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--force")
    assert r.returncode == 0, r.stderr
    m = load_manifest(out, verify="sha256")
    assert m.name != "earlier" and [g.name for g in m.drafters] == ["drafter-l1-v64"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_help_runs(run_export_cli):
    r = run_export_cli("--help")
    assert r.returncode == 0 and "edge-export" in r.stdout and "--drafter-vocab" in r.stdout


def test_help_names_what_the_builder_supports_and_force_covers_out(capsys):
    """--via's help once listed llama/Mistral/Qwen2 and sent Gemma to optimum after the builder learned Gemma 3; it
    is now made from the builder's own tables."""
    from export.checkpoint import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES

    r = run_main(capsys, "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    via = text[text.index("builder (default): "):text.index("--no-parity ")]
    builder, optimum = via.split("; optimum:")
    for arch in (*SUPPORTED_ARCHITECTURES, *GGUF_ARCHITECTURES):
        assert arch in builder, (arch, builder)
    assert "Gemma" not in optimum, optimum
    force = text[text.index("--force replace"):text.index("--precision {", text.index("--force replace"))]
    assert "-o OUT" in force, force


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(run_export_cli, tiny_llama_dir, tmp_path):
    """A redirected log once filled with the bar's carriage-return frames, and the error line was appended to the
    last one; now each step is a plain line and the error stands on its own."""
    d = copy_without(tiny_llama_dir, tmp_path / "notok", "tokenizer.json")
    r = run_export_cli(d, "-o", tmp_path / "out")  # no -q; stderr is a pipe
    assert "\r" not in r.stderr and not PROGRESS.search(r.stderr), repr(r.stderr)
    lines = r.stderr.strip().split("\n")
    assert lines[0] == "[export] loading checkpoint …" and all(ln.startswith(STEP) for ln in lines[:-1]), lines
    assert lines[-1].startswith("edge-export: error: ") and "tokenizer.json" in lines[-1], lines


def test_progress_bar_on_a_terminal_is_cleared_before_the_error(tiny_llama_dir, tmp_path):
    """On a terminal the bar is drawn, and cleared before the error line, which starts its own cleared line."""
    pytest.importorskip("tqdm")
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from conftest import REPO

    d = copy_without(tiny_llama_dir, tmp_path / "notok", "tokenizer.json")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a width for the bar to fill
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "export.cli", str(d), "-o", str(tmp_path / "out")], cwd=REPO,
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert p.wait(timeout=120) == 2
    err = b"".join(chunks).decode()
    assert PROGRESS.search(err) and "[export]" not in err, repr(err)
    before, error = err.split("edge-export: error: ")
    *_, bar, cleared = re.split(r"[\r\n]", before)
    assert cleared == "" and bar.strip() == "", repr(err)  # the last frame blanked, the cursor back at column 0
    assert "tokenizer.json" in error and "\n" not in error.strip(), repr(err)


def test_max_len_below_latency_probe(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "PROMPTS", ["hi there", "a short prompt"] * 5)  # all fit in 100 positions
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(max_len=100), progress=False)
    assert m.target.max_len == 100


def test_cache_from_an_older_graph_builder_is_rebuilt(exported_llama, tiny_llama_dir, tmp_path):
    """`edge-export --default` reuses a cached export only when this graph builder wrote it."""
    from edge.manifest import MANIFEST_NAME
    from export.cli import _reusable

    d = tmp_path / "copy"
    shutil.copytree(exported_llama[0], d)
    assert _reusable(d, tiny_llama_dir, tiny_export_options())
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["source"]["graph_version"] -= 1
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    assert not _reusable(d, tiny_llama_dir, tiny_export_options())


def test_default_with_out_exports_the_embedded_model_there(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`edge-export --default -o DIR --precision P` exports the embedded model into DIR (another precision for a
    device profile, say) and leaves the cache directory alone. The embedded GGUF is stood in for by the tiny
    checkpoint."""
    import export.cli as cli
    from edge.manifest import load_manifest
    from export import catalog

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(catalog.Model, "gguf_path", lambda self: tiny_llama_dir)
    out = tmp_path / "smol-fp32"
    rc = cli.main(["--default", "-o", str(out), "--precision", "fp32", "--drafter-layers", "1", "--drafter-vocab",
                   "128", "--calib-tokens", "8", "--max-len", "256", "--no-parity", "-q"])
    assert rc == 0, capsys.readouterr().err
    m = load_manifest(out)
    assert m.name == "SmolLM2-135M-Instruct" and m.target.precision == "fp32"
    assert not (tmp_path / "home").exists()  # the cache was not touched


@pytest.mark.parametrize("flag", [False, True])
def test_integer_zero_points_flag(run_export_cli, tiny_llama_dir, tmp_path, flag):
    """int4 keeps the blocks' float minimums unless --integer-zero-points asks for MatMulNBits' own grid; the manifest
    says which (and the graph has the block-sum inputs exactly when it keeps them)."""
    import onnx

    from edge.manifest import load_manifest

    out = tmp_path / "out"
    r = run_export_cli(tiny_llama_dir, "-o", out, "--precision", "int4", "--max-len", "128", "--drafter-layers", "1",
                       "--drafter-vocab", "64", "--calib-tokens", "4", "--no-parity", "-q",
                       *(["--integer-zero-points"] if flag else []))
    assert r.returncode == 0, r.stderr[-600:]
    m = load_manifest(out)
    assert [g.block_min for g in m.graphs] == [not flag] * len(m.graphs)
    g = onnx.load(str(out / m.target.file), load_external_data=False)
    assert any(n.name.endswith("/block_sums") for n in g.graph.node) is (not flag)


def test_no_smooth_flag(run_export_cli, tiny_llama_dir, tmp_path):
    """w8a8 is smoothed by default (the manifest records it); --no-smooth quantizes the activations as they are."""
    from edge.manifest import load_manifest

    for flag in (False, True):
        out = tmp_path / f"out-{flag}"
        r = run_export_cli(tiny_llama_dir, "-o", out, "--precision", "w8a8", "--max-len", "128", "--drafter-layers",
                           "1", "--drafter-vocab", "64", "--calib-tokens", "4", "--no-parity", "-q",
                           *(["--no-smooth"] if flag else []))
        assert r.returncode == 0, r.stderr[-600:]
        assert ("smoothing" in load_manifest(out).target.stats) is (not flag)


FAST = ("--precision", "fp32", "--max-len", "256", "--drafter-layers", "1", "--drafter-vocab", "64", "--calib-tokens",
        "4", "--no-parity", "-q")  # what a wrongly accepted option then exports, quickly


def run_main(capsys, *args):
    """`export.cli.main(ARGS)` in this process (argument errors need no subprocess) → returncode, stdout, stderr."""
    from types import SimpleNamespace

    from export.cli import main

    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


@pytest.mark.parametrize("flag,value", [("--drafter-vocab", "-5"), ("--calib-tokens", "-1"), ("--calib-tokens", "0"),
                                        ("--threads", "0"), ("--max-len", "0"), ("--max-len", "-3")])
def test_nonsense_numbers_are_refused_before_any_export(capsys, tiny_llama_dir, tmp_path, flag, value):
    """A negative drafter vocabulary or no calibration text once exported with exit 0 (`drafter-l2-v-5`, a NaN vocab
    coverage in the manifest); now argparse refuses them, naming the flag."""
    out = tmp_path / "out"
    expect_usage_error(run_main(capsys, tiny_llama_dir, "-o", out, *FAST, flag, value), flag, value)
    assert not out.exists() and not out.with_name("out.partial").exists()


@pytest.mark.parametrize("bad", [dict(drafters=((1, -5),)), dict(drafters=((0, 64),)), dict(calib_new_tokens=-1),
                                 dict(threads=0), dict(max_len=0), dict(drafter_checkpoints=(("ck", -1),))])
def test_export_options_refuse_nonsense_numbers(bad):
    with pytest.raises(ValueError, match="must be at least"):
        tiny_export_options(**bad)


def test_drafter_sizes_that_name_one_drafter_twice(capsys, tiny_llama_dir, tmp_path):
    """Vocab 0 and any size at or above the model's (384 here) all keep the whole vocabulary: asking for two of them
    once failed on an existing directory (errno 17); now it is refused by name before the long steps."""
    out = tmp_path / "out"
    r = run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--drafter-vocab", "0", "500")
    expect_one_line_error(r, "layers=1, vocab=384 asked for twice", "give each size once")
    expect_one_line_error(run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--drafter-vocab", "64", "64"),
                          "vocab=64 asked for twice")
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_drafter_layers_none(capsys, tiny_llama_dir, tmp_path):
    """`--drafter-layers none` (as --help says) exports no early-exit drafter; mixed with layer counts, or a word that
    is neither, it is refused in words (not argparse's 'invalid _positive value')."""
    from edge.manifest import load_manifest

    out = tmp_path / "out"
    r = run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--drafter-layers", "none")
    assert r.returncode == 0, r.stderr
    assert [g.role for g in load_manifest(out).graphs] == ["target"]
    expect_usage_error(run_main(capsys, tiny_llama_dir, "-o", tmp_path / "x", *FAST, "--drafter-layers", "none", "2"),
                       "--drafter-layers none", "give it alone")
    r = run_main(capsys, tiny_llama_dir, "-o", tmp_path / "x", *FAST, "--drafter-layers", "two")
    expect_usage_error(r, "--drafter-layers", "'two'", "none")
    assert "_positive" not in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_no_smooth_is_refused_where_nothing_is_smoothed(capsys, tiny_llama_dir, tmp_path, precision):
    """Only w8a8 is smoothed (export/pipeline.py `_smoothing`): --no-smooth with another precision changed nothing and
    was accepted silently; now it is refused, naming the precision it applies to. (--lm-head-bits is not refused with
    fp32: it quantizes the float model's head, as its help says.)"""
    out = tmp_path / "out"
    r = run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--precision", precision, "--no-smooth")
    expect_usage_error(r, "--no-smooth", "w8a8", precision)
    assert not out.exists()


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_w8a8_kernel_is_refused_without_w8a8_layers(capsys, tiny_llama_dir, tmp_path, precision):
    """--w8a8-kernel picks the int8 weight layout of w8a8 linears; with another precision it changed nothing."""
    out = tmp_path / "out"
    r = run_main(capsys, tiny_llama_dir, "-o", out, *FAST, "--precision", precision, "--w8a8-kernel", "u8u8")
    expect_usage_error(r, "--w8a8-kernel", "w8a8", precision)
    assert not out.exists()
