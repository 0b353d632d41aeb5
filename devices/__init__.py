"""Device profiles: data files (devices/profiles/*.json) read into frozen `DeviceProfile`s, plus host detection.

A profile says what a device offers — the memory the runtime may use, bandwidth, the ONNX Runtime execution
provider and its options, the weight precisions it runs, the static shape buckets an NPU was compiled for — and
which public spec the numbers come from. It never decides draft lengths: that is `memory.planner`'s job.

    from devices import load_profile, check_available
    p = check_available(load_profile("snapdragon-x-npu"), simulate=True)   # QNN missing → CPU, same budget/buckets
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from memory.footprint import PRECISIONS  # the weight precisions the footprint model prices

DEVICE_CLASSES = ("cpu", "gpu", "npu")
ACTIVATION_DTYPES = ("float32", "float16")
CPU_EP = "CPUExecutionProvider"
HOST = "host"
HOST_BUDGET_FRACTION = 0.5  # of the RAM available when the host is detected: leave the rest to everything else
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where a container's memory limit is read (cgroup v2, else v1)
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup path under it (a systemd slice, a container)
# How to get an execution provider that this onnxruntime build lacks (named in the error).
EP_INSTALL = {
    "CUDAExecutionProvider": "pip install onnxruntime-gpu (NVIDIA driver + CUDA 12)",
    "CoreMLExecutionProvider": "the standard onnxruntime wheel on macOS (Apple silicon)",
    "QNNExecutionProvider": "pip install onnxruntime-qnn on a Windows-on-Snapdragon machine",
    "OpenVINOExecutionProvider": "pip install onnxruntime-openvino (Intel NPU driver)",
    "DmlExecutionProvider": "pip install onnxruntime-directml on Windows",
}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


class ProviderUnavailable(RuntimeError):
    """The profile's execution provider is not installed; the message names it, how to get it, and --simulate."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    device_class: str  # cpu | gpu | npu
    execution_provider: str  # an ONNX Runtime provider name
    memory_total_mb: int  # physical memory the device has (RAM, VRAM or unified)
    budget_mb: int  # what the runtime may use of it
    bandwidth_gbs: float | None  # peak memory bandwidth (None: not known, e.g. an undetected host)
    weight_precisions: tuple[str, ...]  # exported weight precisions it runs
    activation_dtype: str  # float32 | float16
    source: str  # the public spec the numbers were taken from
    provider_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    shape_buckets: tuple[int, ...] = ()  # rows per call the compiled graphs accept; () = dynamic shapes
    prefill_chunk: int = 256  # rows per prefill call (a bucket on static-shape devices; memory.footprint.PREFILL_CHUNK)
    cores: int | None = None
    app_memory_cap_mb: int | None = None  # a per-app limit below the device's memory (phones)
    notes: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict, hash=False)  # memory/latency/acceptance sections
    providers_installed: tuple[str, ...] = ()  # host detection only
    simulated: bool = False  # running on the CPU EP with this profile's budgets and shape constraints
    simulated_provider: str | None = None  # the provider being simulated

    def __post_init__(self):
        _validate(self)

    @property
    def static_shapes(self) -> bool:
        return bool(self.shape_buckets)

    @property
    def providers(self) -> list:
        """The `providers=` argument for onnxruntime.InferenceSession (the EP with its options, then the CPU)."""
        first = (self.execution_provider, dict(self.provider_options)) if self.provider_options else \
            self.execution_provider
        return [first] if self.execution_provider == CPU_EP else [first, CPU_EP]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["provider_options"], d["calibration"] = dict(self.provider_options), dict(self.calibration)
        return d


def _whole(x) -> bool:
    """An integer in JSON's sense: `true` is not 1 MB or one core."""
    return isinstance(x, int) and not isinstance(x, bool)


