"""The runtime's errors. Every error edgespec raises on purpose is an EngineError, so an app embedding the API can
catch one class around load and generation; the message says what to change.

`memory/` and `devices/` are pure packages that never import the runtime: their errors (a budget plain decoding does
not fit, a profile that cannot be used) are re-raised at the runtime's boundary as the classes below, which are both
an EngineError and the pure package's class, so code catching either keeps working (`as_engine_error`)."""
from __future__ import annotations

from devices import ProfileError as _ProfileError
from devices import ProviderUnavailable as _ProviderUnavailable
from kernels.sampling import CorruptOutput
from memory.planner import BudgetError as _BudgetError
from memory.planner import PlanError as _PlanError


class EngineError(Exception):
    """Bad request or unusable state; the message says what to change."""


class CacheFull(EngineError):
    """A call would write past the KV cache's capacity."""


class ModelOutputError(EngineError, CorruptOutput):
    """The model's logits or probabilities are not finite (fp16 overflow, corrupt weights)."""


class CalibrationError(EngineError, ValueError):
    """An edge-profile calibration that cannot be used; the message names the file and the field."""


class ProfileError(EngineError, _ProfileError):
    """A device profile that cannot be used; the message names the file and the field."""


class ProviderUnavailable(EngineError, _ProviderUnavailable):
    """The profile's execution provider is not installed; the message names it and --simulate."""


class BudgetError(EngineError, _BudgetError):
    """Even plain decoding does not fit the memory budget (`fits`: the largest context that does)."""


class PlanError(EngineError, _PlanError):
    """A request the planner cannot serve for reasons other than memory."""


_WRAPPED = {_ProfileError: ProfileError, _ProviderUnavailable: ProviderUnavailable, _BudgetError: BudgetError,
            _PlanError: PlanError, CorruptOutput: ModelOutputError}


def as_engine_error(e: BaseException, message: str | None = None) -> EngineError:
    """The EngineError for an error from a pure package: same message (or `message`) and attributes; an
    EngineError is returned as it is (or re-messaged)."""
    if isinstance(e, EngineError) and message is None:
        return e
    cls = next((w for base, w in _WRAPPED.items() if isinstance(e, base)), EngineError)
    out = Exception.__new__(cls)
    Exception.__init__(out, str(e) if message is None else message)
    out.__dict__.update(getattr(e, "__dict__", {}))
    return out
