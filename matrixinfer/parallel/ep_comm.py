"""Fused dispatch / combine for expert parallelism, over static double buffers.

Dispatch moves each token to the EP ranks that hold its top-k experts in ONE exchange
(`all_to_all_single`, which gloo and NCCL both have); combine brings the weighted expert outputs
back in a second. A dispatched row carries everything the expert side needs:

    [ payload: hidden as int8 | bfloat16 | float32 ][ fp32 scale (int8 only) ][ k fp32 routing
      weights ][ k int16 global expert ids ][ pad to 4 bytes ]

(one more weight/id slot, SHARED, when shared experts sit on dedicated ranks.)

A token goes once to each rank holding at least one of its experts (not once per expert), with
all k ids and weights; the receiver keeps the pairs whose expert it holds, runs its experts,
multiplies by the routing weights and sums per row, so combine returns one row per (token,
rank) in the model dtype and the source adds those rows. The token index does not travel:
combine answers in the slot dispatch used, and the source remembers which token it put there.

Counts. Nothing is exchanged but the rows: every rank knows, from the scheduler output all ranks
receive, how many tokens each rank runs this step, so the segment each rank sends to each peer
is `step_tokens` rows (the largest rank's token count: the most rows one source can send one
destination). Unused rows are marked empty (ids -1) by their sender; the exchange therefore
moves `ep x step_tokens x row_bytes` per rank whatever the fill, the cost of having no count
exchange (a sparse step sends padding; the paper's FusedDispatch does the same with fixed slots).

Static buffers: sized once at start-up for `max_tokens` (the scheduler's token budget) and
allocated twice; consecutive MoE calls alternate between the two sets, so one set may still be
in flight (microbatch overlap) while the next is packed. The hot path writes into views of
these buffers (the result too: a view of the set's output rows, consumed by the caller before
the set comes round again); what it allocates is index tensors of O(tokens x k) and whatever the
experts' own computation allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter as _now

import torch
import torch.distributed as dist

from matrixinfer.parallel.state import ParallelGroup
from matrixinfer.quant.int8 import quantize_per_token_

DISPATCH_DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of one dispatched row."""

    hidden: int
    top_k: int
    dtype: str  # int8 | bfloat16 | float32

    @property
    def payload_bytes(self) -> int:
        return _align4(self.hidden * DISPATCH_DTYPES[self.dtype].itemsize)

    @property
    def scale_off(self) -> int:
        return self.payload_bytes

    @property
    def weights_off(self) -> int:
        return self.scale_off + (4 if self.dtype == "int8" else 0)

    @property
    def ids_off(self) -> int:
        return self.weights_off + 4 * self.top_k

    @property
    def row_bytes(self) -> int:
        return _align4(self.ids_off + 2 * self.top_k)

    @property
    def metadata_bytes(self) -> int:
        """Everything in a row but the hidden payload (scale, weights, ids, padding)."""
        return self.row_bytes - self.hidden * DISPATCH_DTYPES[self.dtype].itemsize

    def payload(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, : self.hidden * DISPATCH_DTYPES[self.dtype].itemsize].view(DISPATCH_DTYPES[self.dtype])

    def scale(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.scale_off: self.scale_off + 4].view(torch.float32)

    def weights(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.weights_off: self.ids_off].view(torch.float32)

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.ids_off: self.ids_off + 2 * self.top_k].view(torch.int16)


class _Buffers:
    """One set: per-token staging rows, dispatch send/receive, the expert side's input rows,
    combine send/receive and the summed output."""

    def __init__(self, ep: int, max_tokens: int, layout: RowLayout, out_dtype: torch.dtype, device):
        r, h, k = layout.row_bytes, layout.hidden, layout.top_k
        wire = DISPATCH_DTYPES[layout.dtype]

        def zeros(*shape, dtype=torch.uint8):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.stage = zeros(max_tokens, r)
        self.work = zeros(max_tokens, h, dtype=torch.float32) if layout.dtype == "int8" else None
        self.send, self.recv = zeros(ep * max_tokens * r), zeros(ep * max_tokens * r)
        # expert input: one row per (received row, local expert) pair, at most k per row
        self.pairs = zeros(ep * max_tokens * k, h, dtype=wire)
        self.xin = self.pairs if wire == out_dtype else zeros(ep * max_tokens * k, h, dtype=out_dtype)
        self.comb_send = zeros(ep * max_tokens * h, dtype=out_dtype)
        self.comb_recv = zeros(ep * max_tokens * h, dtype=out_dtype)
        self.out = zeros(max_tokens, h, dtype=out_dtype)

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.stage, self.work, self.send, self.recv, self.pairs, self.xin, self.comb_send, self.comb_recv,
              self.out]
        unique = {id(t): t for t in ts if t is not None}
        return list(unique.values())