def _validate(p: DeviceProfile) -> None:
    def bad(fieldname: str, why: str):
        raise ProfileError(f"device profile {p.name!r}: {fieldname} {why}")

    if not p.name or not isinstance(p.name, str):
        bad("name", "must be a non-empty string")
    for f in ("description", "device_class", "execution_provider", "activation_dtype", "source", "notes"):
        if not isinstance(getattr(p, f), str):
            bad(f, f"must be a string (got {getattr(p, f)!r})")
    for f in ("provider_options", "calibration"):
        if not isinstance(getattr(p, f), Mapping):
            bad(f, f"must be a JSON object (got {getattr(p, f)!r})")
    if p.device_class not in DEVICE_CLASSES:
        bad("device_class", f"{p.device_class!r} is not one of {', '.join(DEVICE_CLASSES)}")
    if not p.execution_provider.endswith("ExecutionProvider"):
        bad("execution_provider", f"{p.execution_provider!r} is not an ONNX Runtime provider name")
    if not (_whole(p.memory_total_mb) and p.memory_total_mb > 0):
        bad("memory_total_mb", f"must be a positive integer (got {p.memory_total_mb!r})")
    if not (_whole(p.budget_mb) and 0 < p.budget_mb <= p.memory_total_mb):
        bad("budget_mb", f"must be a positive integer <= memory_total_mb {p.memory_total_mb} (got {p.budget_mb!r})")
    if p.app_memory_cap_mb is not None and not 0 < p.budget_mb <= p.app_memory_cap_mb <= p.memory_total_mb:
        bad("app_memory_cap_mb", f"must lie between budget_mb and memory_total_mb (got {p.app_memory_cap_mb!r})")
    if p.bandwidth_gbs is not None and not p.bandwidth_gbs > 0:
        bad("bandwidth_gbs", f"must be positive or null (got {p.bandwidth_gbs!r})")
    if not p.weight_precisions or any(x not in PRECISIONS for x in p.weight_precisions):
        bad("weight_precisions", f"must be a non-empty subset of {', '.join(PRECISIONS)} (got {p.weight_precisions})")
    if p.activation_dtype not in ACTIVATION_DTYPES:
        bad("activation_dtype", f"{p.activation_dtype!r} is not one of {', '.join(ACTIVATION_DTYPES)}")
    b = p.shape_buckets
    if any(not _whole(x) or x < 1 for x in b) or list(b) != sorted(set(b)):
        bad("shape_buckets", f"must be strictly increasing positive integers (got {list(b)})")
    if not (_whole(p.prefill_chunk) and p.prefill_chunk >= 1):
        bad("prefill_chunk", f"must be a positive integer (got {p.prefill_chunk!r})")
    if b and p.prefill_chunk not in b:
        bad("prefill_chunk", f"{p.prefill_chunk} must be one of the shape buckets {list(b)}")
    if p.cores is not None and not (_whole(p.cores) and p.cores >= 1):
        bad("cores", f"must be a positive integer or null (got {p.cores!r})")
    if not p.source.strip():
        bad("source", "must name the public spec the numbers come from")


# ---------------------------------------------------------------------------------------------- files
def _profiles_dir():
    return resources.files(__name__) / "profiles"


def list_profiles() -> list[str]:
    """"host" (detected) and every shipped profile, by name."""
    names = sorted(p.name[:-5] for p in _profiles_dir().iterdir() if p.name.endswith(".json"))
    return [HOST] + names


