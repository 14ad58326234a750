"""`epd-transfer doctor`: what is installed and usable on this host, and the fix for what is not.

Each check is one line: a level (ok, WARN, FAIL, or -- for "absent, and that
is fine"), a name, what was found, and the exact fix. The exit code is non-zero
when no data path can run (neither mooncake.engine nor transfer._native imports)
or when an EPD_* variable is set that the component reading it would refuse.
Everything read from the host goes through SYSFS_ROOT, PROC_MODULES and the
`environ` argument, so tests can fake a device tree.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import difflib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TextIO

# The host's sysfs and module list; tests point these at a temporary tree.
SYSFS_ROOT = "/sys"
PROC_MODULES = "/proc/modules"

# How long the mooncake import may take in its subprocess before we call it hung.
IMPORT_TIMEOUT_S = 60.0

# How long torch's import and CUDA query may take in their subprocess before we call them hung.
CUDA_TIMEOUT_S = 60.0

# How long a probe's child that ran past its timeout is waited for once killed: one stuck in the kernel (a
# driver's uninterruptible wait, as on a GPU fallen off the bus) outlives SIGKILL, and is left behind.
REAP_TIMEOUT_S = 5.0

# What a hung probe's line adds when its child outlived SIGKILL.
UNKILLABLE = ", and its process could not be killed (stuck in the kernel: see dmesg)"

# Mooncake distributions and the build each one is (they all install `mooncake`).
MOONCAKE_FLAVOURS = {
    "mooncake-transfer-engine": "CUDA build",
    "mooncake-transfer-engine-non-cuda": "CPU build",
    "mooncake-transfer-engine-cuda13": "CUDA 13 build",
}

LEVEL_TAGS = {"ok": "ok", "info": "--", "warn": "WARN", "fail": "FAIL"}

#: The EPD_* variables the scripts read (scripts/launch.sh --help); the library's are transfer.config.SETTINGS.
SCRIPT_VARIABLES = (
    "EPD_BOOTSTRAP_BIND", "EPD_BOOTSTRAP_PORT", "EPD_ENCODE_HOST", "EPD_ENCODE_TP", "EPD_EXTRA_ARGS",
    "EPD_HIDDEN", "EPD_INFLIGHT", "EPD_ITEMS", "EPD_LOG_DIR", "EPD_NO_BOOTSTRAP", "EPD_PREFILL_HOST",
    "EPD_PREFILL_NODE", "EPD_PREFILL_NODES", "EPD_PREFILL_TP", "EPD_PROTOCOL", "EPD_PYTHON", "EPD_SPAN",
)

Probe = Callable[[], "tuple[bool, str]"]


@dataclass
class Check:
    """One doctor line: level is ok | info | warn | fail; fix is '' when nothing to do."""

    name: str
    level: str
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        """True unless something needs fixing (info means absent-and-fine)."""
        return self.level in ("ok", "info")

    def as_dict(self) -> dict:
        """The JSON form: name, ok, detail, fix, level."""
        return {"name": self.name, "ok": self.ok, "detail": self.detail,
                "fix": self.fix, "level": self.level}


@dataclass
class Report:
    """Everything collect() found, before rendering."""

    checks: list[Check] = field(default_factory=list)
    protocol: str = ""
    protocol_reason: str = ""
    rdma_devices: list[dict] = field(default_factory=list)
    mc_env: dict[str, str] = field(default_factory=dict)
    data_path_ok: bool = False
    env_ok: bool = True
    mooncake: dict = field(default_factory=dict)
    cuda: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The --json object."""
        out = asdict(self)
        out["checks"] = [c.as_dict() for c in self.checks]
        return out

    def exit_status(self) -> int:
        """0 when a data path can run and every EPD_* variable set passes its component's checks, else 1."""
        return 0 if self.data_path_ok and self.env_ok else 1


# ---- small readers ------------------------------------------------------------


