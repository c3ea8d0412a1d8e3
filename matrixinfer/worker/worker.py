"""One worker per rank: it owns the device, the model (its shard), the paged latent KV cache,
the model runner and the worker half of the KV connector."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from matrixinfer.config import EngineConfig
from matrixinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from matrixinfer.kv_connector import make_worker_connector
from matrixinfer.model.loader import load_model
from matrixinfer.worker.model_runner import ModelRunner
from matrixinfer.worker.structured_output import GrammarMasks

log = logging.getLogger(__name__)


def num_kv_blocks(config: EngineConfig, model, max_model_len: int) -> int:
    """Blocks for max_num_seqs sequences of max_model_len, capped by kv_cache_memory_gb. Every
    rank computes the same number from the same inputs. With k > 1 MTP drafts a sequence also
    holds k - 1 lookahead slots (the recursive drafts write there)."""
    cache = config.cache
    seq_slots = max_model_len + max(0, config.speculative.num_draft_tokens - 1)
    if cache.num_blocks is not None:
        n = cache.num_blocks
    else:
        per_block = ModelRunner.cache_bytes_per_block(model, cache.block_size)
        wanted = config.scheduler.max_num_seqs * -(-seq_slots // cache.block_size)
        n = max(1, min(wanted, int(cache.kv_cache_memory_gb * 2**30) // per_block))
    if n * cache.block_size < seq_slots:
        raise ValueError(f"KV cache of {n} blocks x {cache.block_size} tokens cannot hold one sequence of "
                         f"max_model_len={max_model_len}" + (f" and its {seq_slots - max_model_len} lookahead slots"
                                                             if seq_slots > max_model_len else ""))
    return n


def max_model_len_of(config: EngineConfig, model_max: int) -> int:
    return min(config.scheduler.max_model_len or model_max, model_max)



@dataclass
class ExecutorInfo:
    """What every executor tells the engine core once its workers are up (Worker.info)."""
    num_blocks: int  # KV cache blocks on every rank
    max_model_len: int
    kv_dtype: str
    vocab_size: int
    kv_bytes_per_block: int = 0  # one block's latent KV over all layers (what a hand-off moves)
    weights: dict | None = None  # rank 0's model-cache load report (load_format "ems")

class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 report: Callable[[str], None] | None = None):
        """report: told each start-up stage in words (loading, each graph the warm-up compiles),
        so a rank process can show it is alive and what it does (executor/multiproc.py)."""
        self.config, self.rank, self.world_size = config, rank, world_size
        self.report = report or (lambda text: log.debug("rank %d: %s", rank, text))
        torch.manual_seed(config.seed)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and world_size > 1:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if world_size > 1:
            self._init_distributed(init_method)
        self.load_report = None  # how the weights came in, with load_format "ems"
        self.report(f"loading {config.model}")
        self.model = self._load()
        if config.quantization.method not in (None, "fp8") and not self.model.quantized:
            raise ValueError(f"quantization={config.quantization.method!r} needs a W8A8 checkpoint; {config.model} "
                             "is not quantized (write one with `matrixinfer quantize --model DIR --out DIR`)")
        self.max_model_len = max_model_len_of(config, self.model.config.max_position_embeddings)
        self.num_blocks = num_kv_blocks(config, self.model, self.max_model_len)
        self.runner = self._make_runner()
        self.runner.grammars = GrammarMasks(config.model, self.model.config.vocab_size)  # used on the first grammar
        compiled, prefill = self.runner.compiled_decode, self.runner.compiled_prefill
        from matrixinfer.kernels import bfloat16_gemm_policy

        log.info("rank %d: %d intra-op threads, CPU kernels %s, bfloat16 GEMMs %s, decode step %s, prefill step %s",
                 rank, torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), bfloat16_gemm_policy(),
                 "eager" if compiled is None else f"compiled in {compiled.compile_s:.1f} s",
                 "eager" if prefill is None else f"compiled in {prefill.compile_s:.1f} s ({prefill.graphs} graphs)")
        from matrixinfer.parallel import get_head_group

        self.connector = make_worker_connector(config.kv_transfer, get_head_group().rank)
        if self.connector is not None:
            self.connector.register_kv_cache(self.runner.kv_cache)

    def routed_ranks(self) -> int:
        """EP ranks that hold routed experts (all but the dedicated shared-expert ranks)."""
        par = self.config.parallel
        if par.sequence_parallel:
            return par.world_size
        dedicated = par.shared_expert_placement == "dedicated"
        return par.expert_parallel_size - (par.shared_expert_ranks if dedicated else 0)

    def expert_ids(self) -> list[int] | None:
        """The routed experts this rank holds (None: all of them)."""
        if self.config.parallel.world_size // self.config.parallel.tensor_parallel_size == 1:
            return None
        from matrixinfer.config import ModelConfig
        from matrixinfer.parallel import expert_partition, get_ep_group

        cfg = ModelConfig.from_pretrained(self.config.model)
        if self.config.parallel.shared_expert_placement == "dedicated" and not cfg.n_shared_experts:
            raise ValueError(f"{self.config.model} has no shared experts to place on dedicated ranks")
        parts = expert_partition(cfg.n_routed_experts, self.routed_ranks())
        rank = get_ep_group().rank
        return parts[rank] if rank < len(parts) else []

    def _make_runner(self) -> ModelRunner:
        block_size = self.config.cache.block_size
        par = self.config.parallel
        if par.sequence_parallel:  # SP-TP-SP: eager, its collectives and slices are not compiled
            from matrixinfer.parallel import get_sp_group
            from matrixinfer.worker.sequence_parallel import SequenceParallelRunner

            group = get_sp_group()
            dispatcher = self._dispatcher(group)
            return SequenceParallelRunner(self.model, self.num_blocks, block_size, self.device, group, dispatcher,
                                          par.microbatches, self._balancer(group))
        if self.config.parallel.expert_parallel_size == 1:
            compile_decode = self.config.compiles_decode
            runner = ModelRunner(self.model, self.num_blocks, block_size, self.device, compile_decode,
                                 self.config.speculative.num_draft_tokens, self.config.compiles_prefill,
                                 self.config.batch_invariant)
            runner.warm_up(self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens,
                           self.report)
            return runner
        # expert parallelism runs eagerly: the exchanges' collectives and row counts are not compiled
        from matrixinfer.parallel import get_ep_group
        from matrixinfer.worker.data_parallel import DataParallelRunner

        group = get_ep_group()
        dispatcher = self._dispatcher(group)
        return DataParallelRunner(self.model, self.num_blocks, block_size, self.device, group, dispatcher,
                                  self._balancer(group), par.microbatches)

    def _balancer(self, group):
        """EPLB over the MoE layers' experts on `group` (the EP group; the SP group under
        SP-TP-SP), where redundant experts or rebalancing are asked for; else None."""
        par = self.config.parallel
        if not (par.num_redundant_experts or par.eplb_interval):
            return None
        from matrixinfer.model.moe import MoE
        from matrixinfer.parallel.eplb import ExpertBalancer

        moes = [layer.mlp for layer in self.model.model.layers if isinstance(layer.mlp, MoE)]
        return ExpertBalancer(moes, group, par.num_redundant_experts, par.eplb_interval, par.eplb_window,
                              self.device, routed_ranks=self.routed_ranks())

    def _dispatcher(self, group):
        """The MoE's dispatch/combine over `group` (the EP group; the SP group under SP-TP-SP),
        set as the model's dispatcher."""
        from matrixinfer.parallel import expert_partition
        from matrixinfer.parallel.ep_comm import EPDispatcher, set_dispatcher

        cfg, routed = self.model.config, self.routed_ranks()
        owner = [r for r, ids in enumerate(expert_partition(cfg.n_routed_experts, routed)) for _ in ids]
        dtype = self.model.lm_head.weight.dtype
        dispatch = self.config.parallel.dispatch_dtype
        dispatch = str(dtype).removeprefix("torch.") if dispatch == "auto" else dispatch
        dispatcher = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size,
                                  self.config.scheduler.max_num_batched_tokens, dispatch, dtype, self.device,
                                  shared_ranks=list(range(routed, group.size)))
        set_dispatcher(dispatcher)
        return dispatcher

    def info(self) -> "ExecutorInfo":
        """What the executor tells the engine core about this rank once it is up."""
        m = self.model
        return ExecutorInfo(self.num_blocks, self.max_model_len, str(m.lm_head.weight.dtype).removeprefix("torch."),
                            m.config.vocab_size, ModelRunner.cache_bytes_per_block(m, self.config.cache.block_size),
                            self.load_report and vars(self.load_report))

    def _load(self):
        if self.config.load_format != "ems":
            return load_model(self.config.model, dtype=self.config.dtype, device=self.device,
                              expert_ids=self.expert_ids(), keep_fp8=self._keep_fp8())
        from matrixinfer.ems.client import EMSClient
        from matrixinfer.ems.model_cache import MODEL_NAMESPACE, ModelCache, ThrottledSource

        if not self.config.kv_transfer.ems_controller:
            raise ValueError("load_format ems needs an EMS controller (--ems-controller / kv_transfer_config)")
        source = ThrottledSource(self.config.model, self.config.model_source_mbps * 1e6)
        with EMSClient(self.config.kv_transfer.ems_controller, namespace=MODEL_NAMESPACE) as client:
            cache = ModelCache(client, source, model_name=str(self.config.model))
            try:
                tensors, self.load_report = cache.load()
                return load_model(self.config.model, dtype=self.config.dtype, device=self.device, weights=tensors,
                                  expert_ids=self.expert_ids(), keep_fp8=self._keep_fp8())
            finally:
                cache.close()

    def _keep_fp8(self) -> bool | None:
        """quantization="fp8" keeps an FP8 checkpoint's weights in FP8 whatever the dtype (None:
        the loader's default, kept with dtype auto; loader.load_model). Batch-invariant mode
        dequantizes them: the FP8 operator picks its path by row count (fused dot at one row,
        tiles up to 16, a GEMM past that), so a row's sums would depend on its neighbours."""
        if self.config.quantization.method == "fp8":
            return True
        return False if self.config.batch_invariant else None

    def _init_distributed(self, init_method: str) -> None:
        import torch.distributed as dist

        from matrixinfer.parallel import init_model_parallel

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.config.parallel.distributed_timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        # control messages (failed KV loads) go over a CPU group whatever the device backend
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        par = self.config.parallel
        init_model_parallel(par.tensor_parallel_size, par.expert_parallel_size,
                            par.world_size if par.sequence_parallel else 1)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        skip: set[str] = set()
        meta = sched.kv_connector_metadata
        if self.connector is not None and meta is not None:
            self.connector.start_load_kv(meta)
            skip = self._agree(self.connector.get_failed_loads())
        out = self.runner.execute_model(sched, skip, driver=self.rank == 0)
        if self.connector is not None and meta is not None:
            own = getattr(self.runner, "own_blocks", None)  # attention data parallel: what this rank wrote
            if own is not None:
                self.connector.keep_saves(own)
            self.connector.wait_for_save()
        return out

    def _agree(self, failed: set[str]) -> set[str]:
        """Every rank must skip the same requests: union of the ranks' failed loads."""
        if self.world_size == 1:
            return failed
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(failed), group=self.cpu_group)
        return set().union(*map(set, gathered))

    def shutdown(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            from matrixinfer.parallel import destroy_model_parallel
            from matrixinfer.parallel.ep_comm import set_dispatcher

            set_dispatcher(None)
            destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()


def worker_env_threads(world_size: int) -> None:
    """Ranks on one CPU share its cores: give each an equal share of intra-op threads (an
    explicit EngineConfig.num_threads wins: the Worker sets it after this)."""
    if world_size > 1 and not os.environ.get("MATRIXINFER_KEEP_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