def profile_from_dict(d: Mapping[str, Any], where: str = "<dict>") -> DeviceProfile:
    known = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    missing = sorted(f.name for f in fields(DeviceProfile)
                     if f.name not in d and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise ProfileError(f"{where}: missing field(s) {missing}")
    d = dict(d)
    for k in ("weight_precisions", "shape_buckets", "providers_installed"):
        if k in d:
            if not isinstance(d[k], (list, tuple)):
                raise ProfileError(f"{where}: {k} must be a list (got {d[k]!r})")
            d[k] = tuple(d[k])
    try:
        return DeviceProfile(**d)
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from None
    except TypeError as e:
        raise ProfileError(f"{where}: {e}") from None


def load_profile(name: str) -> DeviceProfile:
    """A shipped profile by name, "host" (detected now), or a path to a profile JSON file."""
    if name == HOST:
        return detect_host()
    if name.endswith(".json") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ProfileError(f"{path}: {'a folder, not' if path.is_dir() else 'no such'} device profile file")
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"{path}: cannot read it as a device profile (JSON text): {e}") from None
    else:
        f = _profiles_dir() / f"{name}.json"
        if not f.is_file():
            raise ProfileError(f"unknown device {name!r}; choose one of: {', '.join(list_profiles())} "
                               "(or give a path to a profile .json)")
        text, where = f.read_text(), f"devices/profiles/{name}.json"
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ProfileError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    return profile_from_dict(d, where)


# ---------------------------------------------------------------------------------------------- the host
def available_providers() -> list[str]:
    """ONNX Runtime's installed execution providers (imported lazily: devices/ only needs this one call)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask, which containers and `taskset` narrow (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this OS
        return os.cpu_count() or 1


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, room) in bytes over this process's memory cgroup and every cgroup above it (a container's, a
    systemd scope's, the slice around it: each limit binds everything inside it), which psutil's RAM figures do
    not see: the smallest limit and the least room left under any of them; None where none has a limit. Room is
    the limit less the working set: the usage less the inactive page cache the kernel reclaims first (as docker and
    the kubelet count it)."""
    try:
        own = {line.split(":", 2)[1]: line.split(":", 2)[2].strip().strip("/")
               for line in PROC_SELF_CGROUP.read_text().splitlines() if line.count(":") >= 2}
    except OSError:
        own = {}
    layouts = (("", own.get(""), "memory.max", "memory.current", "inactive_file"),  # v2
               ("memory", own.get("memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    for sub, path, limit_file, usage_file, inactive in layouts:
        parts = path.split("/") if path else []
        found, limits, rooms = False, [], []
        for depth in range(len(parts), -1, -1):  # its own cgroup, each one above it, the root
            d = CGROUP_ROOT / sub / "/".join(parts[:depth])
            try:
                limit = (d / limit_file).read_text().strip()
                usage = int((d / usage_file).read_text().strip())
            except (OSError, ValueError):
                continue
            found = True
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes "no limit" as ~2^63
                continue
            try:
                stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines() if " " in line)
                usage -= min(int(stat.get(inactive, 0)), usage)
            except (OSError, ValueError):
                pass
            limits.append(int(limit))
            rooms.append(max(int(limit) - usage, 0))
        if found:
            return (min(limits), min(rooms)) if limits else None
    return None


def detect_host(providers: list[str] | None = None) -> DeviceProfile:
    """This machine, as a CPU profile: total/available RAM and cores from psutil (within the process's memory
    cgroup limit, if it has one), installed ORT providers. Budget: HOST_BUDGET_FRACTION of the RAM available."""
    import psutil

    vm = psutil.virtual_memory()
    total_mb, avail_mb = vm.total >> 20, vm.available >> 20
    cg = cgroup_memory()
    if cg is not None:  # a container: what the machine has free is not what this process may use
        total_mb = min(total_mb, cg[0] >> 20)
        avail_mb = min(avail_mb, cg[1] >> 20)
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    installed = tuple(providers if providers is not None else available_providers())
    return DeviceProfile(
        name=HOST, description=f"this machine: {total_mb} MB RAM ({avail_mb} MB available), {cores} cores",
        device_class="cpu", execution_provider=CPU_EP, memory_total_mb=max(total_mb, 1),
        budget_mb=max(1, min(total_mb, int(avail_mb * HOST_BUDGET_FRACTION))), bandwidth_gbs=None,
        weight_precisions=PRECISIONS, activation_dtype="float32", cores=cores, providers_installed=installed,
        source="detected at run time: psutil.virtual_memory() and cpu_count(), the memory cgroup's limit, "
               "onnxruntime.get_available_providers(); bandwidth not measured",
        notes=f"budget = {HOST_BUDGET_FRACTION:.0%} of the RAM available at detection")


# CPU features that decide which kernels ONNX Runtime's MLAS takes (and so the fastest exact graph layout)
KERNEL_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "asimddp", "sve", "i8mm")


def cpu_features() -> str:
    """The CPU's model name and the kernel-deciding features it has, as one line ("unknown" off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.lower().startswith(("model name", "cpu model", "hardware"))), "unknown")
    flags = set()
    for line in info.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags |= set(line.split(":", 1)[1].split())
    return " ".join([model] + [f for f in KERNEL_FEATURES if f in flags])


@functools.lru_cache(maxsize=None)
def int8_gemm_exact() -> bool:
    """Does this host's ONNX Runtime sum uint8 x int8 products exactly (MatMulIntegerToFloat with int8 weights, the
    MLAS u8s8 GEMM)? Not on x86 CPUs without VNNI (AVX2, AVX-512 without VNNI): there MLAS adds products in pairs
    with a saturating 16-bit instruction (vpmaddubsw), so 2 x 200 x 127 comes out as 32767. Measured on a 2-core AMD
    EPYC (Zen 3, AVX2): errors as large as the products themselves on activations around the zero point.
    w8a8 exports then store their weights as uint8 (the u8u8 GEMM widens to 16 bits first; exact on every CPU).
    One tiny graph, run once per process; False also when ONNX Runtime cannot run it (the safe choice)."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return False
    # a pair of 200 x 127 products overflows int16; the exact sums are 64 x 72 x 127 = 585216. Two rows and 16
    # columns, so MLAS' multi-row kernel is what runs (a model's wider calls use it)
    k, n = 64, 16
    a = np.full((2, k), 200, np.uint8)
    w = np.full((k, n), 127, np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(1, np.float32), "a_scale"),
             numpy_helper.from_array(np.ones(n, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "a_zero")]
    node = helper.make_node("MatMulIntegerToFloat", ["a", "w", "a_scale", "w_scale", "a_zero"], ["y"],
                            domain="com.microsoft")
    graph = helper.make_graph([node], "int8_gemm_probe",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # ORT 1.31 loads IR <= 13
    try:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 1, 3
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=[CPU_EP])
        y = sess.run(None, {"a": a})[0]
    except Exception:  # noqa: BLE001  (an ORT without the op: callers take the exact-everywhere layout)
        return False
    want = (a.astype(np.int64) - 128) @ w.astype(np.int64)
    return bool(np.array_equal(y, want.astype(np.float32)))


