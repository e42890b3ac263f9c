"""What this CPU can run, asked of the CPU itself (CPUID), not of ``/proc/cpuinfo``.

``/proc/cpuinfo`` describes the host's CPU, which is not always the CPU a
process runs on: an emulator such as ``qemu-x86_64 -cpu Haswell`` shows the
host's AVX-512 flags there while executing none of them. CPUID answers for
the CPU that executes us. It is one instruction with no Python binding, so
it runs as a 40-byte function placed in an executable page::

    cpuid(leaf: edi, subleaf: esi, out: rdx)    xgetbv()
      push rbx                                    xor ecx, ecx
      mov eax, edi ; mov ecx, esi ; mov r8, rdx   xgetbv
      cpuid                                       shl rdx, 32 ; or rax, rdx
      mov [r8], eax ; mov [r8+4], ebx             ret
      mov [r8+8], ecx ; mov [r8+12], edx
      pop rbx ; ret

Both instructions are in every x86-64 CPU (XGETBV is used only when CPUID
says the OS enabled it). Where the page cannot be made executable, or on
another architecture, the flags come from ``/proc/cpuinfo``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import platform

_CPUID_CODE = bytes.fromhex("53" "89f8" "89f1" "4989d0" "0fa2" "418900" "41895804" "41894808" "4189500c" "5b" "c3")
_XGETBV_CODE = bytes.fromhex("31c9" "0f01d0" "48c1e220" "4809d0" "c3")

# flag name (as /proc/cpuinfo spells it): (leaf, subleaf, register index eax=0 ebx=1 ecx=2 edx=3, bit)
_CPUID_BITS = {
    "pni": (1, 0, 2, 0), "ssse3": (1, 0, 2, 9), "fma": (1, 0, 2, 12), "sse4_1": (1, 0, 2, 19),
    "sse4_2": (1, 0, 2, 20), "popcnt": (1, 0, 2, 23), "avx": (1, 0, 2, 28), "f16c": (1, 0, 2, 29),
    "avx2": (7, 0, 1, 5), "bmi2": (7, 0, 1, 8), "avx512f": (7, 0, 1, 16), "avx512dq": (7, 0, 1, 17),
    "avx512ifma": (7, 0, 1, 21), "avx512cd": (7, 0, 1, 28), "avx512bw": (7, 0, 1, 30), "avx512vl": (7, 0, 1, 31),
    "avx512vbmi": (7, 0, 2, 1), "avx512_vnni": (7, 0, 2, 11), "avx_vnni": (7, 1, 0, 4), "avx512_bf16": (7, 1, 0, 5),
    "amx_int8": (7, 0, 3, 25),
}
_OSXSAVE = (1, 0, 2, 27)
_XCR0_AVX = 0b110          # SSE and AVX state saved by the OS
_XCR0_AVX512 = 0b11100110  # and the three AVX-512 state components
_XCR0_AMX = 0b11 << 17     # tile configuration and tile data


class _Native:
    """The two functions above, in one read-and-execute page (written, then mprotect'ed: never W and X at once)."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._page[:len(_CPUID_CODE)] = _CPUID_CODE
        self._page[64:64 + len(_XGETBV_CODE)] = _XGETBV_CODE
        anchor = ctypes.c_char.from_buffer(self._page)
        address = ctypes.addressof(anchor)
        del anchor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            raise OSError(ctypes.get_errno(), "mprotect refused an executable page")
        self.cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32,
                                      ctypes.POINTER(ctypes.c_uint32 * 4))(address)
        self.xgetbv = ctypes.CFUNCTYPE(ctypes.c_uint64)(address + 64)

    def registers(self, leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
        out = (ctypes.c_uint32 * 4)()
        self.cpuid(leaf, subleaf, ctypes.byref(out))
        return out[0], out[1], out[2], out[3]


def _bit(regs: dict[tuple[int, int], tuple[int, int, int, int]], where: tuple[int, int, int, int]) -> bool:
    leaf, subleaf, reg, bit = where
    values = regs.get((leaf, subleaf))
    return values is not None and bool(values[reg] >> bit & 1)


def is_x86_64() -> bool:
    """Whether this process runs x86-64 code (where CPUID exists and stores are totally ordered)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def _cpuid_flags() -> tuple[frozenset[str], str] | None:
    """Flags from CPUID (with the OS's XCR0 for the AVX families) and the raw registers, or None."""
    if not is_x86_64():
        return None
    try:
        native = _Native()
    except (OSError, ValueError):
        return None
    max_leaf = native.registers(0)[0]
    regs = {(1, 0): native.registers(1)}
    if max_leaf >= 7:
        regs[(7, 0)] = native.registers(7, 0)
        regs[(7, 1)] = native.registers(7, 1)
    xcr0 = native.xgetbv() if _bit(regs, _OSXSAVE) else 0
    flags = set()
    for name, where in _CPUID_BITS.items():
        if not _bit(regs, where):
            continue
        if name.startswith("avx512") and xcr0 & _XCR0_AVX512 != _XCR0_AVX512:
            continue
        if name.startswith(("avx", "fma", "f16c")) and xcr0 & _XCR0_AVX != _XCR0_AVX:
            continue
        if name.startswith("amx") and xcr0 & _XCR0_AMX != _XCR0_AMX:
            continue
        flags.add(name)
    # leaf 1's EAX is family/model/stepping; its EBX holds the APIC id of whichever core ran the call: left out
    return frozenset(flags), f"{regs[(1, 0)][0]:08x} xcr0:{xcr0:x} {' '.join(sorted(flags))}"


def _proc_cpuinfo() -> tuple[frozenset[str], str]:
    flags: frozenset[str] = frozenset()
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                elif key in ("model name", "CPU part") and not model:
                    model = value.strip()
    except OSError:
        pass
    return flags, model


@functools.cache
def flags() -> frozenset[str]:
    """The ISA extensions this process can execute, named as ``/proc/cpuinfo`` names them."""
    asked = _cpuid_flags()
    return asked[0] if asked is not None else _proc_cpuinfo()[0]


@functools.cache
def model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` (or the architecture when it has none)."""
    return _proc_cpuinfo()[1] or platform.machine()


@functools.cache
def signature() -> str:
    """A short digest that changes whenever the CPU a process runs on could execute different instructions."""
    asked = _cpuid_flags()
    basis = asked[1] if asked is not None else " ".join(sorted(_proc_cpuinfo()[0]))
    return hashlib.sha256(f"{platform.machine()} {basis}".encode()).hexdigest()[:16]


def describe() -> str:
    """One line for receipts and ``doctor``: model and the vector flags that decide which code runs."""
    wide = sorted(f for f in flags() if f.startswith(("avx", "fma", "f16c")))
    avx512 = "AVX-512" if "avx512f" in flags() else "no AVX-512"
    return f"{model()} ({avx512}; {' '.join(wide) or 'no AVX'})"
