"""Where a whole suite run's CPU goes by kind of process (issue 32), from the kernel's process accounting: every
process that ended is there, the short ones (an Ansible module, a fork of ansible-playbook) and the ones no test
waits for (sshd's and slurmd's children, containers) included.

    apt-get install -y acct                                   # accton and dump-acct
    touch /tmp/suite.pacct && accton /tmp/suite.pacct
    scripts/test.sh; accton off
    .venv/bin/python benchmarks/process_cpu.py /tmp/suite.pacct

A process is named by its command name (comm, 15 characters): Python programs are mostly `python`, so name the
ones to tell apart in a scratch clone first: benchmarks/sitecustomize_names.py names the runner, the reference
servers, the workers and the tests' scripts. ansible-playbook's forks keep its name: they are counted apart.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Ended:
    comm: str
    cpu_s: float
    pid: int
    ppid: int


def read(pacct: str) -> list[Ended]:
    """dump-acct's rows: comm | version | utime | stime | elapsed | ... | pid | ppid | ... (times in 1/100 s)."""
    out = subprocess.run(["dump-acct", pacct], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        rows.append(Ended(f[0], (float(f[2]) + float(f[3])) / 100, int(f[9]), int(f[10])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pacct")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = read(args.pacct)
    comm = {r.pid: r.comm for r in rows}  # a reused PID names its last process: good enough for a split
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        name = r.comm
        if name == "ansible-playboo":
            name += " (fork)" if comm.get(r.ppid) == "ansible-playboo" else " (main)"
        by[name][0] += r.cpu_s
        by[name][1] += 1
    total = sum(v[0] for v in by.values())
    print(f"{total:.0f} CPU-s in {len(rows)} processes")
    for name, (cpu, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{name:24} {cpu:8.1f} CPU-s {100 * cpu / total:5.1f} %  {int(n):6d} processes  {cpu / n:6.2f} each")


if __name__ == "__main__":
    main()