def _read(path: str) -> str | None:
    """A sysfs file's stripped text, or None when absent or unreadable (EINVAL for unused GIDs)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    """Sorted entries of a folder, [] when absent."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _after_colon(text: str | None) -> str | None:
    """`4: ACTIVE` -> `ACTIVE` (the kernel prefixes port states with their number)."""
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text


def _cuda_host() -> bool:
    """True when an NVIDIA driver is present (decides which wheel to suggest)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


# ---- Mooncake ------------------------------------------------------------------


def mooncake_distributions() -> list[dict]:
    """Installed Mooncake transfer-engine distributions: name, version, flavour."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mooncake-transfer-engine"):
            flavour = MOONCAKE_FLAVOURS.get(name)
            if flavour is None:
                flavour = "CUDA build" if "cuda" in name and "non-cuda" not in name else "build"
            found.append({"name": name, "version": dist.version, "flavour": flavour})
    return sorted(found, key=lambda d: d["name"])


#: What the import probe says of a binding without TransferEngine.send_probe (wheels before mid-2026).
IMPORTS_NO_PROBE = "imports, but its TransferEngine has no send_probe"


def _run_probe(code: str, timeout_s: float) -> tuple[subprocess.CompletedProcess | None, bool]:
    """`python -c code` in a child process, its output captured: (the finished child, False), or (None, whether
    it still runs) where it ran past timeout_s. Such a child is killed and waited for at most REAP_TIMEOUT_S:
    subprocess.run's wait after its kill has no bound, and one stuck in the kernel would hang the doctor."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        out, err = child.communicate(timeout=timeout_s)
    except BaseException as stopped:  # the timeout, or Ctrl-C: the child goes too
        child.kill()
        try:
            child.communicate(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
        if not isinstance(stopped, subprocess.TimeoutExpired):
            raise
        return None, child.poll() is None
    return subprocess.CompletedProcess(child.args, child.returncode, out, err), False


def probe_mooncake_import(timeout_s: float | None = None) -> tuple[bool, str]:
    """Import mooncake.engine in a child process (a crash or hang cannot take the doctor down)."""
    timeout_s = IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    code = ("import mooncake.engine as e; "
            f"print('imports' if hasattr(e.TransferEngine, 'send_probe') else {IMPORTS_NO_PROBE!r})")
    done, left = _run_probe(code, timeout_s)
    if done is None:
        return False, f"import mooncake.engine hung for more than {timeout_s:g}s{UNKILLABLE if left else ''}"
    if done.returncode == 0:
        # The import may print lines of its own: the verdict is the line the probe printed, not all of stdout.
        verdicts = [ln.strip() for ln in done.stdout.splitlines() if ln.strip() in ("imports", IMPORTS_NO_PROBE)]
        return True, verdicts[-1] if verdicts else "imports"
    if done.returncode < 0:
        return False, f"import mooncake.engine crashed (signal {-done.returncode})"
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return False, f"import fails: {lines[-1] if lines else f'exit {done.returncode}'}"


def probe_native_import() -> tuple[bool, str]:
    """Import transfer._native (the C core that carries the framed-wire data path)."""
    try:
        from transfer import _native  # noqa: F401
    except ImportError as error:
        return False, f"transfer._native does not import: {error}"
    return True, "transfer._native imports (framed wire, needs no Mooncake)"


def check_mooncake(probe: Probe) -> tuple[list[Check], dict]:
    """The installed wheel(s), their flavour, and whether mooncake.engine imports."""
    dists = mooncake_distributions()
    imports, how = probe()
    info = {"distributions": dists, "imports": imports, "import_detail": how}
    wheel_fix = ("pip install mooncake-transfer-engine  (CUDA host)" if _cuda_host()
                 else "pip install mooncake-transfer-engine-non-cuda  (CPU host)")
    if not dists:
        detail = "no mooncake-transfer-engine wheel installed"
        if imports:
            detail = "mooncake imports but no wheel metadata (source build?)"
            checks = [Check("mooncake", "ok", f"{detail}, {how}")]
            if how == IMPORTS_NO_PROBE:
                checks.append(_no_probe_check(f"rebuild Mooncake from a source whose TransferEngine has "
                                              f"send_probe, or {wheel_fix}"))
            return checks, info
        return [Check("mooncake", "fail", detail, wheel_fix)], info
    names = ", ".join(f"{d['name']} {d['version']} ({d['flavour']})" for d in dists)
    checks = []
    if imports:
        checks.append(Check("mooncake", "ok", f"{names}, {how}"))
        if how == IMPORTS_NO_PROBE:
            checks.append(_no_probe_check(f"pip install --upgrade {dists[0]['name']}"))
    else:
        if "libibverbs" in how or "libnuma" in how:
            fix = "apt-get install libibverbs1 libnuma1"
        elif len(dists) == 1:
            fix = f"pip install --force-reinstall {dists[0]['name']}"
        else:
            fix = f"pip uninstall {' '.join(d['name'] for d in dists)} && {wheel_fix}"
        checks.append(Check("mooncake", "fail", f"{names}, {how}", fix))
    if len(dists) > 1:
        checks.append(Check(
            "mooncake-wheels", "warn",
            f"{len(dists)} Mooncake wheels installed; they overwrite each other's `mooncake` module",
            f"keep one: pip uninstall {' '.join(d['name'] for d in dists)} && {wheel_fix}"))
    elif dists[0]["flavour"].startswith("CUDA") and not _cuda_host():
        checks.append(Check(
            "mooncake-wheels", "warn", "a CUDA build of Mooncake on a host without an NVIDIA driver",
            f"pip uninstall {dists[0]['name']} && pip install mooncake-transfer-engine-non-cuda"))
    elif dists[0]["name"] == "mooncake-transfer-engine-non-cuda" and _cuda_host():
        checks.append(Check(
            "mooncake-wheels", "warn", "a Mooncake build without CUDA on a host with an NVIDIA driver: "
            "GPU memory cannot be registered with it over tcp (host memory works)",
            f"pip uninstall {dists[0]['name']} && pip install mooncake-transfer-engine"))
    return checks, info


def _no_probe_check(fix: str) -> Check:
    """The warning for a binding whose TransferEngine has no send_probe, with `fix`."""
    return Check("mooncake-probe", "warn",
                 "without send_probe, a peer stopped at its first contact holds every write of this "
                 "engine for up to 60 s (docs/guarantees.md)", fix)


# ---- system libraries ---------------------------------------------------------


def check_library(soname: str, short: str, package: str) -> Check:
    """Whether a shared library loads (what Mooncake's import needs)."""
    try:
        ctypes.CDLL(soname)
        return Check(short, "ok", f"{soname} loads")
    except OSError:
        found = ctypes.util.find_library(short.removeprefix("lib"))
        if found:
            return Check(short, "warn", f"{soname} does not load, but {found} exists",
                         f"apt-get install {package}")
        return Check(short, "fail", f"{soname} not found", f"apt-get install {package}")


# ---- RDMA devices -------------------------------------------------------------


def infiniband_root(sysfs_root: str | None = None) -> str:
    """The folder where the kernel lists RDMA devices."""
    return os.path.join(SYSFS_ROOT if sysfs_root is None else sysfs_root, "class", "infiniband")


def _gids(port_dir: str) -> list[dict]:
    """Non-zero GID table entries of a port, with their type and netdev when the kernel says."""
    entries = []
    for index in sorted(_listdir(os.path.join(port_dir, "gids")), key=_int_or_big):
        gid = _read(os.path.join(port_dir, "gids", index))
        if not gid or set(gid.replace(":", "")) <= {"0"}:
            continue
        entries.append({
            "index": int(index) if index.isdigit() else index,
            "gid": gid,
            "type": _read(os.path.join(port_dir, "gid_attrs", "types", index)),
            "ndev": _read(os.path.join(port_dir, "gid_attrs", "ndevs", index)),
        })
    return entries


def _int_or_big(text: str) -> int:
    """Sort key for numbered sysfs entries."""
    return int(text) if text.isdigit() else 1 << 30


def _port_mtu(port_dir: str, gids: list[dict], parent: str | None,
              sysfs_root: str) -> str | None:
    """Active MTU: the port's own file when the driver has one, else the RoCE netdev's MTU."""
    own = _read(os.path.join(port_dir, "active_mtu")) or _read(os.path.join(port_dir, "mtu"))
    if own:
        return own
    # sysfs has no MTU file for RoCE ports; the netdev's MTU bounds the RoCE MTU.
    for netdev in [g["ndev"] for g in gids if g["ndev"]] + ([parent] if parent else []):
        mtu = _read(os.path.join(sysfs_root, "class", "net", netdev, "mtu"))
        if mtu:
            return f"{mtu} (netdev {netdev})"
    return None


def describe_device(name: str, sysfs_root: str | None = None) -> dict:
    """One RDMA device from sysfs: driver, soft-RoCE or not, node type, ports."""
    root = SYSFS_ROOT if sysfs_root is None else sysfs_root
    dev_dir = os.path.join(infiniband_root(root), name)
    driver_link = os.path.join(dev_dir, "device", "driver")
    driver = os.path.basename(os.path.realpath(driver_link)) if os.path.exists(driver_link) else None
    parent = _read(os.path.join(dev_dir, "parent"))
    soft = None
    if name.startswith("rxe") or driver in ("rdma_rxe", "rxe"):
        soft = "soft-RoCE (rdma_rxe)"
    elif name.startswith("siw") or driver == "siw":
        soft = "soft-iWARP (siw)"
    ports = []
    for port in sorted(_listdir(os.path.join(dev_dir, "ports")), key=_int_or_big):
        port_dir = os.path.join(dev_dir, "ports", port)
        gids = _gids(port_dir)
        ports.append({
            "port": int(port) if port.isdigit() else port,
            "state": _after_colon(_read(os.path.join(port_dir, "state"))),
            "phys_state": _after_colon(_read(os.path.join(port_dir, "phys_state"))),
            "link_layer": _read(os.path.join(port_dir, "link_layer")),
            "rate": _read(os.path.join(port_dir, "rate")),
            "mtu": _port_mtu(port_dir, gids, parent, root),
            "gids": gids,
        })
    return {"name": name, "driver": driver, "parent": parent, "soft": soft,
            "node_type": _after_colon(_read(os.path.join(dev_dir, "node_type"))), "ports": ports}


def _port_check(dev: dict, port: dict) -> Check:
    """One line for one port of one device."""
    layer = port["link_layer"] or "unknown link layer"
    if layer == "Ethernet":
        layer = "RoCE (Ethernet)"
    parts = [port["state"] or "state unknown", layer]
    if port["mtu"]:
        parts.append(f"mtu {port['mtu']}")
    if port["rate"]:
        parts.append(port["rate"])
    if dev["soft"]:
        parts.append(dev["soft"] + (f" on {dev['parent']}" if dev["parent"] else ""))
    elif dev["driver"]:
        parts.append(f"driver {dev['driver']}")
    gids = [f"[{g['index']}] {g['gid']}" + (f" {g['type']}" if g["type"] else "") for g in port["gids"]]
    parts.append("GIDs " + ", ".join(gids) if gids else "no GIDs")
    name = f"rdma {dev['name']}/{port['port']}"
    detail = ", ".join(parts)
    if port["state"] != "ACTIVE":
        netdev = dev["parent"] or "<netdev>"
        fix = (f"ip link set {netdev} up" if port["link_layer"] == "Ethernet"
               else "check the cable and that a subnet manager runs (opensm)")
        return Check(name, "warn", detail, fix)
    if port["link_layer"] == "Ethernet" and not port["gids"]:
        return Check(name, "warn", detail,
                     f"give {dev['parent'] or 'the netdev'} an IP address (RoCE GIDs come from it)")
    return Check(name, "ok", detail)


def check_rdma(sysfs_root: str | None = None) -> tuple[list[Check], list[dict]]:
    """Every RDMA device and port, or a note that there are none."""
    root = infiniband_root(sysfs_root)
    names = _listdir(root)
    if not names:
        return [Check("rdma", "warn", f"no RDMA devices under {root}; protocol rdma cannot run",
                      "scripts/soft-roce.sh up  (soft-RoCE; needs a kernel with rdma_rxe), "
                      "or use protocol tcp")], []
    devices = [describe_device(n, sysfs_root) for n in names]
    checks = []
    for dev in devices:
        if not dev["ports"]:
            checks.append(Check(f"rdma {dev['name']}", "warn", "device without ports in sysfs"))
        checks.extend(_port_check(dev, port) for port in dev["ports"])
    return checks, devices


# ---- CUDA and GPUDirect ---------------------------------------------------------


#: What the CUDA probe's child prints: torch's view of CUDA as one JSON object.
_CUDA_QUERY = """import json
try:
    import torch
except Exception as error:  # a broken torch install raises more than ImportError
    print(json.dumps({"import_error": str(error)}))
    raise SystemExit
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
try:
    available = bool(torch.cuda.is_available())
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    info["available"] = available
except Exception as error:
    info["error"] = str(error)
print(json.dumps(info))
"""


def probe_cuda(timeout_s: float | None = None) -> dict:
    """torch's view of CUDA, asked in a child process, as the Mooncake import is: a driver that hangs or
    crashes in cuInit (a GPU fallen off the bus) cannot take the doctor down. torch, torch_cuda, available and
    devices; import_error when torch does not import, error when the query failed, hung or crashed."""
    timeout_s = CUDA_TIMEOUT_S if timeout_s is None else timeout_s
    done, left = _run_probe(_CUDA_QUERY, timeout_s)
    if done is None:
        return {"error": f"the CUDA query (torch.cuda.is_available()) hung for more than {timeout_s:g}s"
                         f"{UNKILLABLE if left else ''}"}
    lines = done.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        info = None
    if isinstance(info, dict):
        return info
    if done.returncode < 0:
        return {"error": f"the CUDA query crashed (signal {-done.returncode})"}
    errors = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return {"error": f"the CUDA query failed: {errors[-1] if errors else f'exit {done.returncode}'}"}


def check_cuda(probe: Callable[[], dict] | None = None) -> tuple[Check, dict]:
    """torch's view of CUDA: available, device count and names (from probe_cuda unless `probe` is given)."""
    found = (probe or probe_cuda)()
    if "import_error" in found:
        return Check("cuda", "warn", f"torch does not import: {found['import_error']}",
                     "pip install torch (the build matching this host)"), {"available": False}
    if "error" in found:
        torch = f"torch {found['torch']}: " if "torch" in found else ""
        query = found["error"] if "torch" not in found else f"CUDA query failed: {found['error']}"
        return Check("cuda", "warn", f"{torch}{query}",
                     "check the NVIDIA driver (nvidia-smi; dmesg for Xid errors)"), {"available": False}
    available, names = bool(found["available"]), list(found["devices"])
    info = {"available": available, "torch": found["torch"], "torch_cuda": found["torch_cuda"], "devices": names}
    if not available:
        build = "CPU build" if found["torch_cuda"] is None else f"CUDA {found['torch_cuda']} build"
        return Check("cuda", "info", f"torch {found['torch']} ({build}): no CUDA device; "
                                     "host buffers only"), info
    return Check("cuda", "ok", f"torch {found['torch']}: {len(names)} device(s): "
                               + ", ".join(names)), info


def check_gpudirect(cuda_available: bool, sysfs_root: str | None = None,
                    proc_modules: str | None = None) -> Check:
    """Whether the peer-memory module that lets RDMA NICs read GPU memory is loaded."""
    root = SYSFS_ROOT if sysfs_root is None else sysfs_root
    modules_text = _read(PROC_MODULES if proc_modules is None else proc_modules) or ""
    loaded = {line.split()[0] for line in modules_text.splitlines() if line.strip()}
    for module in ("nvidia_peermem", "nv_peer_mem"):
        if module in loaded or os.path.isdir(os.path.join(root, "module", module)):
            return Check("gpudirect", "ok", f"{module} loaded: RDMA can read and write GPU memory")
    if not cuda_available:
        return Check("gpudirect", "info", "no CUDA device, so no GPUDirect RDMA (not needed)")
    return Check("gpudirect", "warn", "nvidia_peermem not loaded: RDMA cannot touch GPU memory",
                 "modprobe nvidia_peermem")


# ---- protocol, wire, environment -------------------------------------------------


def check_protocol(sysfs_root: str | None, mooncake_ok: bool) -> tuple[Check, str, str]:
    """Which protocol `auto` resolves to on this host, and why (what an Engine would run)."""
    from transfer.engine import effective_protocol

    protocol, why = effective_protocol("auto", root=infiniband_root(sysfs_root))
    level = "ok" if mooncake_ok else "warn"
    fix = "" if mooncake_ok else "install Mooncake (see the mooncake line) or use the wire path"
    return Check("protocol", level, f"auto -> {protocol}: {why}", fix), protocol, why


def check_wire(probe: Probe) -> Check:
    """The framed-wire data path, which needs only our C core."""
    ok, detail = probe()
    if ok:
        return Check("wire", "ok", detail)
    return Check("wire", "warn", detail,
                 "pip install -e .  (or: python setup.py build_ext --inplace) to build the C core")


def mc_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Mooncake's MC_* environment variables that are set, by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("MC_")}


def check_mc_env(mc_env: dict[str, str]) -> Check:
    """One line listing the MC_* variables (they change Mooncake's behaviour silently)."""
    if not mc_env:
        return Check("mc-env", "info", "no MC_* variables set (Mooncake defaults)")
    listed = " ".join(f"{k}={v}" for k, v in mc_env.items())
    timeout = mc_env.get("MC_TRANSFER_TIMEOUT")
    if timeout is not None and not (timeout.isascii() and timeout.isdigit() and int(timeout) >= 5):
        from transfer.engine import mooncake_transfer_timeout_s

        taken = mooncake_transfer_timeout_s({"MC_TRANSFER_TIMEOUT": timeout})
        return Check("mc-env", "warn", f"{listed}: MC_TRANSFER_TIMEOUT={timeout!r} is not a whole number of "
                                       f"seconds of at least 5; Mooncake takes it as {taken:g} s",
                     "set MC_TRANSFER_TIMEOUT to whole seconds, 5 or more")
    return Check("mc-env", "ok", listed)


def check_epd_env(environ: Mapping[str, str] | None = None) -> Check:
    """The EPD_* variables set, each checked as the component that reads it checks it (a bad one fails
    here first), and a warning for an EPD_* name that nothing reads."""
    from transfer import config

    env = os.environ if environ is None else environ
    library = [s.env for s in config.SETTINGS]
    names = [name for name in library if env.get(name, "") != ""]
    unknown = unread_epd_names(env)
    short = quarantine_shortfall(env)
    bad = epd_env_problems(env)
    if bad:
        return Check("epd-env", "fail", "; ".join(bad + unknown), "fix or unset the variable (README, Configuration)")
    listed = [f"{name}={env[name]}" for name in names if name != "EPD_TOKEN"]
    listed += ["EPD_TOKEN=(set)"] if "EPD_TOKEN" in names else []  # the token itself stays off
    if unknown or short:
        fixes = [f"unset or rename it: the library reads {' '.join(library)} (README, Configuration), "
                 f"the launch scripts {' '.join(SCRIPT_VARIABLES)} (scripts/launch.sh --help)"] if unknown else []
        fixes += [short[1]] if short else []
        return Check("epd-env", "warn", "; ".join(([" ".join(listed)] if listed else []) + unknown
                                                  + ([short[0]] if short else [])), "; ".join(fixes))
    if not names:
        return Check("epd-env", "info", "no EPD_* variables set (the documented defaults)")
    return Check("epd-env", "ok", " ".join(listed))


def unread_epd_names(env: Mapping[str, str]) -> list[str]:
    """`EPD_X is read by nothing here (did you mean EPD_Y?)` for each EPD_* name set that neither the library
    nor the launch scripts read, in name order."""
    from transfer import config

    known = [s.env for s in config.SETTINGS] + list(SCRIPT_VARIABLES)
    return [f"{name} is read by nothing here{_did_you_mean(name, known)}"
            for name in sorted(env) if name.startswith("EPD_") and name not in known]


def quarantine_shortfall(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(what, fix) where the receive pools' quarantine (EPD_QUARANTINE_S, else its default) is shorter than
    two fanout timeouts (EPD_FANOUT_TIMEOUT_S) and Mooncake's transfer timeout (MC_TRANSFER_TIMEOUT):
    an encode rank may then start a room's write after its prefill rank gave the room up and handed its slot
    to another room (transfer.buffers.QUARANTINE_S). None when it is long enough, or a value is refused."""
    from transfer import config
    from transfer.engine import mooncake_transfer_timeout_s
    from transfer.errors import ConfigError

    try:
        quarantine = config.resolve("EPD_QUARANTINE_S", environ=env)
        fanout = config.resolve("EPD_FANOUT_TIMEOUT_S", environ=env)
    except ConfigError:
        return None  # epd_env_problems says why
    transfer = mooncake_transfer_timeout_s(env)
    need = 2 * fanout + transfer
    if quarantine >= need:
        return None
    whose = "EPD_QUARANTINE_S" if config.is_set("EPD_QUARANTINE_S", env) else "the receive pools' default quarantine"
    what = (f"{whose}, {quarantine:g} s, is shorter than two fanout timeouts (EPD_FANOUT_TIMEOUT_S {fanout:g} s) and "
            f"Mooncake's transfer timeout ({transfer:g} s), {need:g} s: a prefill rank may hand a failed room's slot "
            f"to another room while an encode rank's late write of it can still land there")
    return what, (f"set EPD_QUARANTINE_S to at least {need:g} on the prefill ranks, or a shorter "
                  f"EPD_FANOUT_TIMEOUT_S on the encode ranks")


def epd_env_warnings(env: Mapping[str, str]) -> list[str]:
    """The warnings `epd-transfer demo`, `bench` and `rank` print before they start: EPD_* names nothing reads,
    and a quarantine too short for the fanout timeout (each with what to do)."""
    short = quarantine_shortfall(env)
    unread = unread_epd_names(env)
    return ([f"{'; '.join(unread)}: unset or rename it (`epd-transfer doctor` lists what is read)"] if unread else []
            ) + ([f"{short[0]}: {short[1]}"] if short else [])


def epd_env_problems(env: Mapping[str, str]) -> list[str]:
    """What the components reading the EPD_* variables set would refuse, one message each."""
    from transfer import config
    from transfer.bootstrap import check_token
    from transfer.engine import device_names
    from transfer.errors import ConfigError

    values, bad, refused = {}, [], set()
    for setting in config.SETTINGS:
        if env.get(setting.env, "") != "":
            try:
                values[setting.env] = config.resolve(setting.env, environ=env)
            except ConfigError as error:
                bad.append(str(error))
                refused.add(setting.env)
    if "EPD_TOKEN" in values:
        try:
            check_token(values["EPD_TOKEN"])  # as `epd-transfer bootstrap` and `rank` take it
        except ConfigError as error:
            bad.append(f"EPD_TOKEN: {error}")  # never the token itself
    if "EPD_DEVICE" in values:
        try:
            device_names(values["EPD_DEVICE"], what="")  # as `epd-transfer rank` takes it
        except ConfigError as error:
            bad.append(f"EPD_DEVICE={values['EPD_DEVICE']!r}: {error}")
    polls = {"EPD_POLL_MIN_S", "EPD_POLL_MAX_S"}
    if polls & values.keys() and not polls & refused:
        try:  # as SenderPool checks the pair
            config.check_polls("SenderPool", config.resolve("EPD_POLL_MIN_S", environ=env),
                               config.resolve("EPD_POLL_MAX_S", environ=env))
        except ConfigError as error:
            bad.append(str(error))
    return bad


def _did_you_mean(name: str, known: list[str]) -> str:
    """` (did you mean X?)` for the known name closest to a misspelled one, else ''."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# ---- putting it together ----------------------------------------------------------


def collect(sysfs_root: str | None = None, environ: Mapping[str, str] | None = None,
            mooncake_probe: Probe | None = None, native_probe: Probe | None = None,
            proc_modules: str | None = None, cuda_probe: Callable[[], dict] | None = None) -> dict:
    """Run every check and return the --json object (see Report.as_dict)."""
    return collect_report(sysfs_root, environ, mooncake_probe, native_probe, proc_modules, cuda_probe).as_dict()


def collect_report(sysfs_root: str | None = None, environ: Mapping[str, str] | None = None,
                   mooncake_probe: Probe | None = None, native_probe: Probe | None = None,
                   proc_modules: str | None = None, cuda_probe: Callable[[], dict] | None = None) -> Report:
    """Run every check; probes default to the real imports."""
    report = Report()
    report.checks.append(Check("python", "info", f"{platform.python_version()} on "
                                                 f"{platform.system()} {platform.machine()}"))
    mooncake_checks, report.mooncake = check_mooncake(mooncake_probe or probe_mooncake_import)
    report.checks.extend(mooncake_checks)
    report.checks.append(check_library("libibverbs.so.1", "libibverbs", "libibverbs1"))
    report.checks.append(check_library("libnuma.so.1", "libnuma", "libnuma1"))
    rdma_checks, report.rdma_devices = check_rdma(sysfs_root)
    report.checks.extend(rdma_checks)
    cuda_check, report.cuda = check_cuda(cuda_probe)
    report.checks.append(cuda_check)
    report.checks.append(check_gpudirect(report.cuda.get("available", False), sysfs_root,
                                         proc_modules))
    mooncake_ok = bool(report.mooncake["imports"])
    protocol_check, report.protocol, report.protocol_reason = check_protocol(sysfs_root, mooncake_ok)
    report.checks.append(protocol_check)
    wire_check = check_wire(native_probe or probe_native_import)
    report.checks.append(wire_check)
    report.mc_env = mc_environment(environ)
    report.checks.append(check_mc_env(report.mc_env))
    env_check = check_epd_env(environ)
    report.checks.append(env_check)
    report.env_ok = env_check.level != "fail"
    report.data_path_ok = mooncake_ok or wire_check.level == "ok"
    report.checks.append(_data_path_check(mooncake_ok, wire_check.level == "ok", report.protocol))
    return report


def _data_path_check(mooncake_ok: bool, wire_ok: bool, protocol: str) -> Check:
    """The verdict line: which data paths can run."""
    paths = ([f"mooncake {protocol}"] if mooncake_ok else []) + (["wire"] if wire_ok else [])
    if paths:
        return Check("data-path", "ok", "runnable: " + ", ".join(paths))
    return Check("data-path", "fail",
                 "no data path can run: neither mooncake.engine nor transfer._native imports",
                 "fix the mooncake line above, or build the C core (pip install -e .)")


def format_checks(checks: list[Check]) -> str:
    """The aligned text lines: level, name, detail, and `-> fix: ...` when there is one."""
    width = max([14] + [len(c.name) for c in checks]) + 2
    lines = []
    for c in checks:
        line = f"{LEVEL_TAGS[c.level]:<6}{c.name:<{width}}{c.detail}"
        if c.fix:
            line += f" -> fix: {c.fix}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run(as_json: bool = False, out: TextIO | None = None, **collect_args) -> int:
    """Print the report (text or one JSON object); return its exit status (Report.exit_status)."""
    out = sys.stdout if out is None else out
    report = collect_report(**collect_args)
    if as_json:
        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(format_checks(report.checks))
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(run(as_json="--json" in sys.argv[1:]))
