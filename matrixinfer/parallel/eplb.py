"""Expert-parallel load balancing (EPLB): redundant experts placed from measured load.

The placement (pure functions, after DeepSeek's EPLB global policy): given the tokens each
logical expert received over a window, give the hottest experts extra replicas until there are
`num_experts + R` physical experts (each step: one more replica for the expert with the most
tokens per replica), then pack the physical experts onto the EP ranks, heaviest first onto the
least-loaded rank with a free slot (`balanced_packing`). Every rank holds a fixed number of
slots (the partition of the physical count), so parameter shapes never change after start-up.
The result is the triple DeepSeek's EPLB returns: phy2log, log2phy (padded with -1), logcnt.

At run time (`ExpertBalancer`) the routed experts of each MoE layer hold physical slots; a
token's (logical) expert goes to one of its replicas (spread by token index) and the dispatch
row carries the physical id. Per-layer token counts of logical experts are kept over a sliding
window of steps; every `interval` steps the ranks sum their windows (one all-reduce), all
compute the same new placement, and move expert weights between ranks with one
`all_to_all_single` per parameter: a slot whose expert the rank already holds copies locally,
the others come from the lowest rank holding that expert. This happens between steps, so
requests in flight only see identical weights in other places: outputs do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from matrixinfer.parallel.state import ParallelGroup, expert_partition


@dataclass
class Placement:
    phy2log: list[int]  # logical expert of each physical expert; rank r holds a contiguous range
    slots: list[int]  # physical experts per rank
    logcnt: list[int]  # replicas of each logical expert

    @property
    def num_logical(self) -> int:
        return len(self.logcnt)

    def ranks(self) -> list[list[int]]:
        """Physical ids of each rank."""
        out, start = [], 0
        for n in self.slots:
            out.append(list(range(start, start + n)))
            start += n
        return out

    def owner(self) -> list[int]:
        return [r for r, ids in enumerate(self.ranks()) for _ in ids]

    def log2phy(self) -> list[list[int]]:
        """The physical ids of each logical expert, padded with -1 to the most replicas."""
        width = max(self.logcnt)
        out = [[] for _ in self.logcnt]
        for p, e in enumerate(self.phy2log):
            out[e].append(p)
        return [ids + [-1] * (width - len(ids)) for ids in out]

    def rank_loads(self, load: list[float]) -> list[float]:
        """Tokens each rank receives when each logical expert's tokens spread evenly over its replicas."""
        return [sum(load[self.phy2log[p]] / self.logcnt[self.phy2log[p]] for p in ids) for ids in self.ranks()]


def static_placement(num_experts: int, ep: int) -> Placement:
    """No redundancy: the contiguous partition the loader uses (physical id = logical id)."""
    return Placement(list(range(num_experts)), [len(ids) for ids in expert_partition(num_experts, ep)],
                     [1] * num_experts)


def replicate(load: list[float], num_physical: int) -> tuple[list[int], list[int]]:
    """phy2log (the logical experts, then one extra replica at a time for the expert with the
    most tokens per replica) and logcnt."""
    phy2log, logcnt = list(range(len(load))), [1] * len(load)
    for _ in range(num_physical - len(load)):
        e = max(range(len(load)), key=lambda i: (load[i] / logcnt[i], -i))
        phy2log.append(e)
        logcnt[e] += 1
    return phy2log, logcnt


def balanced_packing(weights: list[float], capacities: list[int]) -> list[int]:
    """The pack of each item: heaviest first onto the lightest pack that has room (ties: the
    lower index), as DeepSeek's balanced_packing with per-pack capacities."""
    if len(weights) != sum(capacities):
        raise ValueError(f"{len(weights)} items for {sum(capacities)} slots")
    pack, loads, room = [0] * len(weights), [0.0] * len(capacities), list(capacities)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        p = min((j for j in range(len(capacities)) if room[j]), key=lambda j: (loads[j], j))
        pack[i], loads[p], room[p] = p, loads[p] + weights[i], room[p] - 1
    return pack


def rebalance(load: list[float], ep: int, num_redundant: int) -> Placement:
    """The placement of len(load) logical experts + num_redundant replicas on ep ranks."""
    n = len(load) + num_redundant
    phy2log, logcnt = replicate(load, n)
    slots = [len(ids) for ids in expert_partition(n, ep)]
    pack = balanced_packing([load[e] / logcnt[e] for e in phy2log], slots)
    # rank-major physical numbering; inside a rank, logical order (so expert order is kept)
    order = sorted(range(n), key=lambda i: (pack[i], phy2log[i]))
    return Placement([phy2log[i] for i in order], slots, logcnt)


def imbalance(loads: list[float]) -> float:
    """max / mean tokens per rank (1.0: perfectly balanced)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


class LayerRouting:
    """One MoE layer's placement as device tensors: logical ids -> physical ids -> owner rank."""

    def __init__(self, placement: Placement, rank: int, device):
        self.placement = placement
        self.log2phy = torch.tensor(placement.log2phy(), dtype=torch.long, device=device)
        self.logcnt = torch.tensor(placement.logcnt, dtype=torch.long, device=device)
        self.owner = torch.tensor(placement.owner(), dtype=torch.long, device=device)
        self.local_phys = placement.ranks()[rank]
        self.counts = torch.zeros(len(placement.logcnt), dtype=torch.long, device=device)  # this step's tokens

    def record(self, ids: torch.Tensor) -> None:
        self.counts += torch.bincount(ids.flatten(), minlength=self.counts.numel())

    def to_physical(self, ids: torch.Tensor, rank: int) -> torch.Tensor:
        """One replica per (token, expert): replicas taken in turn by token index (offset by rank)."""
        turn = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + rank
        return self.log2phy[ids, turn % self.logcnt[ids]]


