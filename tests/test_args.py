"""edge/args.py: the argparse types that refuse bad values before a model loads (through edge-chat's flags), the
start-up check that a context can hold a chat at all, and the engine flags edge-chat and edge-serve share."""
from __future__ import annotations

import pytest

from edge import args, chat as cli


def _parse(*argv):
    return cli._parser().parse_args(list(argv))


# ----------------------------------------------------------------------------- argparse types

def test_temp_zero_is_a_valid_greedy_temperature():
    """`--temp 0` (documented as greedy) is accepted, as is a positive temperature; the default 0.0 never goes
    through the flag's type, so 0 is passed explicitly here."""
    assert _parse("--temp", "0").temp == 0.0
    assert _parse("--temp", "0.7").temp == 0.7


def test_top_p_one_is_accepted():
    """`--top-p 1`, the documented default and the closed end of (0, 1], is accepted."""
    assert _parse("--top-p", "1").top_p == 1.0


def test_budget_mb_zero_is_refused_by_name(capsys):
    """`--budget-mb 0` is refused, naming the flag: a budget must be positive."""
    with pytest.raises(SystemExit) as ei:
        _parse("--budget-mb", "0", "--plan")
    assert ei.value.code == 2 and "--budget-mb" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a context that cannot hold a chat

def _fake_engine(context: int, empty_tokens: int, max_len: int = 256, chat: bool = True):
    """`empty_tokens`: an empty question's ids with the chat template, or for a base model (`chat` False) the
    tokenizer's prefix (what a raw empty text encodes to)."""
    from types import SimpleNamespace

    def encode(prompt, raw=False):
        assert raw is not chat and isinstance(prompt, str) is not chat  # a base model is asked for its prefix
        return [0] * empty_tokens

    return SimpleNamespace(context=context, encode=encode, has_chat_template=chat,
                           manifest=SimpleNamespace(name="m", target=SimpleNamespace(max_len=max_len)))


def test_context_exactly_an_empty_question_cannot_hold_a_chat():
    """A context exactly as long as the empty question leaves no room for a single answer token and is refused at
    start; one more token is enough."""
    assert args.chat_context_problem(_fake_engine(context=20, empty_tokens=20)) is not None
    assert args.chat_context_problem(_fake_engine(context=21, empty_tokens=20)) is None


def test_context_refusal_names_the_default_this_export_allows():
    """The refusal quotes the default context this export can hold (its max_len when smaller than 4096), not one
    edge.load would itself refuse."""
    msg = args.chat_context_problem(_fake_engine(context=10, empty_tokens=30, max_len=256))
    assert "--context 10 cannot hold a chat" in msg and "(default 256)" in msg, msg
    assert "need 94 or more" in msg, msg


def test_a_base_model_needs_room_past_its_prefix_and_takes_no_system_prompt():
    assert args.chat_context_problem(_fake_engine(context=1, empty_tokens=1, chat=False)) is not None  # BOS alone
    assert args.chat_context_problem(_fake_engine(context=2, empty_tokens=1, chat=False)) is None
    msg = args.chat_context_problem(_fake_engine(context=256, empty_tokens=1, chat=False), system="be brief")
    assert msg.startswith("--system: m is a base model without a chat template") and "no system prompt" in msg, msg


# ----------------------------------------------------------------------------- engine flags

def test_engine_flags_shared_by_chat_and_serve():
    """Every engine drafter is selectable from edge-chat, and edge-serve takes exactly the engine flags that are
    edge.load keywords (one definition in edge.args.add_engine_args)."""
    import inspect

    import edge
    from edge.chat import _parser as chat_parser
    from edge.drafters import DRAFTER_CHOICES as DRAFTERS
    from edge.server.app import _parser as serve_parser

    for d in DRAFTERS:
        assert chat_parser().parse_args(["--drafter", d]).drafter == d
    load_kw = set(inspect.signature(edge.load).parameters)
    chat = {a.dest for a in chat_parser()._actions} & load_kw
    serve = {a.dest for a in serve_parser()._actions} & load_kw
    assert chat == serve and {"drafter", "threads", "context", "budget_mb", "verify"} <= serve


def test_commands_print_warnings_as_one_line_naming_the_command(capsys):
    """A warning a command prints (more threads than cores, say) is one line with the command's name, not Python's
    file:line and source line of edgespec's code."""
    import warnings

    from edge.args import plain_warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        plain_warnings("edge-chat")
        warnings.warn("3 threads on the 2 cores", RuntimeWarning)
    assert capsys.readouterr().err == "edge-chat: warning: 3 threads on the 2 cores\n"


@pytest.mark.parametrize("module,prog", [("edge.chat", "edge-chat"), ("edge.server.app", "edge-serve"),
                                         ("edge.tools.bench", "edge-bench"), ("edge.tools.profile", "edge-profile"),
                                         ("export.cli", "edge-export")])
def test_every_command_installs_the_one_line_warnings(monkeypatch, module, prog):
    import importlib

    import edge.args

    mod = importlib.import_module(module)
    seen = []
    monkeypatch.setattr(edge.args, "plain_warnings", seen.append)
    if hasattr(mod, "plain_warnings"):
        monkeypatch.setattr(mod, "plain_warnings", seen.append)
    monkeypatch.setattr(mod, "_parser", lambda: _Stop())
    with pytest.raises(_Stopped):
        mod.main([])
    assert seen == [prog]


class _Stopped(Exception):
    pass


class _Stop:
    """A parser whose parse_args gives arguments that stop main() when it first reads one."""

    def parse_args(self, argv):
        return _Halt()

    def error(self, msg):
        raise _Stopped


class _Halt:
    def __getattr__(self, name):
        raise _Stopped
