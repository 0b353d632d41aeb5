"""What every command shares: --version, and one default answer length (edge.engine.DEFAULT_MAX_TOKENS)."""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import edge
from edge.engine import DEFAULT_MAX_TOKENS

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [("edge.chat", "edge-chat"), ("edge.server.app", "edge-serve"), ("edge.tools.bench", "edge-bench"),
            ("edge.tools.profile", "edge-profile"), ("export.cli", "edge-export"),
            ("edge.tools.soak", "python -m edge.tools.soak"),
            ("edge.tools.serve_load", "python -m edge.tools.serve_load")]


@pytest.mark.parametrize("module,prog", COMMANDS)
def test_version_prints_the_program_and_edgespecs_version(module, prog, capsys):
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"{prog} {edge.__version__}\n"


@pytest.mark.parametrize("module,prog", COMMANDS)
def test_help_lists_version(module, prog, capsys):
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--version" in capsys.readouterr().out


def test_version_as_a_user_runs_it():
    r = subprocess.run([sys.executable, "-m", "edge.chat", "--version"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout == f"edge-chat {edge.__version__}\n" and not r.stderr, r


def test_one_default_answer_length():
    """edge-chat's --max-tokens, edge-serve's --max-tokens (a request without max_tokens) and create_app all
    default to the engine's DEFAULT_MAX_TOKENS, and their help texts say that number."""
    from edge import chat
    from edge.engine import GenerationParams
    from edge.server import app

    assert GenerationParams().max_tokens == DEFAULT_MAX_TOKENS
    assert chat._parser().parse_args([]).max_tokens == DEFAULT_MAX_TOKENS
    assert app._parser().parse_args([]).max_tokens == DEFAULT_MAX_TOKENS
    assert inspect.signature(app.create_app).parameters["default_max_tokens"].default == DEFAULT_MAX_TOKENS
    for parser in (chat._parser(), app._parser()):
        action = next(x for x in parser._actions if "--max-tokens" in x.option_strings)
        assert f"default {DEFAULT_MAX_TOKENS}" in action.help, action.help
