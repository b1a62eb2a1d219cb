"""The process's open file limit (RLIMIT_NOFILE), raised at start.

Every connection is a file descriptor. Many systems start a process with a
soft limit of 1,024 although the hard limit allows far more; past the soft
limit the OS refuses new connections (clients see resets) however idle the
open ones are. The server raises the soft limit to the hard one at start and
logs it. Not on Windows, where ``resource`` does not exist.
"""

from __future__ import annotations

import logging
import os

try:
    import resource
except ImportError:  # Windows: no rlimits
    resource = None  # type: ignore[assignment]

log = logging.getLogger("aserve.server")

_NR_OPEN = "/proc/sys/fs/nr_open"  # Linux's ceiling where the hard limit is "unlimited"


def raise_open_file_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now
    (None: no limit known)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if target is None or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open file limit (RLIMIT_NOFILE) from %d: %s", soft, exc)
        return soft
    log.info("raised the open file limit (RLIMIT_NOFILE) from %d to %d", soft, target)
    return target


def open_file_limit() -> int | None:
    """The soft RLIMIT_NOFILE (None: unlimited or unknown)."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def fds_in_use() -> int:
    """Descriptors this process has open now (0 where it cannot be told)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _nr_open() -> int | None:
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