def check_available(profile: DeviceProfile, simulate: bool = False,
                    providers: list[str] | None = None) -> DeviceProfile:
    """The profile if its execution provider is installed. Otherwise: with simulate=True, the same profile on the
    CPU EP (same budgets, precision limits and shape buckets; CPU kernels), else ProviderUnavailable."""
    installed = providers if providers is not None else available_providers()
    ep = profile.execution_provider
    if ep in installed:
        return profile
    if simulate:
        return replace(profile, execution_provider=CPU_EP, provider_options={}, simulated=True,
                       simulated_provider=ep,
                       notes=(profile.notes + " " if profile.notes else "") + f"simulated on the CPU (no {ep})")
    how = EP_INSTALL.get(ep, f"an onnxruntime build with {ep}")
    raise ProviderUnavailable(
        f"device {profile.name!r} needs {ep}, which this onnxruntime does not provide (installed: "
        f"{', '.join(installed) or 'none'}). Get it with {how}, or pass --simulate to run this profile on the CPU "
        f"with the same memory budget and shape buckets.")


__all__ = ["DeviceProfile", "ProfileError", "ProviderUnavailable", "list_profiles", "load_profile",
           "profile_from_dict", "detect_host", "check_available", "available_providers", "int8_gemm_exact", "HOST",
           "CPU_EP"]
