"""Which process holds a `running` run open, and whether it still can close it.

A run records the process that began it (`environment["process"]`: pid and start time) beside the machine it runs
on (`environment["machine"]`, `environment.machine_id`). A bench that is killed (SIGKILL, or its machine dies)
cannot close its run. Whoever opens the store next on that machine sees the process gone and closes the run
`interrupted` (`ResultStore`); a run of another machine cannot be checked from here and is left as it is.
"""
from __future__ import annotations

import enum
import os
from typing import Any

import psutil

from ..harness.environment import machine_id

KILLED_REASON = "bench process ended without closing the run (killed)"
# psutil derives a start time from the boot time, which the kernel reports to the second: one process reads the same
# value within this much; a new process with a reused pid started later.
_SAME_START_S = 1.0


class Holder(enum.Enum):
    """Where the process that began a `running` run is."""

    ALIVE = "alive"  # on this machine, still running
    GONE = "gone"  # on this machine, ended without closing the run
    ELSEWHERE = "elsewhere"  # another machine (or another start of this one)
    UNKNOWN = "unknown"  # the run recorded no process or machine (older runs), or this machine has no id


def this_process() -> dict[str, float]:
    """What a run records of the process that begins it."""
    return {"pid": os.getpid(), "started": psutil.Process().create_time()}


def holder(environment: dict[str, Any]) -> Holder:
    """Where the process that began a run with this environment is now."""
    process, machine = environment.get("process"), environment.get("machine")
    here = machine_id()
    if not isinstance(process, dict) or machine is None or here is None:
        return Holder.UNKNOWN
    if machine != here:
        return Holder.ELSEWHERE
    try:
        found = psutil.Process(int(process["pid"]))
        same = abs(found.create_time() - float(process["started"])) < _SAME_START_S
        return Holder.ALIVE if same and found.status() != psutil.STATUS_ZOMBIE else Holder.GONE
    except psutil.NoSuchProcess:  # a zombie is a process that ended
        return Holder.GONE
    except psutil.AccessDenied:  # it exists; whose it is cannot be told, so it is left alone
        return Holder.ALIVE
    except (KeyError, TypeError, ValueError):  # not what `this_process` records
        return Holder.UNKNOWN


def status_label(status: str, environment: dict[str, Any]) -> str:
    """A run's status as listed: a running run of another machine says so (it is not checked from here), and so
    does one whose process is gone (left running only in a store this process may not write)."""
    if status != "running":
        return status
    return {Holder.ELSEWHERE: "running (elsewhere)", Holder.GONE: "running (killed)"}.get(holder(environment), status)