def _install(experts, routing: LayerRouting) -> None:
    """Point a RoutedExperts' slot tables at `routing` (its parameters already hold those slots)."""
    p = routing.placement
    experts.expert_ids = [p.phy2log[i] for i in routing.local_phys]
    experts.local_index = torch.full((len(p.phy2log),), -1, dtype=torch.long, device=routing.owner.device)
    experts.local_index[routing.local_phys] = torch.arange(len(routing.local_phys), device=routing.owner.device)
    experts.routing = routing


def move_experts(experts, old: Placement, new: Placement, group: ParallelGroup) -> None:
    """Refill every stacked parameter of `experts` (this rank's slots of `old`) with the slots of
    `new`, fetching from other ranks what this rank does not hold. Every EP rank calls it."""
    me, size = group.rank, group.size
    old_ranks, new_ranks = old.ranks(), new.ranks()
    held = [{old.phy2log[p]: i for i, p in enumerate(ids)} for ids in old_ranks]  # rank -> logical -> old slot
    source = {}
    for r in range(size):
        for e in held[r]:
            source.setdefault(e, r)
    # what each rank needs from elsewhere, in its slot order: (slot, logical, source rank)
    needs = [[(s, new.phy2log[p], source[new.phy2log[p]]) for s, p in enumerate(new_ranks[r])
              if new.phy2log[p] not in held[r]] for r in range(size)]
    for name, param in list(experts.named_parameters(recurse=False)):
        data = param.data
        flat = data.reshape(data.shape[0], math.prod(data.shape[1:]))  # no -1: a shared rank holds 0 slots
        fresh = data.new_empty((len(new_ranks[me]),) + tuple(data.shape[1:]))
        for s, p in enumerate(new_ranks[me]):
            e = new.phy2log[p]
            if e in held[me]:
                fresh[s] = data[held[me][e]]
        if size > 1:
            send = [held[me][e] for r in range(size) for _, e, src in needs[r] if src == me]
            send_splits = [sum(1 for _, _, src in needs[r] if src == me) for r in range(size)]
            recv_from = [[(s, e) for s, e, src in needs[me] if src == r] for r in range(size)]
            inp = flat[send].contiguous() if send else flat.new_empty(0, flat.shape[1])
            out = flat.new_empty(sum(map(len, recv_from)), flat.shape[1])
            width = flat.shape[1]
            dist.all_to_all_single(out.view(-1), inp.view(-1), [len(x) * width for x in recv_from],
                                   [n * width for n in send_splits], group=group.group)
            row = 0
            for r in range(size):
                for s, _ in recv_from[r]:
                    fresh[s] = out[row].view(data.shape[1:])
                    row += 1
        if fresh.shape == data.shape:
            data.copy_(fresh)  # the same storage: nothing that points at it goes stale
        else:
            param.data = fresh  # the first installation may change the slot count
    if getattr(experts, "small_mm_weights", None) is not None:  # the few-rows operator's packed copies
        experts.quant_method.pack_small_mm(experts)


def on_ranks(placement: Placement, size: int) -> Placement:
    """A placement over the first ranks of a group of `size`, the others holding no routed
    expert (dedicated shared-expert ranks: they take part in the weight moves with nothing)."""
    return Placement(placement.phy2log, placement.slots + [0] * (size - len(placement.slots)), placement.logcnt)


class ExpertBalancer:
    """Counts logical-expert tokens per MoE layer over a sliding window and rebalances every
    `interval` steps (interval 0: place once from the static partition, never move). The
    routed experts live on the group's first `routed_ranks` ranks (all of them by default; the
    rest are dedicated shared-expert ranks)."""

    def __init__(self, moe_layers: list, group: ParallelGroup, num_redundant: int, interval: int, window: int,
                 device, routed_ranks: int | None = None):
        self.layers, self.group, self.interval = moe_layers, group, interval
        self.num_redundant, self.device = num_redundant, device
        self.routed = group.size if routed_ranks is None else routed_ranks
        n = moe_layers[0].experts.num_experts
        self.window = torch.zeros(window, len(moe_layers), n, dtype=torch.long, device=device)
        self.steps = 0
        self.placements = [on_ranks(static_placement(n, self.routed), group.size) for _ in moe_layers]
        self.moves = 0
        # the starting placement: uniform load, R replicas spread over the lowest experts
        self._apply([self._rebalance([1.0] * n) for _ in moe_layers])

    def _rebalance(self, load: list[float]) -> Placement:
        return on_ranks(rebalance(load, self.routed, self.num_redundant), self.group.size)

    def end_step(self) -> None:
        """Called by every rank after each step: this step's counts enter the window (the
        oldest step leaves it), and every `interval` steps the experts move."""
        slot = self.window[self.steps % self.window.shape[0]]
        for i, moe in enumerate(self.layers):
            slot[i].copy_(moe.experts.routing.counts)
            moe.experts.routing.counts.zero_()
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            load = self.group.all_reduce(self.window.sum(0))
            # a layer that saw no tokens in the window keeps its placement
            self._apply([self._rebalance(row.tolist()) if row.any() else old
                         for row, old in zip(load, self.placements)])

    def _apply(self, placements: list[Placement]) -> None:
        for moe, old, new in zip(self.layers, self.placements, placements):
            if old != new:
                move_experts(moe.experts, old, new, self.group)
                self.moves += 1
            _install(moe.experts, LayerRouting(new, self.group.rank, self.device))
        self.placements = placements
