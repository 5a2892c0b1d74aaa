"""`p2pmesh doctor`'s checks of this machine's runtime (pure): MLX, from the probe's JSON
(version, device, Metal, a 2x2 matmul, the ring backend, mlx-lm), and the memory a model
may use, from vm_stat and sysctl (macOS) or /proc/meminfo (Linux). The vocabulary
(Output, Finding, Check) is doctor.py's.
"""
from __future__ import annotations

import json
import re
import shlex

from p2pmesh.platform.doctor import REPORT_FIX, Check, Finding, Output, fold, guard, need
from p2pmesh.platform.thunderbolt import CaptureError

GIB = 1024**3
MEMORY_LOW_FRACTION = 0.15
MEMORY_LOW_BYTES = 2 * GIB
OS_RESERVE_BYTES = 4 * GIB  # what a raised GPU wired limit must leave to macOS


# ---------------------------------------------------------------------------------------
# MLX


def check_mlx(probe: Output, platform: str) -> Check:
    """The MLX probe's JSON (version, device, Metal, a 2x2 matmul, ring backend, mlx-lm)."""
    return guard("mlx", _mlx, probe, platform)


def _mlx(probe: Output, platform: str) -> Check:
    text = need(probe, "the MLX probe")
    try:
        facts = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return fold("mlx", [Finding("fail", f"the MLX probe printed {text.strip()[-120:]!r}", REPORT_FIX)])
    if not isinstance(facts, dict):
        return fold("mlx", [Finding("fail", "the MLX probe printed no JSON object", REPORT_FIX)])
    python = str(facts.get("python", "python"))
    pip = f"`{shlex.quote(python)} -m pip install " + ("mlx mlx-lm`" if platform == "darwin" else "'mlx[cpu]' mlx-lm`")
    details = [f"python: {python} ({facts.get('machine', '?')})"]
    if facts.get("import_error"):
        return fold("mlx", [Finding("fail", f"MLX cannot be imported: {facts['import_error']}"[:300], pip)], details)
    findings = []
    if platform == "darwin" and facts.get("machine") != "arm64":
        findings.append(Finding("fail", f"Python runs as {facts.get('machine')} (Rosetta): MLX needs a native arm64 Python",
                                "install an arm64 Python (python.org, or Homebrew in /opt/homebrew) and p2pmesh in it"))
    if platform == "darwin" and facts.get("metal") is not True:
        findings.append(Finding("fail", "MLX cannot use the GPU (Metal is unavailable)",
                                "MLX needs Apple silicon and macOS 14 or later; reinstall with " + pip))
    if facts.get("matmul") != [[7.0, 10.0], [15.0, 22.0]]:
        findings.append(Finding("fail", f"a 2x2 matmul gave {facts.get('matmul')!r}", "reinstall MLX: " + pip))
    if facts.get("ring") is not True:
        findings.append(Finding("fail", "MLX's ring backend is unavailable (p2pmesh's pipeline runs on it)", "reinstall MLX: " + pip))
    if not facts.get("mlx_lm"):
        findings.append(Finding("fail", "mlx-lm is not installed (the workers load models with it)", pip))
    if facts.get("working_set_bytes"):
        details.append(f"Metal recommended working set: {int(facts['working_set_bytes']) / GIB:.1f} GiB "
                       "(what p2pmesh offers for layers by default)")
    if platform == "darwin":
        details.append(f"JACCL (RDMA) backend available: {bool(facts.get('jaccl'))}")
    details.append(f"mlx-lm {facts.get('mlx_lm') or 'missing'}")
    findings.append(Finding("ok", f"MLX {facts.get('version')} on {facts.get('device')}: matmul and ring backend work"))
    return fold("mlx", findings, details)


# ---------------------------------------------------------------------------------------
# Memory


