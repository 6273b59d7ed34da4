"""Who else runs on this machine: other lengthwise runs and the load average, for the run's
diagnosis (two jobs on a 2-core machine each start as many torch threads as there are cores)."""

from __future__ import annotations

import os
from pathlib import Path

COMMANDS_THAT_COMPUTE = ("run", "sweep", "loadtest")


def is_lengthwise_job(argv: list[str]) -> bool:
    """A `lengthwise run|sweep|loadtest` (or `python -m pipeline.cli …`) command line."""
    for position, arg in enumerate(argv[:-1]):
        program = os.path.basename(arg) == "lengthwise" or (arg == "-m" and argv[position + 1] == "pipeline.cli")
        following = argv[position + 2:position + 3] if arg == "-m" else argv[position + 1:position + 2]
        if program and following and following[0] in COMMANDS_THAT_COMPUTE:
            return True
    return False


def other_jobs(argvs: dict[int, list[str]], parents: dict[int, int], me: int) -> list[int]:
    """The lengthwise jobs among `argvs` (pid → command line) that are neither this process,
    its ancestors nor its descendants (`parents`: pid → parent pid)."""
    def lineage(pid: int) -> set[int]:
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
        return seen

    mine = lineage(me) | {pid for pid in argvs if me in lineage(pid)}
    return sorted(pid for pid, argv in argvs.items() if pid not in mine and is_lengthwise_job(argv))


def read_processes() -> tuple[dict[int, list[str]], dict[int, int]]:
    """Command lines and parents of this machine's processes (empty where /proc is not)."""
    argvs, parents = {}, {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argvs[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return argvs, parents


def machine_load() -> dict:
    """Other lengthwise jobs running now (pids) and the 1-minute load average."""
    argvs, parents = read_processes()
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"other_jobs": other_jobs(argvs, parents, os.getpid()), "load_average": load}
