"""Small C kernels (`workbench/csrc/*.c`), compiled on first use for this CPU and cached.

Why C: a few CPU hot spots are single passes over memory that torch splits into several
(decode attention over ragged rows, the soft cross-entropy of training). Each kernel is built
with the machine's C compiler (`cc`, or `$CC`) for this CPU (`-march=native`) into
`$WORKBENCH_HOME/kernels/<name>-<key>.so`, keyed by the source, flags, compiler and CPU, and
loaded with ctypes. Every kernel has a torch path beside it, used where no compiler is found;
its environment variable (`auto` by default) forces one or the other.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.fsutil import workbench_home

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fno-finite-math-only",
         "-shared", "-fPIC"]  # fmt: skip


class KernelError(WorkbenchError):
    """A C kernel could not be built, or was called with bad arguments."""


def compiler() -> str | None:
    """The C compiler's path (`$CC`, else `cc`), or None."""
    return shutil.which(os.environ.get("CC") or "cc")


def cpu_id() -> str:
    """What -march=native depends on: the CPU's model line and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read(65536).splitlines()
                     if ln.startswith(("model name", "flags", "cpu family", "model\t"))]  # fmt: skip
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def mode(env: str, other: str) -> str:
    """`$env`: 'auto' (the default: the kernel where a compiler is found), 'c', or `other`
    (the torch path)."""
    m = os.environ.get(env, "auto").strip().lower() or "auto"
    if m not in ("auto", "c", other):
        raise KernelError(f"{env}={m!r}: expected 'auto', 'c' or {other!r}")
    return m


def enabled(env: str, other: str) -> bool:
    """Whether the kernel behind `env` is used on this machine."""
    m = mode(env, other)
    if m == other:
        return False
    if compiler() is None:
        if m == "c":
            raise KernelError(f"{env}=c but no C compiler was found (cc or $CC); install gcc "
                              f"or set {env}={other}")  # fmt: skip
        return False
    return True


def build(source: Path, env: str, other: str) -> ctypes.CDLL:
    """Compile `source` (once per source, flags, compiler and CPU) and load it."""
    cc = compiler()
    if cc is None:
        raise KernelError(f"no C compiler (cc or $CC) to build {source.name}; set {env}={other}")
    src = source.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(),
                                     cpu_id().encode()])).hexdigest()[:16]  # fmt: skip
    out = workbench_home() / "kernels" / f"{source.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            res = subprocess.run([cc, *FLAGS, "-o", str(so), str(source), "-lpthread", "-lm"],
                                 capture_output=True, text=True)  # fmt: skip
            if res.returncode != 0:
                raise KernelError(f"building {source} with {cc} failed:\n{res.stderr.strip()}\n"
                                  f"Fix the compiler, or set {env}={other} to use torch.")  # fmt: skip
            with open(so, "rb") as f:
                os.fsync(f.fileno())
            os.replace(so, out)  # atomic: a concurrent build of the same key writes the same
    return ctypes.CDLL(str(out))