def parse_vm_stat(text: str) -> dict[str, int]:
    """`vm_stat` -> {"page size": bytes, "pages free": n, "pages inactive": n, ...}."""
    m = re.search(r"page size of ([0-9]{1,9}) bytes", text)
    if m is None:
        raise CaptureError("vm_stat output has no 'page size of N bytes' header")
    out = {"page size": int(m.group(1))}
    for line in text.splitlines()[1:]:
        kv = re.fullmatch(r'\s*"?([A-Za-z][A-Za-z -]*?)"?:\s+([0-9]{1,20})\.?\s*', line)
        if kv is not None:
            out[kv.group(1).lower()] = int(kv.group(2))
    if "pages free" not in out:
        raise CaptureError("vm_stat output has no 'Pages free' line")
    return out


def parse_sysctl_int(text: str, name: str) -> int:
    """`sysctl NAME` ("hw.memsize: 68719476736") or `sysctl -n NAME` -> the integer."""
    m = re.fullmatch(rf"\s*(?:{re.escape(name)}\s*[:=]\s*)?([0-9]{{1,20}})\s*", text)
    if m is None:
        raise CaptureError(f"sysctl {name} printed {text.strip()[:60]!r}, not an integer")
    return int(m.group(1))


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo -> (MemTotal, MemAvailable) in bytes."""
    values = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(MemTotal|MemAvailable):\s+([0-9]{1,20}) kB\s*", line)
        if m is not None:
            values[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in values or "MemAvailable" not in values:
        raise CaptureError("/proc/meminfo has no MemTotal or MemAvailable line")
    return values["MemTotal"], values["MemAvailable"]


def check_memory_macos(vm_stat: Output, memsize: Output, wired_limit: Output) -> Check:
    """Available = free + inactive + speculative pages (what macOS hands out without
    swapping); plus the GPU wired limit (iogpu.wired_limit_mb, 0 = macOS's default)."""
    return guard("memory", _memory_macos, vm_stat, memsize, wired_limit)


def _memory_macos(vm_stat: Output, memsize: Output, wired_limit: Output) -> Check:
    vm = parse_vm_stat(need(vm_stat, "vm_stat"))
    total = parse_sysctl_int(need(memsize, "sysctl hw.memsize"), "hw.memsize")
    available = vm["page size"] * sum(vm.get(k, 0) for k in ("pages free", "pages inactive", "pages speculative"))
    findings = [_memory_level(total, min(available, total), "quit memory-hungry apps (Activity Monitor > Memory)")]
    details = []
    try:
        limit_mb = parse_sysctl_int(wired_limit.text, "iogpu.wired_limit_mb") if wired_limit.text is not None else None
    except CaptureError:
        limit_mb = None  # optional: the memory figures above still stand
    if limit_mb is None:
        details.append("GPU wired limit: unknown (no iogpu.wired_limit_mb on this macOS)")
    elif limit_mb == 0:
        details.append("GPU wired limit: macOS's default (iogpu.wired_limit_mb=0); `sudo sysctl "
                       "iogpu.wired_limit_mb=N` raises it until reboot")
    else:
        details.append(f"GPU wired limit: {limit_mb} MiB (iogpu.wired_limit_mb)")
        if limit_mb * 1024 * 1024 > total - OS_RESERVE_BYTES:
            suggest = max(total // (1024 * 1024) - 8192, total // (2 * 1024 * 1024))
            findings.append(Finding(
                "warn", f"iogpu.wired_limit_mb={limit_mb} leaves less than {OS_RESERVE_BYTES // GIB} GiB to macOS: "
                "the Mac may stall under a large model",
                f"lower it: `sudo sysctl iogpu.wired_limit_mb={suggest}` (until reboot; 0 restores the default)"))
    return fold("memory", findings, details)


def check_memory_linux(meminfo: Output) -> Check:
    def body() -> Check:
        total, available = parse_meminfo(need(meminfo, "/proc/meminfo"))
        return fold("memory", [_memory_level(total, available, "stop memory-hungry processes")])

    return guard("memory", body)


def _memory_level(total: int, available: int, quit_apps: str) -> Finding:
    said = f"{available / GIB:.1f} GiB of {total / GIB:.1f} GiB available"
    if available < MEMORY_LOW_BYTES or available < MEMORY_LOW_FRACTION * total:
        return Finding("warn", f"memory is tight: {said}",
                       f"{quit_apps} before loading a model; `p2pmesh agent --memory-limit BYTES` caps what this "
                       "machine offers for layers")
    return Finding("ok", said)
