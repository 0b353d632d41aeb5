"""devices: every shipped profile loads and validates, host detection, missing execution providers (the error and
--simulate), and the validation messages for hand-written profiles."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import psutil
import pytest

import devices
from devices import (CPU_EP, HOST, DeviceProfile, ProfileError, ProviderUnavailable, available_providers,
                     check_available, detect_host, list_profiles, load_profile, profile_from_dict)

SHIPPED = [n for n in list_profiles() if n != HOST]
REQUIRED = {  # the profiles that must ship: name → (device class, execution provider)
    "laptop-cpu-16gb": ("cpu", "CPUExecutionProvider"),
    "nvidia-laptop-gpu-8gb": ("gpu", "CUDAExecutionProvider"),
    "apple-m3-16gb": ("gpu", "CoreMLExecutionProvider"),
    "snapdragon-x-npu": ("npu", "QNNExecutionProvider"),
    "intel-core-ultra-npu": ("npu", "OpenVINOExecutionProvider"),
    "android-phone-8gb": ("cpu", "CPUExecutionProvider"),
}


def test_the_required_profiles_ship():
    assert list_profiles()[0] == HOST
    assert set(REQUIRED) <= set(SHIPPED)
    for name, (cls, ep) in REQUIRED.items():
        p = load_profile(name)
        assert (p.device_class, p.execution_provider) == (cls, ep)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads_and_validates(name):
    p = load_profile(name)
    assert p.name == name and isinstance(p, DeviceProfile)
    assert 0 < p.budget_mb <= p.memory_total_mb
    assert p.bandwidth_gbs and p.bandwidth_gbs > 0
    assert len(p.source) > 40  # names the public spec
    if p.app_memory_cap_mb:
        assert p.budget_mb <= p.app_memory_cap_mb
    if p.device_class == "npu":  # NPUs run quantized weights, fp16 activations, fixed shapes
        assert p.static_shapes and "fp32" not in p.weight_precisions and p.activation_dtype == "float16"
        assert p.prefill_chunk in p.shape_buckets and 1 in p.shape_buckets
    json.dumps(p.to_dict())
    assert profile_from_dict(p.to_dict()) == p  # data round trip


def test_spec_numbers():
    """Bandwidths are the arithmetic of the cited specs."""
    assert load_profile("laptop-cpu-16gb").bandwidth_gbs == 5600e6 * 16 / 1e9  # DDR5-5600, 2 x 64 bit
    assert load_profile("nvidia-laptop-gpu-8gb").bandwidth_gbs == 16e9 * 128 / 8 / 1e9  # 16 Gbps x 128 bit
    assert load_profile("android-phone-8gb").bandwidth_gbs == 8400e6 * 8 / 1e9  # LPDDR5x-8400 x 64 bit
    assert load_profile("nvidia-laptop-gpu-8gb").provider_options["gpu_mem_limit"] == 6144 * 2**20


def test_host_detection():
    h = load_profile(HOST)
    vm = psutil.virtual_memory()
    cg = devices.cgroup_memory()
    assert h.name == HOST and h.device_class == "cpu" and h.execution_provider == CPU_EP
    assert h.memory_total_mb == (vm.total >> 20 if cg is None else min(vm.total >> 20, cg[0] >> 20))
    assert 0 < h.budget_mb <= (vm.total >> 20)
    assert h.cores >= 1 and CPU_EP in h.providers_installed
    assert set(h.weight_precisions) == {"fp32", "fp16", "int8", "int4", "w8a8"} and not h.static_shapes
    h2 = detect_host(providers=["CPUExecutionProvider", "CUDAExecutionProvider"])
    assert h2.providers_installed == ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert check_available(h) is h


GIB, USED, CACHE = "1073741824", "805306368", "536870912"  # 1 GiB limit, 768 MiB used of which 512 MiB page cache


def fake_cgroup(tmp_path, monkeypatch, own: str, files: dict) -> None:
    """A cgroup tree under tmp_path (`files`: path → text) and /proc/self/cgroup reading `own`."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(own)
    monkeypatch.setattr(devices, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(devices, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")


@pytest.mark.parametrize("own,files,left_mb", [
    ("0::/\n", {"memory.max": GIB + "\n", "memory.current": USED + "\n"}, 256),  # cgroup v2
    ("0::/\n", {"memory.max": GIB, "memory.current": USED, "memory.stat": f"anon 1\ninactive_file {CACHE}\n"},
     768),  # the inactive page cache is reclaimed first: not counted as used
    ("0::/app.slice\n", {"app.slice/memory.max": GIB, "app.slice/memory.current": USED}, 256),  # its own cgroup
    # a limit set on the slice binds the scope inside it: the scope's own room (2 GiB, nothing used) is not all
    ("0::/user.slice/u.slice/s.scope\n", {"user.slice/u.slice/s.scope/memory.max": str(2 * int(GIB)),
                                           "user.slice/u.slice/s.scope/memory.current": "0",
                                           "user.slice/u.slice/memory.max": "max",
                                           "user.slice/u.slice/memory.current": USED,
                                           "user.slice/memory.max": GIB, "user.slice/memory.current": USED}, 256),
    # the other way round: its own limit is the smaller one (the machine's size to it), the slice has less room
    ("0::/s.slice/a.scope\n", {"s.slice/a.scope/memory.max": GIB, "s.slice/a.scope/memory.current": "0",
                               "s.slice/memory.max": str(8 * int(GIB)),
                               "s.slice/memory.current": str(8 * int(GIB) - 512 * 2**20)}, 512),
    ("0::/a/b\n", {"a/b/memory.max": "max", "a/b/memory.current": "1", "a/memory.max": "max",
                   "a/memory.current": "1"}, None),  # no limit anywhere above it either
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": GIB, "memory/memory.usage_in_bytes": USED,
                      "memory/memory.stat": f"total_inactive_file {CACHE}\n"}, 768),  # v1
    ("0::/\n", {"memory.max": "max\n", "memory.current": USED}, None),
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "1"}, None),
    ("", {}, None)])
