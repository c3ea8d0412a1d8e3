"""Supernode allocation study and two-tier Clos cost.

Jobs ask for a block of contiguous devices that must sit inside one supernode. With a
saturated queue (there is always work waiting), the NPU allocation rate is the time-averaged
fraction of devices held by jobs: what fragmentation inside and across supernodes leaves.
Bigger supernodes waste less at their edges; bigger blocks fragment more.

Model: a cluster of n supernodes of S devices; job sizes drawn from a distribution with a
given mean, lifetimes exponential (mean 1); when a job ends, the scheduler places every job
of the first `window` waiting ones that fits (first fit, lowest supernode and address first).

Block sizes: the paper gives only the mean block size, so sizes are powers of two from 1 to
128 (what TP / EP groups ask for) with the maximum-entropy distribution of that mean, the
distribution that assumes nothing beyond the mean and the support.
Contiguity: by default a block is a run of contiguous device addresses (the paper's
definition, `contiguous=True`); `contiguous=False` (CLI `--relaxed`) accepts any free devices
of the supernode, which is what a non-blocking UB fabric would physically allow.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

POW2_SUPPORT = (1, 2, 4, 8, 16, 32, 64, 128)


def block_size_distribution(mean: float, support: tuple[int, ...] = POW2_SUPPORT) -> tuple[list[int], list[float]]:
    """Probabilities over `support` with the given mean and maximum entropy (p_i ~ exp(t*s_i)).

    The mean rises monotonically with t, so t is found by bisection."""
    sizes = sorted(set(support))
    if not sizes[0] <= mean <= sizes[-1]:
        raise ValueError(f"mean block size {mean} outside support [{sizes[0]}, {sizes[-1]}]")
    if len(sizes) == 1:
        return sizes, [1.0]

    def probs(t: float) -> list[float]:
        m = max(t * s for s in sizes)
        w = [math.exp(t * s - m) for s in sizes]
        z = sum(w)
        return [x / z for x in w]

    def mean_of(t: float) -> float:
        return sum(s * p for s, p in zip(sizes, probs(t)))

    lo, hi = -50.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mean_of(mid) < mean:
            lo = mid
        else:
            hi = mid
    return sizes, probs((lo + hi) / 2)


class Supernode:
    """Free space of one supernode as a sorted list of [start, length] runs.

    contiguous=False: any n free devices of the supernode will do (UB is non-blocking, so
    device addresses do not matter); only the free count is kept."""

    def __init__(self, size: int, contiguous: bool = True):
        self.size = size
        self.contiguous = contiguous
        self.free = [[0, size]]
        self.free_count = size

    def allocate(self, n: int) -> int | None:
        if not self.contiguous:
            if self.free_count < n:
                return None
            self.free_count -= n
            return 0
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    self.free.pop(i)
                else:
                    self.free[i] = [start + n, length - n]
                return start
        return None

    def release(self, start: int, n: int) -> None:
        if not self.contiguous:
            self.free_count += n
            return
        runs = self.free
        i = 0
        while i < len(runs) and runs[i][0] < start:
            i += 1
        runs.insert(i, [start, n])
        if i + 1 < len(runs) and runs[i][0] + runs[i][1] == runs[i + 1][0]:
            runs[i][1] += runs.pop(i + 1)[1]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == runs[i][0]:
            runs[i - 1][1] += runs.pop(i)[1]


@dataclass(frozen=True)
class AllocationResult:
    supernode_size: int
    supernodes: int
    mean_block: float
    allocation_rate: float


def simulate_allocation(supernode_size: int, mean_block: float, total_devices: int = 8192,
                        support: tuple[int, ...] = POW2_SUPPORT, jobs: int = 20000, window: int = 16,
                        warmup: float = 0.2, seed: int = 0, contiguous: bool = True) -> AllocationResult:
    """Time-averaged allocation rate of a saturated cluster of ~total_devices devices."""
    support = tuple(s for s in support if s <= supernode_size)
    sizes, probs = block_size_distribution(mean_block, support)
    rng = random.Random(seed)
    n_sn = max(1, round(total_devices / supernode_size))
    nodes = [Supernode(supernode_size, contiguous) for _ in range(n_sn)]
    capacity = n_sn * supernode_size
    waiting: list[int] = []  # sizes of the first `window` waiting jobs
    departures: list[tuple[float, int, int, int, int]] = []  # (time, seq, supernode, start, size)
    used, now, seq = 0, 0.0, 0
    busy_area, measured_time, t_start = 0.0, 0.0, None

    def place(size: int, candidates) -> bool:
        nonlocal used, seq
        for k in candidates:
            start = nodes[k].allocate(size)
            if start is not None:
                used += size
                seq += 1
                heapq.heappush(departures, (now + rng.expovariate(1.0), seq, k, start, size))
                return True
        return False

    def refill(candidates) -> None:
        kept = [s for s in waiting if not place(s, candidates)]
        waiting[:] = kept
        while len(waiting) < window:  # new jobs enter the window and are tried everywhere
            s = rng.choices(sizes, probs)[0]
            if not place(s, range(n_sn)):
                waiting.append(s)

    refill(range(n_sn))
    warm_jobs = int(jobs * warmup)
    for done in range(jobs):
        t, _, k, start, size = heapq.heappop(departures)
        if done >= warm_jobs:
            if t_start is None:
                t_start = now
            busy_area += used * (t - now)
            measured_time += t - now
        now = t
        nodes[k].release(start, size)
        used -= size
        refill([k])
    rate = busy_area / (measured_time * capacity) if measured_time else used / capacity
    return AllocationResult(supernode_size, n_sn, mean_block, rate)


@dataclass(frozen=True)
class ClosCost:
    devices: int
    feasible: bool  # fits in two tiers with this radix
    l1_switches: int
    l2_switches: int
    switches_per_device: float
    port_utilisation: float  # used ports / provisioned switch ports
    min_l2_radix: int  # smallest L2 radix that keeps this size in two tiers


def clos_cost(devices: int, links_per_device: int = 7, l1_down: int = 16, l1_up: int = 16,
              l2_radix: int = 48) -> ClosCost:
    """Two-tier folded Clos, one plane per device link (CloudMatrix: 7 planes).

    Per plane: L1 = ceil(S / l1_down) switches, each with l1_up uplinks; L2 switches of
    `l2_radix` ports, each with one port to every L1 of the plane, so two tiers hold at most
    l2_radix L1 switches (l2_radix * l1_down devices). Non-blocking when l1_up >= l1_down.
    """
    n_l1 = math.ceil(devices / l1_down)
    n_l2 = math.ceil(n_l1 * l1_up / l2_radix)
    feasible = n_l1 <= l2_radix
    ports = n_l1 * (l1_down + l1_up) + n_l2 * l2_radix
    used = devices + 2 * n_l1 * l1_up
    total = links_per_device * (n_l1 + n_l2)
    return ClosCost(devices, feasible, links_per_device * n_l1, links_per_device * n_l2, total / devices, used / ports,
                    n_l1)
