"""How disturbed a timing is: the share of the machine's CPU time that other processes (and
the hypervisor's steal) took while it ran, from /proc/stat (Linux; "?" elsewhere)."""
import os
import time


def sample(children=False):
    """(monotonic s, busy CPU s of the whole machine, steal s, the CPU s of this benchmark's
    own work: this process's, or with `children` that of its finished child processes), or
    None without /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    tick = os.sysconf("SC_CLK_TCK")
    times = os.times()
    own = times.children_user + times.children_system if children else times.user + times.system
    return time.monotonic(), (user + nice + system + irq + softirq) / tick, steal / tick, own


def others_share(before, after):
    """The share, as "12%", of the machine's CPU time between two samples that went to other
    processes and to steal."""
    if before is None or after is None or after[0] <= before[0]:
        return "?"
    capacity = (after[0] - before[0]) * (os.cpu_count() or 1)
    others = max(0.0, (after[1] - before[1]) - (after[3] - before[3])) + (after[2] - before[2])
    return f"{100 * min(1.0, others / capacity):.0f}%"