def test_host_budget_stays_inside_a_containers_memory_limit(tmp_path, monkeypatch, own, files, left_mb):
    """psutil reports the machine's RAM: inside a container limited to 1 GiB on a large machine the host budget
    was half of the machine's free RAM, and the process was killed at the container's limit instead."""
    fake_cgroup(tmp_path, monkeypatch, own, files)
    h = detect_host()
    if left_mb is not None:
        avail = psutil.virtual_memory().available >> 20
        assert h.memory_total_mb <= 1024
        assert h.budget_mb == max(1, int(min(avail, left_mb) * devices.HOST_BUDGET_FRACTION))
    else:
        assert h.memory_total_mb == psutil.virtual_memory().total >> 20


def test_missing_provider_error_names_it_and_the_simulate_flag():
    p = load_profile("snapdragon-x-npu")
    with pytest.raises(ProviderUnavailable) as e:
        check_available(p, providers=["CPUExecutionProvider"])
    msg = str(e.value)
    assert "QNNExecutionProvider" in msg and "--simulate" in msg and "onnxruntime-qnn" in msg
    assert "snapdragon-x-npu" in msg and "CPUExecutionProvider" in msg


@pytest.mark.parametrize("name", ["snapdragon-x-npu", "nvidia-laptop-gpu-8gb", "apple-m3-16gb"])
def test_simulation_keeps_budgets_and_shapes(name):
    p = load_profile(name)
    s = check_available(p, simulate=True, providers=["CPUExecutionProvider"])
    assert s.execution_provider == CPU_EP and s.simulated and s.simulated_provider == p.execution_provider
    assert dict(s.provider_options) == {} and s.providers == [CPU_EP]
    same = ("budget_mb", "memory_total_mb", "shape_buckets", "prefill_chunk", "weight_precisions",
            "activation_dtype", "app_memory_cap_mb", "device_class", "bandwidth_gbs")
    assert all(getattr(s, f) == getattr(p, f) for f in same)
    assert "simulated" in s.notes
    # with the provider installed nothing changes, simulate or not
    assert check_available(p, simulate=True, providers=[p.execution_provider, CPU_EP]) is p


