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
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
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


def torch_openmp() -> bool:
    """Whether this process runs GNU OpenMP (libgomp, as torch's Linux wheels do).

    Then a kernel built with -fopenmp (`csrc/parallel.h`) loads that same libgomp (one per
    soname in a process) and runs on torch's own thread pool, instead of starting threads that
    compete with torch's, which spin for a while after each op."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def openmp() -> bool:
    """Whether kernels are built to run on torch's OpenMP threads (`torch_openmp`), not on
    threads of their own. `WORKBENCH_KERNEL_THREADS`: 'auto' (the default) or 'own'."""
    m = os.environ.get("WORKBENCH_KERNEL_THREADS", "auto").strip().lower() or "auto"
    if m not in ("auto", "own"):
        raise KernelError(f"WORKBENCH_KERNEL_THREADS={m!r}: expected 'auto' or 'own'")
    cc = compiler()
    return m == "auto" and cc is not None and torch_openmp() and _openmp_builds(cc)


def _compile(cc: str, flags: list[str], source: Path, so: Path) -> subprocess.CompletedProcess:
    cmd = [cc, *flags, f"-I{CSRC}", "-o", str(so), str(source), "-lpthread", "-lm"]
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.cache
def _openmp_builds(cc: str) -> bool:
    """Whether `cc -fopenmp` builds a shared library (a clang without omp.h does not)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n")
        res = _compile(cc, ["-shared", "-fPIC", "-fopenmp"], src, Path(tmp) / "probe.so")
    if res.returncode != 0:
        warnings.warn(f"{cc} -fopenmp does not build ({res.stderr.strip()[:200]}), so the C "
                      "kernels start threads of their own, which run slower beside torch's",
                      stacklevel=3)  # fmt: skip
    return res.returncode == 0


def build(source: Path, env: str, other: str) -> ctypes.CDLL:
    """Compile `source` (once per source, headers, flags, compiler and CPU) and load it."""
    cc = compiler()
    if cc is None:
        raise KernelError(f"no C compiler (cc or $CC) to build {source.name}; set {env}={other}")
    flags = FLAGS + (["-fopenmp"] if openmp() else [])
    src = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in sorted(CSRC.glob("*.h")))])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                     cpu_id().encode()])).hexdigest()[:16]  # fmt: skip
    out = workbench_home() / "kernels" / f"{source.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            res = _compile(cc, flags, source, so)
            if res.returncode != 0:
                raise KernelError(f"building {source} with {cc} failed:\n{res.stderr.strip()}\n"
                                  f"Fix the compiler, or set {env}={other} to use torch.")  # fmt: skip
            with open(so, "rb") as f:
                os.fsync(f.fileno())
            os.replace(so, out)  # atomic: a concurrent build of the same key writes the same
    return ctypes.CDLL(str(out))
