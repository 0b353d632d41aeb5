"""edgespec runtime: `edge.load()` → an Engine with `generate`, `stream` and `chat`.

    import edge
    engine = edge.load()                      # the embedded SmolLM2-135M-Instruct (exported on first use)
    print(engine.generate("Name three rivers.", max_tokens=64).text)
    base = edge.load("gemma3-270m")           # a model known by name (a base model); or edge.load("path/to/export")
"""
from __future__ import annotations

import numbers
import os
from pathlib import Path

from .engine import Chat, Chunk, ContextFull, Engine, EngineBusy, GenerationParams, GenerationResult, Stats
from .errors import (BudgetError, CacheFull, CalibrationError, EngineError, ModelOutputError, PlanError, ProfileError,
                     ProviderUnavailable)
from .files import default_model_dir, home, unwritable_dir
from .manifest import ModelDirError
from .text import ChatTemplateError

__all__ = ["load", "resolve_model", "Engine", "Chat", "Chunk", "GenerationParams", "GenerationResult", "Stats",
           "home", "default_model_dir", "__version__",
           # errors: every one an EngineError
           "EngineError", "EngineBusy", "ContextFull", "ModelDirError", "ChatTemplateError", "BudgetError", "PlanError",
           "ProfileError", "ProviderUnavailable", "CalibrationError", "CacheFull", "ModelOutputError"]

def _version() -> str:
    try:
        from importlib.metadata import version

        return version("edgespec")
    except Exception:  # running from a source tree that was never installed
        return "0+unknown"


__version__ = _version()


def resolve_model(model: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The model directory `model` names: a directory as it is; a model edgespec knows by name (`export.catalog`:
    "smollm2-135m", the default for None, or "gemma3-270m") exported into its cache directory on first use, or again
    when an older graph builder wrote it. An unknown name is a ModelDirError listing the known ones; a named model
    whose package is not installed, one naming the package and the pip command.
    The export runs in a child process (`python -m export.cli --model NAME`): its ~1.7 GB peak, and what the
    allocator keeps of it afterwards, never become this process's memory. (`edge` reaches into `export` only here,
    and for the names --model lists in its help.)"""
    import subprocess
    import sys

    from export.catalog import resolve

    from .manifest import GRAPH_VERSION, load_manifest

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ModelDirError(f"model must be a directory or a model name, a string or a path (got "
                            f"{type(model).__name__} {model!r:.40})")
    named = resolve(model)
    if isinstance(named, Path):
        return named
    d = named.export_dir
    try:
        if load_manifest(d, verify="size").source.get("graph_version") == GRAPH_VERSION:
            return d
    except ModelDirError:
        pass
    missing = named.missing()
    if missing:
        raise ModelDirError(missing)
    problem = unwritable_dir(d.parent)  # a read-only mount, a directory of another user
    if problem:
        raise ModelDirError(f"model cache: {problem}: named models are exported there on first use; set "
                            "EDGESPEC_HOME to a writable directory")
    # progress and errors go to stderr; its stdout summary is not ours (edge-chat --json owns stdout)
    quiet = [] if progress else ["--quiet"]
    r = subprocess.run([sys.executable, "-m", "export.cli", "--model", named.name, *quiet], stdout=subprocess.DEVNULL)
    if r.returncode != 0:
        raise ModelDirError(f"building {named.title} into {d} failed (exit {r.returncode}, message above); re-run: "
                            f"{named.rebuild_command}")
    return d


def load(model: str | os.PathLike | None = None, *, drafter: str = "auto", device: str | None = None,
         budget_mb: float | None = None, threads: int | None = None, context: int | None = None,
         progress: bool = True, simulate: bool = False, calibration: str | os.PathLike | None = None,
         verify: str = "fast") -> Engine:
    """Load a model: an exported model directory, or a model edgespec knows by name ("smollm2-135m", the default;
    "gemma3-270m"), exported from its PyPI package on first use (`resolve_model`).

    `device` (a profile name from `devices`, or "host") and/or `budget_mb` turn on the memory planner: it picks
    drafter and draft length that fit, and re-plans as a chat's context grows. A profile whose execution provider
    is not installed is refused unless `simulate=True` (same budgets and shapes, CPU kernels). `calibration`: an
    edge-profile calibration JSON for the planner (default: the one `edge-profile --install` left for this model).
    `threads`: ONNX Runtime's threads (default 2, or fewer when this process may use fewer cores).
    `verify`: "fast" checks every file's size and the sha256 of the small ones; "sha256" hashes everything (0.5 s
    for the embedded model), "size" only sizes."""
    if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, numbers.Real)):
        raise EngineError(f"budget_mb must be a number of megabytes (got {budget_mb!r})")
    if budget_mb is not None and not budget_mb > 0:
        raise EngineError(f"budget_mb must be positive (got {budget_mb})")
    d = resolve_model(model, progress)
    profile = None
    if device is not None or budget_mb is not None or calibration is not None:
        from .planning import profile_for

        profile = profile_for(device, simulate, calibration, d)  # ProfileError, CalibrationError: EngineErrors
    providers = profile.providers if profile is not None else ("CPUExecutionProvider",)
    return Engine(d, drafter=drafter, threads=threads, context=context, providers=providers, profile=profile,
                  budget_mb=budget_mb, verify=verify)