def test_providers_argument_for_ort():
    p = load_profile("intel-core-ultra-npu")
    assert p.providers == [("OpenVINOExecutionProvider", {"device_type": "NPU", "precision": "FP16"}), CPU_EP]
    assert load_profile("laptop-cpu-16gb").providers == [CPU_EP]


def test_unknown_name_lists_the_profiles():
    with pytest.raises(ProfileError) as e:
        load_profile("pixel-99")
    assert "pixel-99" in str(e.value) and "laptop-cpu-16gb" in str(e.value) and HOST in str(e.value)


def test_load_from_a_path(tmp_path):
    d = load_profile("android-phone-8gb").to_dict()
    d.update(name="my-phone", budget_mb=1024)
    f = tmp_path / "my-phone.json"
    f.write_text(json.dumps(d))
    p = load_profile(str(f))
    assert p.name == "my-phone" and p.budget_mb == 1024
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(str(tmp_path / "broken.json"))
    with pytest.raises(ProfileError, match="no such"):
        load_profile(str(tmp_path / "absent.json"))
    with pytest.raises(ProfileError, match="a folder, not"):
        load_profile(str(tmp_path) + "/")
    (tmp_path / "binary.json").write_bytes(b"\xfc\x00GGUF")
    with pytest.raises(ProfileError, match="binary.json: cannot read it as a device profile"):
        load_profile(str(tmp_path / "binary.json"))


BASE = load_profile("snapdragon-x-npu").to_dict()


@pytest.mark.parametrize("change, field", [
    (dict(colour="red"), "unknown field"),
    (dict(device_class="tpu"), "device_class"),
    (dict(execution_provider="QNN"), "execution_provider"),
    (dict(budget_mb=20000), "budget_mb"),
    (dict(budget_mb=0), "budget_mb"),
    (dict(weight_precisions=["int3"]), "weight_precisions"),
    (dict(weight_precisions=[]), "weight_precisions"),
    (dict(activation_dtype="bfloat16"), "activation_dtype"),
    (dict(shape_buckets=[8, 4]), "shape_buckets"),
    (dict(shape_buckets=[0, 4]), "shape_buckets"),
    (dict(prefill_chunk=100), "prefill_chunk"),
    (dict(app_memory_cap_mb=100), "app_memory_cap_mb"),
    (dict(bandwidth_gbs=0), "bandwidth_gbs"),
    (dict(source="  "), "source"),
    (dict(cores=0), "cores"),
    # wrong types were tracebacks (TypeError, AttributeError) far from the file
    (dict(shape_buckets=8), "shape_buckets must be a list"),
    (dict(weight_precisions="w8a8"), "weight_precisions must be a list"),
    (dict(execution_provider=5), "execution_provider must be a string"),
    (dict(source=[]), "source must be a string"),
    (dict(provider_options=[1, 2]), "provider_options must be a JSON object"),
    (dict(calibration=[1]), "calibration must be a JSON object"),
    # JSON true is not the integer 1 (it loaded as a 1 MB budget, one core, a 1-row prefill)
    (dict(budget_mb=True), "budget_mb"),
    (dict(cores=True), "cores"),
    (dict(prefill_chunk=True), "prefill_chunk"),
    (dict(shape_buckets=[True, 512], prefill_chunk=512), "shape_buckets"),
])
def test_validation_names_the_field(change, field):
    with pytest.raises(ProfileError, match=field):
        profile_from_dict({**BASE, **change}, "test.json")


def test_a_profiles_own_calibration_is_checked_naming_the_profile(tmp_path):
    from edge.planning import CalibrationError, profile_for

    f = tmp_path / "p.json"
    f.write_text(json.dumps({**load_profile("laptop-cpu-16gb").to_dict(),
                             "calibration": {"memory": {"baseline_mb": "x"}}}))
    with pytest.raises(CalibrationError, match=f"device profile {f}: calibration: .*baseline_mb must be a number"):
        profile_for(str(f))


