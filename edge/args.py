"""What the command-line tools share: argparse types that refuse bad values before a model loads, the model flag and
the engine flags edge-chat and edge-serve both take, --version, the start-up check of a chat's context, and Ctrl-C
detection."""
from __future__ import annotations

import argparse
import sys

from .drafters import DRAFTER_CHOICES
from .engine import DEFAULT_CONTEXT


def int_at_least(minimum: int, maximum: int | None = None):
    """argparse type: a whole number >= minimum (and <= maximum, if given)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum or (maximum is not None and n > maximum):
            raise argparse.ArgumentTypeError(f"{n} must be at least {minimum}" if maximum is None else
                                             f"{n} must be in [{minimum}, {maximum}]")
        return n
    parse.__name__ = ("positive_int" if minimum == 1 else f"int_at_least_{minimum}") if maximum is None else \
        f"int_in_{minimum}_{maximum}"  # argparse names it in errors
    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def float_where(ok, what: str, name: str):
    """argparse type: a number x with ok(x) (NaN fails every comparison, so it never passes); `what` completes
    "must be …" in the error, `name` is what argparse calls the type."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return x
    parse.__name__ = name
    return parse


positive_float = float_where(lambda x: 0 < x < float("inf"), "a positive number", "positive_float")
non_negative_float = float_where(lambda x: 0 <= x < float("inf"), "a finite number >= 0", "non_negative_float")
unit_fraction = float_where(lambda x: 0 < x <= 1, "in (0, 1]", "unit_fraction")  # a probability mass (top-p)


def non_empty(text: str) -> str:
    """argparse type: a non-empty string."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def messages(prompt: str, system: str | None = None) -> list[dict]:
    """One question as chat messages, after the --system prompt if there is one."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_context_problem(engine, system: str | None = None) -> str | None:
    """Why the loaded engine cannot hold a chat at all (its context is shorter than an empty question, with the
    chat template and the system prompt, plus one answer token; for a base model, than the tokenizer's own prefix
    plus one token), or None; and a system prompt for a base model, which has none. edge-chat and edge-serve refuse
    such a --context at start instead of refusing every question."""
    from .engine import base_model
    from .errors import EngineError

    if not engine.has_chat_template:
        if system:
            return f"--system: {base_model(engine.manifest.name)}, and has no system prompt: start your text with it"
        empty, what = len(engine.encode("", raw=True)), "before any text (the tokenizer's own prefix)"
    else:
        try:
            empty = len(engine.encode(messages("", system)))
        except EngineError as e:  # the chat template refuses or fails on a plain question: say so at start
            return str(e)
        what = "with the chat template" + (" and the system prompt" if system else "") + " for an empty question"
    if engine.context > empty:
        return None
    return (f"--context {engine.context} cannot hold a chat: it is already {empty} tokens {what}; short exchanges "
            f"need {empty + 64} or more (default {min(DEFAULT_CONTEXT, engine.manifest.target.max_len)})")


def add_model_arg(parser: argparse.ArgumentParser, *flags: str) -> None:
    """The model flag (`--model` unless `flags` say otherwise; its value in `model`): an exported model directory,
    or a model edgespec knows by name (`edge.resolve_model`)."""
    from export.catalog import DEFAULT, MODELS  # the names edge.load takes

    known = ", ".join(f"{m.name} ({m.title}{'' if m.chat else ', a base model without a chat template'}"
                      f"{', the default' if m.name == DEFAULT else ''}; {m.pip})" for m in MODELS.values())
    parser.add_argument(*(flags or ("--model",)), dest="model", metavar="DIR|NAME",
                        help=f"exported model directory (edge-export), or a model edgespec knows by name, exported "
                             f"from its PyPI package into $EDGESPEC_HOME on first use and reused after: {known}. A "
                             "directory of that name wins. Default: the embedded model")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags that become `edge.load` keywords (drafter, threads, context, device, budget, calibration,
    verify, simulate), in their own help group; edge-chat and edge-serve both take them."""
    group = parser.add_argument_group("engine")
    group.add_argument("--drafter", choices=list(DRAFTER_CHOICES), default="auto",
                       help="speculative drafter: lookup = prompt/history n-gram lookup, recycling = Token Recycling "
                            "(the target's own top-k successors), hybrid = each step the lookup span or the recycling "
                            "chain, whichever is expected to gain more per millisecond, model = the export's drafter "
                            "graph (early-exit, or a small checkpoint: edge-export --drafter-checkpoint), none = "
                            "plain decoding (the lossless reference), auto = chosen from what the export measured; "
                            "with --device/--budget-mb the memory plan chooses (default auto)")
    group.add_argument("--threads", type=positive_int,
                       help="CPU threads for ONNX Runtime (default 2, or fewer when this process may use fewer cores; "
                            "more threads than cores makes every step several times slower)")
    group.add_argument("--context", type=positive_int,
                       help="context window in tokens (default 4096, or the export's maximum if that is smaller)")
    group.add_argument("--device", help="device profile for the memory planner: host, laptop-cpu-16gb, "
                                        "nvidia-laptop-gpu-8gb, apple-m3-16gb, snapdragon-x-npu, intel-core-ultra-npu, "
                                        "android-phone-8gb, or a profile JSON path")
    group.add_argument("--budget-mb", type=positive_float,
                       help="memory budget in MB; the planner picks drafter and draft length that fit and shrinks "
                            "them as the chat grows")
    group.add_argument("--calibration", metavar="JSON",
                       help="edge-profile's calibration.json for the planner (measured latency, acceptance, memory "
                            "baseline); default, when the planner runs on the host profile (--budget-mb without "
                            "--device, or --device host): the one `edge-profile --install` left for this model, if any")
    group.add_argument("--verify", choices=("fast", "sha256", "size"), default="fast",
                       help="how the model's files are checked at load: fast = every size, and the sha256 of the "
                            "small files (graphs, tokenizer); sha256 = every file's hash against the manifest, "
                            "which finds corrupted weights (about 0.5 s for the embedded model); size = sizes only "
                            "(default fast)")
    group.add_argument("--simulate", action="store_true",
                       help="run a device profile whose execution provider is not installed on the CPU (same budget "
                            "and shape limits)")


def plain_warnings(prog: str) -> None:
    """Python warnings (more threads than cores, a w8a8 export on a CPU whose int8 sums saturate) as one line
    `prog: warning: ...` on stderr, without the file and source line Python prints: they name edgespec's code,
    which a command's user did not write."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show


def add_version(parser: argparse.ArgumentParser) -> None:
    """--version: prints the program's name and edgespec's version (`edge-chat 0.1.0`) and exits 0."""
    from . import __version__  # (edge/__init__ is complete by the time a CLI builds its parser)

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the program's name and edgespec's version and exit")


def was_interrupted(e: BaseException) -> bool:
    """Ctrl-C, or an import that failed because Ctrl-C hit it (onnxruntime's module init re-raises it as
    ImportError)."""
    seen = set()
    while e is not None and id(e) not in seen:  # a chain may loop back on itself
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
