"""A machine that refuses one thing, made for real: `python tests/seccomp.py RULE -- ARGV...` runs
ARGV under a seccomp filter (inherited by everything it starts) by which the kernel answers one
call as a machine of that kind would. The filter is a few classic BPF instructions (seccomp(2)),
installed with prctl after PR_SET_NO_NEW_PRIVS; x86_64 only (the test skips elsewhere).

Rules:
- `no-mount-namespace`: unshare(2) asking for a mount namespace with a network namespace fails
  with EPERM, as under a profile that allows the network namespace alone (pasta's own sandbox,
  which asks for a mount namespace without a network one, is let be). The run's own resolv.conf
  cannot then be given to its network namespace.
- `no-populate-write`: madvise(2) with MADV_POPULATE_WRITE fails with EINVAL, as on a kernel
  before Linux 5.14 (RHEL 8's 4.18): a spare cannot copy its pages ahead of a handover.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

SUPPORTED = platform.machine() == "x86_64" and sys.platform == "linux"

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR_UNSHARE, _NR_MADVISE = 272, 28
_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MADV_POPULATE_WRITE = 23
# BPF: ld/jeq/jset/ret, and seccomp's return values
_LD_W_ABS, _JEQ_K, _AND_K, _RET_K = 0x20, 0x15, 0x54, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
# seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 * i (the low 32 bits first: little-endian)
_NR, _ARCH = 0, 4


def _arg(i: int) -> int:
    return 16 + 8 * i


def _program(rule: str) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions: allow all but the rule's one call."""
    if rule == "no-mount-namespace":  # the flags with both bits
        nr, arg, mask, value, err = _NR_UNSHARE, 0, _CLONE_NEWNS | _CLONE_NEWNET, None, errno.EPERM
    elif rule == "no-populate-write":  # the advice, exactly
        nr, arg, mask, value, err = _NR_MADVISE, 2, 0xFFFFFFFF, _MADV_POPULATE_WRITE, errno.EINVAL
    else:
        raise SystemExit(f"unknown rule {rule!r}")
    return [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, 5, _AUDIT_ARCH_X86_64),  # another architecture: allow
        (_LD_W_ABS, 0, 0, _NR),
        (_JEQ_K, 0, 3, nr),
        (_LD_W_ABS, 0, 0, _arg(arg)),
        (_AND_K, 0, 0, mask),
        (_JEQ_K, 1, 0, mask if value is None else value),  # the refused call: to its errno
        (_RET_K, 0, 0, _ALLOW),
        (_RET_K, 0, 0, _ERRNO | err),
    ]


def install(rule: str) -> None:
    """This process (and all it starts) under the rule; OSError where the kernel refuses."""
    code = b"".join(struct.pack("HBBI", *ins) for ins in _program(rule))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    prog = Prog(len(code) // 8, code)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main() -> None:
    rule, dash, *argv = sys.argv[1:]
    if dash != "--" or not argv:
        raise SystemExit("usage: python tests/seccomp.py RULE -- ARGV...")
    install(rule)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