def test_missing_fields_are_named():
    d = dict(BASE)
    del d["budget_mb"], d["source"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) \['budget_mb', 'source'\]"):
        profile_from_dict(d, "x.json")


def test_profiles_are_hashable_frozen_data():
    p = load_profile("apple-m3-16gb")
    with pytest.raises(Exception):
        p.budget_mb = 1  # frozen
    assert replace(p, budget_mb=4096).budget_mb == 4096
    assert hash(p) == hash(load_profile("apple-m3-16gb"))


def test_devices_imports_onnxruntime_only_when_asked():
    code = ("import sys, devices; devices.load_profile('laptop-cpu-16gb'); "
            "assert 'onnxruntime' not in sys.modules; devices.available_providers(); "
            "assert 'onnxruntime' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert CPU_EP in available_providers()


def _cgroup(tmp_path, monkeypatch, own, files):
    fake_cgroup(tmp_path, monkeypatch, own, files)
    return devices.cgroup_memory()


ONE_GIB = 1 << 30


@pytest.mark.parametrize("own,files,want", [
    # v1 writes "no limit" as a page-rounded 2^63: not a limit
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "1"}, None),
    # more inactive page cache than usage (counters read at different moments): the working set is 0, not < 0
    ("0::/\n", {"memory.max": str(ONE_GIB), "memory.current": str(100 << 20),
                "memory.stat": f"inactive_file {200 << 20}\n"}, (ONE_GIB, ONE_GIB)),
    # over the limit (the kernel is reclaiming): no room, not negative room
    ("0::/\n", {"memory.max": str(ONE_GIB), "memory.current": str(ONE_GIB + (64 << 20))}, (ONE_GIB, 0)),
    # cgroup v2 present without a limit is the answer: a stale v1 hierarchy is not consulted
    ("0::/\n4:memory:/\n", {"memory.max": "max", "memory.current": "1", "memory/memory.limit_in_bytes": str(ONE_GIB),
                            "memory/memory.usage_in_bytes": "1"}, None),
])
def test_cgroup_memory_edge_cases(tmp_path, monkeypatch, own, files, want):
    assert _cgroup(tmp_path, monkeypatch, own, files) == want


@pytest.mark.parametrize("change, field", [
    (dict(app_memory_cap_mb=BASE["memory_total_mb"] + 1), "app_memory_cap_mb"),
    (dict(shape_buckets=[1, 4, 4, 8]), "shape_buckets"),
    (dict(shape_buckets=[1, 2.5, 8]), "shape_buckets"),
    (dict(memory_total_mb=16000.5), "memory_total_mb"),
    (dict(prefill_chunk=6), "prefill_chunk"),  # below the largest bucket but not one of them
])
def test_inconsistent_profile_fields_are_refused_by_name(change, field):
    with pytest.raises(ProfileError, match=field):
        profile_from_dict({**BASE, **change}, "test.json")


def test_budget_may_be_all_of_the_memory_and_profiles_round_trip_as_tuples(tmp_path, monkeypatch):
    p = profile_from_dict({**BASE, "budget_mb": BASE["memory_total_mb"], "app_memory_cap_mb": None})
    assert p.budget_mb == p.memory_total_mb
    p = profile_from_dict({**BASE, "providers_installed": ["CPUExecutionProvider"]})
    assert p.providers_installed == ("CPUExecutionProvider",) and hash(p)
    s = devices.check_available(load_profile("snapdragon-x-npu"), simulate=True, providers=["CPUExecutionProvider"])
    assert s.simulated_provider == "QNNExecutionProvider"
    (tmp_path / "mine.json").write_text(json.dumps({**BASE, "name": "mine"}))
    monkeypatch.chdir(tmp_path)
    assert load_profile("mine.json").name == "mine"  # a bare file name ending in .json is a path
