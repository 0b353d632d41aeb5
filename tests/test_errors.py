"""One error base: every error the runtime raises on purpose is an `edge.EngineError`; the pure packages' errors
(memory, devices, kernels) cross the runtime's boundary as classes that are both an EngineError and their own."""
from __future__ import annotations

import numpy as np
import pytest

import devices
import edge
import memory.planner
from edge.errors import as_engine_error
from kernels.sampling import CorruptOutput, make_sampler


@pytest.mark.parametrize("name", [n for n in edge.__all__ if n.endswith(("Error", "Full", "Busy", "Unavailable"))])
def test_every_public_error_is_an_engine_error(name):
    assert issubclass(getattr(edge, name), edge.EngineError)


@pytest.mark.parametrize("pure, wrapped", [
    (devices.ProfileError("p"), edge.ProfileError),
    (devices.ProviderUnavailable("p"), edge.ProviderUnavailable),
    (memory.planner.BudgetError(900.0, 100.0, 4096, fits=512), edge.BudgetError),
    (memory.planner.PlanError("p"), edge.PlanError),
    (CorruptOutput("logits contain NaN"), edge.ModelOutputError),
])
def test_a_pure_packages_error_keeps_its_class_message_and_attributes(pure, wrapped):
    e = as_engine_error(pure)
    assert type(e) is wrapped and isinstance(e, type(pure)) and isinstance(e, edge.EngineError)
    assert str(e) == str(pure) and e.__dict__ == pure.__dict__
    assert str(as_engine_error(pure, "other")) == "other"


def test_an_unknown_device_at_load_is_a_profile_error(tiny_dir):
    with pytest.raises(edge.ProfileError, match="unknown device"):
        edge.load(tiny_dir, device="no-such-device")


def test_a_budget_nothing_fits_at_load_is_a_budget_error_naming_what_fits(tiny_dir):
    with pytest.raises(edge.BudgetError) as info:
        edge.load(tiny_dir, budget_mb=0.01)
    assert isinstance(info.value, memory.planner.BudgetError) and "planned at load" in str(info.value)


def test_an_unreadable_calibration_is_a_calibration_error(tiny_dir, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    with pytest.raises(edge.CalibrationError, match="not valid JSON"):
        edge.load(tiny_dir, budget_mb=500, calibration=bad)


def test_a_call_past_the_cache_is_cache_full():
    from edge.kv import KVCache

    c = KVCache(1, 1, 4, capacity=8)
    c.append(8)
    with pytest.raises(edge.CacheFull):
        c.check_room(1)


def test_non_finite_logits_are_a_model_output_error_from_the_kernels():
    with pytest.raises(CorruptOutput):
        make_sampler(0.7, 0, 1.0)(np.array([np.nan, 1.0], np.float32), np.random.default_rng(0))
    assert issubclass(edge.ModelOutputError, ValueError)  # code catching ValueError keeps working


def test_load_takes_its_options_by_keyword(tiny_dir):
    with pytest.raises(TypeError):
        edge.load(tiny_dir, "none")


def test_the_package_has_a_version():
    assert isinstance(edge.__version__, str) and edge.__version__