@dataclass
class CommStats:
    calls: int = 0
    dispatch_s: float = 0.0  # time waiting for the dispatch exchange (all of it when nothing overlaps)
    combine_s: float = 0.0
    rows_sent: int = 0  # rows holding a token (to any rank, this one included)
    tokens: int = 0  # tokens dispatched


SHARED = -2  # the id slot that sends a token to a dedicated shared-expert rank


class EPDispatcher:
    """Dispatch/combine for one EP group. `owner[e]` is the EP rank holding routed expert e
    (with redundant experts, each layer's `experts.routing` says instead).

    shared_ranks: the EP ranks that hold the shared experts (the paper's dedicated placement;
    they hold no routed expert). Each token then also goes to one of them (in turn by token
    index), its row carrying one more id slot (SHARED, weight 1), and the combine brings the
    shared experts' output back with the routed ones. Empty: shared experts are replicated and
    every rank runs them on its own tokens (the MoE layer does, not the dispatcher)."""

    def __init__(self, group: ParallelGroup, owner: list[int], top_k: int, hidden: int, max_tokens: int,
                 dispatch_dtype: str, out_dtype: torch.dtype, device: torch.device | str = "cpu",
                 timed: bool = False, shared_ranks: list[int] = ()):
        if dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch dtype {dispatch_dtype!r}: one of {', '.join(DISPATCH_DTYPES)}")
        if len(owner) >= 2**15:
            raise ValueError("expert ids travel as int16: at most 32767 experts")
        self.group, self.ep, self.rank = group, group.size, group.rank
        self.shared_ranks = list(shared_ranks)
        self._shared_t = torch.tensor(self.shared_ranks, dtype=torch.long, device=device)
        self.layout = RowLayout(hidden, top_k + (1 if self.shared_ranks else 0), dispatch_dtype)
        self.max_tokens = max_tokens
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self.ranks = torch.arange(self.ep, device=device)
        self.sets = [_Buffers(self.ep, max_tokens, self.layout, out_dtype, device) for _ in range(2)]
        self.parity = 0
        self.step_tokens = max_tokens  # rows per peer segment this step (set_step_tokens)
        self.timed, self.stats = timed, CommStats()

    def set_step_tokens(self, n: int) -> None:
        """The most tokens any EP rank runs this step (every rank computes the same number)."""
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens on one rank exceed the dispatch buffers' {self.max_tokens}")
        self.step_tokens = max(1, n)

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.tensors())

    def _start(self, out: torch.Tensor, inp: torch.Tensor):
        """Issue one exchange (asynchronously); None when there is no peer."""
        if self.ep == 1:
            out.copy_(inp)
            return None
        return dist.all_to_all_single(out, inp, group=self.group.group, async_op=True)

    def _wait(self, work) -> float:
        if work is None:
            return 0.0
        t0 = _now() if self.timed else 0.0
        work.wait()
        return _now() - t0 if self.timed else 0.0

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        """x [N, H] (this rank's tokens), routing weights/ids [N, k] -> the routed experts'
        weighted sum [N, H] (a TP partial sum, like RoutedExperts.forward). `experts` is this
        rank's RoutedExperts; every EP rank calls this once per MoE layer, N = 0 included.
        The three phases run back to back; a microbatch pipeline interleaves them instead."""
        pending = self.dispatch(x, weights, ids, experts)
        self.compute(pending)
        return self.combine(pending)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                 shared=None) -> "_Pending":
        """Pack this rank's rows into the next buffer set and start the dispatch exchange.
        `shared`: the layer's shared experts (used where this rank is a dedicated shared rank)."""
        buf = self.sets[self.parity]
        self.parity ^= 1
        lay, ep, cap, n = self.layout, self.ep, self.step_tokens, x.shape[0]
        if n > cap:
            raise ValueError(f"{n} tokens but the step was announced with at most {cap} per rank")
        r_bytes = lay.row_bytes
        routing = getattr(experts, "routing", None)  # redundant experts (eplb.py): rows carry physical ids
        owner = self.owner
        if routing is not None:
            routing.record(ids)
            ids, owner = routing.to_physical(ids, self.rank), routing.owner
        # 1. one packed row per token: payload (quantized in place for int8), weights, ids
        stage = buf.stage[:n]
        if buf.work is not None:
            work = buf.work[:n]
            work.copy_(x)
            quantize_per_token_(work, lay.payload(stage), lay.scale(stage))
        else:
            lay.payload(stage).copy_(x)
        k = ids.shape[1]
        lay.weights(stage)[:, :k].copy_(weights)
        lay.ids(stage)[:, :k].copy_(ids)
        # 2. each destination's segment: the rows of the tokens with an expert there, in token order
        dest = (owner[ids].unsqueeze(-1) == self.ranks).any(1)  # [N, ep]
        if self.shared_ranks:
            lay.weights(stage)[:, k].fill_(1.0)
            lay.ids(stage)[:, k].fill_(SHARED)
            tokens = torch.arange(n, device=x.device)
            dest[tokens, self._shared_t[(tokens + self.rank) % len(self.shared_ranks)]] = True
        send = buf.send[: ep * cap * r_bytes].view(ep, cap, r_bytes)
        tokens_to = []
        for d in range(ep):
            t = dest[:, d].nonzero().flatten()
            m = t.numel()
            torch.index_select(stage, 0, t, out=send[d, :m])
            lay.ids(send[d, m:]).fill_(-1)
            tokens_to.append(t)
        recv = buf.recv[: ep * cap * r_bytes].view(ep * cap, r_bytes)
        self.stats.calls += 1
        self.stats.tokens += n
        self.stats.rows_sent += sum(t.numel() for t in tokens_to)
        return _Pending(buf, cap, n, experts, shared, tokens_to, recv, self._start(recv.view(-1), send.view(-1)))

    def _expert_input(self, recv: torch.Tensor, rows: torch.Tensor, buf: _Buffers) -> torch.Tensor:
        """The received payloads of `rows`, dequantized to the model dtype, in the set's static rows."""
        lay, n = self.layout, rows.numel()
        torch.index_select(lay.payload(recv), 0, rows, out=buf.pairs[:n])
        xs = buf.xin[:n]
        if buf.xin is not buf.pairs:
            xs.copy_(buf.pairs[:n])
        if lay.dtype == "int8":
            xs.mul_(lay.scale(recv)[rows])
        return xs

    def compute(self, p: "_Pending") -> None:
        """Wait for the dispatch, run this rank's experts on the (row, local expert) pairs it
        received, weight and sum them per row, and start the combine exchange."""
        self.stats.dispatch_s += self._wait(p.work)
        lay, buf, recv, experts = self.layout, p.buf, p.recv, p.experts
        comb = buf.comb_send[: self.ep * p.cap * lay.hidden].view(self.ep * p.cap, lay.hidden)
        comb.zero_()
        k = lay.top_k
        rids = lay.ids(recv).long()  # [ep*cap, k]; -1: empty slot
        local = experts.local_of(rids).flatten()
        pair = (local >= 0).nonzero().flatten()
        local = local[pair]
        order = local.argsort(stable=True)
        pair, local = pair[order], local[order]
        row, slot = pair // k, pair % k
        if pair.numel():
            n_pairs = pair.numel()
            xs = self._expert_input(recv, row, buf)
            counts = torch.bincount(local, minlength=len(experts.expert_ids))
            y = experts.quant_method.apply(experts, xs, local, counts)
            y.mul_(lay.weights(recv)[row, slot, None].to(y.dtype))
            comb.index_add_(0, row, y)
        if self.rank in self.shared_ranks:  # a dedicated shared-expert rank: every row it got is for them
            rows = (rids == SHARED).any(1).nonzero().flatten()
            if rows.numel():
                comb.index_add_(0, rows, p.shared(self._expert_input(recv, rows, buf)))
        # every row goes back to the slot it came from
        p.back = buf.comb_recv[: self.ep * p.cap * lay.hidden].view(self.ep, p.cap, lay.hidden)
        p.work = self._start(p.back.view(-1), comb.view(-1))

    def combine(self, p: "_Pending") -> torch.Tensor:
        """Wait for the combine and sum each token's rows: a view of the set's output rows, which
        the caller consumes before this set comes round again."""
        self.stats.combine_s += self._wait(p.work)
        out = p.buf.out[: p.n]
        out.zero_()
        for d, t in enumerate(p.tokens_to):
            if t.numel():
                out.index_add_(0, t, p.back[d, : t.numel()])
        return out


@dataclass
class _Pending:
    """One MoE call between its phases."""

    buf: _Buffers
    cap: int
    n: int
    experts: object
    shared: object  # the layer's shared experts (dedicated placement), else None
    tokens_to: list[torch.Tensor]
    recv: torch.Tensor
    work: object  # the exchange in flight (None: done)
    back: torch.Tensor | None = None


_DISPATCHER: EPDispatcher | None = None


def set_dispatcher(d: EPDispatcher | None) -> None:
    """Install the process's dispatcher (the worker does, with expert parallelism); the MoE
    layers then exchange tokens through it instead of computing all experts locally."""
    global _DISPATCHER
    _DISPATCHER = d


def get_dispatcher() -> EPDispatcher | None:
    return _DISPATCHER
