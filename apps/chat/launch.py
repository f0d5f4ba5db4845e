"""`mirrorsd chat`: the desktop window where there is a display, a terminal chat where there is none."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mirrorsd.apps.chat.session import ChatSession, ChatSettings


def why_no_window() -> str | None:
    """None if a Qt window can open here; otherwise the reason, for the fallback message."""
    if sys.platform not in ("darwin", "win32") and not (
            os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM")):
        return "no display (DISPLAY and WAYLAND_DISPLAY are unset)"
    try:
        import PySide6.QtWidgets  # noqa: F401
    except ImportError as exc:
        return f"the desktop window needs PySide6 (pip install 'mirrorsd[gui]'): {exc}"
    return qt_platform_problem()


# Qt aborts the whole process (SIGABRT, rc 134) when its platform plugin cannot start, before any Python
# code can catch it; so a child process tries first, and only its failure is seen here.
_PROBE = "import sys; from PySide6.QtGui import QGuiApplication; QGuiApplication(sys.argv[:1])"


def qt_platform_problem(timeout: float = 60) -> str | None:
    """None if Qt's platform plugin starts here; otherwise why not, with the system packages to install."""
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the Qt window did not start within {timeout:.0f} s"
    if probe.returncode == 0:
        return None
    platform = _failed_platform(probe.stderr)
    return describe_qt_failure(probe.stderr, platform, missing_libraries(platform))


def _failed_platform(stderr: str) -> str:
    found = re.search(r'platform plugin "([^"]+)"', stderr)
    return found.group(1) if found else os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] or "xcb"


def describe_qt_failure(stderr: str, platform: str, missing: list[str]) -> str:
    """One line from what the probe printed: the missing libraries (and the Debian/Ubuntu packages that
    hold them), the display that did not answer, or the platforms there are."""
    needed = re.findall(r"\S+ or (\S+) is needed", stderr)  # Qt's own hint, e.g. libxcb-cursor0 for xcb
    packages = list(dict.fromkeys(needed + [debian_package(lib) for lib in missing]))
    if packages:
        libs = f" ({', '.join(missing)} not found)" if missing else ""
        return (f'the Qt "{platform}" platform plugin cannot load{libs}; install the system packages: '
                f"sudo apt-get install {' '.join(packages)} (Debian/Ubuntu names)")
    if "could not connect to display" in stderr:
        return f"cannot connect to the X display {os.environ.get('DISPLAY', '(unset)')}"
    available = re.search(r"Available platform plugins are: (.*?)\.?$", stderr, re.M)
    if available and f'"{platform}"' in stderr and "even though it was found" not in stderr:
        return f'there is no Qt platform plugin "{platform}" (available: {available.group(1)})'
    lines = [line for line in stderr.splitlines() if line.strip()]
    return f"the Qt window cannot start: {lines[0] if lines else 'it aborted'}"


def missing_libraries(platform: str) -> list[str]:
    """Shared libraries the platform plugin needs that the dynamic linker cannot find (ldd; Linux only)."""
    plugin = _plugin_file(platform)
    if plugin is None or shutil.which("ldd") is None:
        return []
    try:
        out = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(dict.fromkeys(re.findall(r"^\s*(\S+) => not found", out, re.M)))


def _plugin_file(platform: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("PySide6")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "Qt" / "plugins" / "platforms" / f"libq{platform}.so"
        if path.is_file():
            return path
    return None


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships a library, by Debian's naming rule: libxcb-cursor.so.0 ->
    libxcb-cursor0, libxkbcommon-x11.so.0 -> libxkbcommon-x11-0 (a dash when the name ends in a digit)."""
    stem, _, version = soname.partition(".so")
    version = version.lstrip(".").split(".")[0]
    stem = stem.lower()
    return stem + ("-" if stem[-1:].isdigit() and version else "") + version


def run_chat(target: str, draft: str, device: str = "auto", dtype: str = "auto",
             settings: ChatSettings | None = None, terminal: bool = False, highlight: bool | None = None,
             backend: str = "auto") -> int:
    reason = "--terminal" if terminal else why_no_window()
    if reason is None:
        from mirrorsd.apps.chat.window import run_window

        return run_window(target, draft, device, dtype, settings, backend=backend)
    if not terminal:
        print(f"mirrorsd chat: {reason}; chatting in the terminal", file=sys.stderr)
    from mirrorsd.apps.chat.terminal import run_terminal_chat
    from mirrorsd.engine import Engine

    with Engine.load(target=target, draft=draft, device=device, dtype=dtype, progress=True, backend=backend) as engine:
        engine.prepare()  # measured now (once per machine, then kept): `you>` means the first reply starts at once
        run_terminal_chat(ChatSession(engine, settings), highlight=highlight)
    return 0
