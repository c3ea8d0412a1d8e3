"""Typed configs. ModelConfig reads a Hugging Face config.json of the DeepSeek V2/V3 family."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from matrixinfer.deployment import PREFILL_PARALLEL

DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "matrixinfer-tiny-moe")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    interleave: bool = True  # DeepSeek stores rope dims as interleaved pairs

    @classmethod
    def from_hf(cls, hf: dict, interleave: bool) -> "RopeConfig":
        # transformers 5.x writes `rope_parameters` (with rope_theta inside); DeepSeek's own
        # configs and transformers 4.x write `rope_scaling` plus a top-level `rope_theta`.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = params.get("rope_type", params.get("type", "default")) or "default"
        if rtype not in ("default", "yarn"):
            raise ValueError(f"unsupported rope type {rtype!r} (supported: default, yarn)")
        cfg = cls(theta=float(theta), type=rtype, interleave=interleave)
        if rtype == "yarn":
            cfg.factor = float(params["factor"])
            cfg.original_max_position_embeddings = int(
                params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
            )
            cfg.beta_fast = float(params.get("beta_fast") or 32)
            cfg.beta_slow = float(params.get("beta_slow") or 1)
            cfg.mscale = float(params.get("mscale") or 0)
            cfg.mscale_all_dim = float(params.get("mscale_all_dim") or 0)
            cfg.truncate = bool(params.get("truncate", True))
        return cfg


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelConfig:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "bfloat16"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer the latent cache holds c_kv (kv_lora_rank) and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in ("deepseek_v3", "deepseek_v2"):
            raise ValueError(f"unsupported model_type {model_type!r} (expected deepseek_v3 or deepseek_v2)")
        v3 = model_type == "deepseek_v3"
        eos = hf.get("eos_token_id", 1)
        n_experts = hf.get("n_routed_experts") or 0
        cfg = cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf.get("moe_intermediate_size", hf["intermediate_size"]),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_shared_experts=hf.get("n_shared_experts") or 0,
            n_routed_experts=n_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            # transformers' V3 always routes noaux_tc/sigmoid and V2 always softmax;
            # DeepSeek's own configs name the method explicitly.
            topk_method=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            rope=RopeConfig.from_hf(hf, interleave=bool(hf.get("rope_interleave", True))),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        )
        if cfg.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {cfg.topk_method!r}")
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported scoring_func {cfg.scoring_func!r}")
        if n_experts and n_experts % cfg.n_group:
            raise ValueError(f"n_routed_experts={n_experts} is not divisible by n_group={cfg.n_group}")
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory")
        return cls.from_hf(json.loads(path.read_text()))


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_gb and max_num_seqs * max_model_len
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 1.0


AUTO_SCHEDULER_STEPS = 8  # measured: docs/architecture.md, "Multi-step decode"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None
    # decode steps per schedule when every running request decodes greedily and none waits
    # (vLLM's multi-step scheduling): the worker feeds each step's tokens to the next on its own.
    # None: AUTO_SCHEDULER_STEPS where the runner can (the compiled decode step), else 1
    num_scheduler_steps: int | None = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    executor: str = "auto"  # "uni" (in-process) | "mp" (one OS process per rank) | auto: mp when world > 1
    distributed_timeout_s: float = 120.0
    # expert parallelism: how dispatch sends tokens (auto: the model dtype, lossless; int8: the
    # paper's per-token quantization, about half the bytes)
    dispatch_dtype: str = "auto"
    # EPLB (expert parallelism): R redundant expert slots placed from measured load, rebalanced
    # every eplb_interval steps (0: never) over a window of the last eplb_window steps
    num_redundant_experts: int = 0
    # shared experts: on every EP rank (replicated), or on the last `shared_expert_ranks` EP ranks
    # only, which then hold no routed expert (dedicated, as the paper's 32 of 320 dies)
    shared_expert_placement: str = "replicated"
    shared_expert_ranks: int = 1
    microbatches: int = 1  # 2: split each rank's batch in two and overlap one's exchanges with the other's compute
    eplb_interval: int = 0
    eplb_window: int = 100
    # How attention is parallel across the instance's prefill_parallel_size ranks (the paper's
    # prefill, docs/prefill_parallel.md): "sp-tp-sp" (tokens cut over the ranks for MLA stages
    # 1 and 3 and the MoE, heads split for stage 2, experts partitioned), "tp" (the same as
    # tensor_parallel_size = P) or "dp" (expert_parallel_size = P: attention data parallel).
    # None: the sizes above alone. The instance decodes in the same layout.
    prefill_parallel: str | None = None
    prefill_parallel_size: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return self.prefill_parallel == "sp-tp-sp" and self.prefill_parallel_size > 1

    @property
    def world_size(self) -> int:
        if self.sequence_parallel:
            return self.prefill_parallel_size
        return self.tensor_parallel_size * self.expert_parallel_size

    def apply_prefill_parallel(self) -> None:
        """prefill_parallel "tp" / "dp" of size P are the existing layouts: set their size."""
        mode, p = self.prefill_parallel, self.prefill_parallel_size
        if mode is None:
            if p != 1:
                raise ValueError("prefill_parallel_size needs prefill_parallel (sp-tp-sp, tp or dp)")
            return
        if mode not in PREFILL_PARALLEL or p < 1:
            raise ValueError(f"prefill_parallel {mode!r} (one of {', '.join(PREFILL_PARALLEL)}), size {p} >= 1")
        if (mode == "sp-tp-sp" or p > 1) and (self.tensor_parallel_size, self.expert_parallel_size) != (1, 1):
            raise ValueError("prefill_parallel with a size sets the instance's layout: leave tensor_parallel_size "
                             "and expert_parallel_size at 1")
        if mode == "tp":
            self.tensor_parallel_size = p
        elif mode == "dp":
            self.expert_parallel_size = p

    def executor_kind(self) -> str:
        if self.executor == "auto":
            return "mp" if self.world_size > 1 else "uni"
        return self.executor


@dataclass
class KVTransferConfig:
    connector: str | None = None  # None | "ems"
    ems_controller: str | None = None  # HOST:PORT of the EMS controller
    ems_namespace: str = "kv"  # EMS namespace the pages live in (tenants are salted into the keys)
    ems_timeout_s: float = 2.0


@dataclass
class SpeculativeConfig:
    method: str | None = None  # "mtp": draft with the model's multi-token-prediction module(s)
    num_speculative_tokens: int = 0  # k drafts per step (k > MTP modules: the last one is reused)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per request and step: 0 when speculation is off."""
        return self.num_speculative_tokens if self.method else 0


@dataclass
class QuantizationConfig:
    # None: whatever the checkpoint says (a compressed-tensors int8 checkpoint runs W8A8; an FP8
    # one, DeepSeek's release, keeps FP8 weights with dtype auto, else is dequantized to dtype at load);
    # "w8a8" / "compressed-tensors": require a W8A8 checkpoint (written by `matrixinfer quantize`);
    # "fp8": require an FP8 checkpoint and keep its weights in FP8 whatever the dtype
    method: str | None = None


@dataclass
class EngineConfig:
    """Everything an engine instance needs, built once (from_kwargs for LLM(...), from_cli for
    `serve` / `generate` / the benches) and handed to the engine core, executor and workers."""
    model: str = ""
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # intra-op threads per rank (None: torch's default, or cores / ranks)
    # niceness the engine core process (and its rank processes) runs at: the front end and the
    # clients streaming its tokens wake for short bursts and preempt it instead of waiting out a
    # multi-step run on cores it keeps busy (measured: docs/architecture.md, "Engine core priority")
    engine_core_nice: int = 10
    load_format: str = "disk"  # "disk" | "ems": weights through the EMS model cache (one copy in the pool)
    model_source_mbps: float = 0.0  # with "ems": read the model directory at this cap (a stand-in for object storage)
    # False: decode-only steps and steps of whole new prompts run torch.compile'd forwards
    # (inductor; compiled at start-up, cached on disk by inductor). MATRIXINFER_ENFORCE_EAGER=1 flips the default (the test suite does).
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("MATRIXINFER_ENFORCE_EAGER", "0") == "1")
    # Steps of whole new prompts run a compiled forward too (worker/compiled_prefill.py);
    # False keeps them eager (an A/B switch, and a shorter start-up).
    compile_prefill: bool = True
    # False: decode steps stay eager while prefill may compile (PDC prefill instances, which never decode)
    compile_decode: bool = True
    # A request's tokens and logprobs bitwise the same whatever it is batched with, however its
    # prompt is chunked or cached (model/batch_invariant.py, docs/determinism.md).
    # MATRIXINFER_BATCH_INVARIANT=1 flips the default.
    batch_invariant: bool = field(default_factory=lambda: os.environ.get("MATRIXINFER_BATCH_INVARIANT", "0") == "1")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)

    # flat keyword name -> (section, field); the names users know from vLLM
    _FLAT = {
        "block_size": ("cache", "block_size"), "num_blocks": ("cache", "num_blocks"),
        "enable_prefix_caching": ("cache", "enable_prefix_caching"),
        "kv_cache_memory_gb": ("cache", "kv_cache_memory_gb"),
        "max_num_seqs": ("scheduler", "max_num_seqs"),
        "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
        "max_model_len": ("scheduler", "max_model_len"),
        "num_scheduler_steps": ("scheduler", "num_scheduler_steps"),
        "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
        "expert_parallel_size": ("parallel", "expert_parallel_size"),
        "data_parallel_size": ("parallel", "data_parallel_size"),
        "distributed_executor_backend": ("parallel", "executor"),
        "dispatch_dtype": ("parallel", "dispatch_dtype"),
        "num_redundant_experts": ("parallel", "num_redundant_experts"),
        "eplb_interval": ("parallel", "eplb_interval"),
        "eplb_window": ("parallel", "eplb_window"),
        "microbatches": ("parallel", "microbatches"),
        "shared_expert_placement": ("parallel", "shared_expert_placement"),
        "shared_expert_ranks": ("parallel", "shared_expert_ranks"),
        "prefill_parallel": ("parallel", "prefill_parallel"),
        "prefill_parallel_size": ("parallel", "prefill_parallel_size"),
        "quantization": ("quantization", "method"),
    }

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        cfg = cls(model=str(model))
        sections = {"kv_transfer_config": "kv_transfer", "speculative_config": "speculative"}
        for key, value in kwargs.items():
            if key in ("dtype", "device", "seed", "load_format", "model_source_mbps", "num_threads", "enforce_eager",
                       "compile_prefill", "compile_decode", "engine_core_nice", "batch_invariant"):
                setattr(cfg, key, value)
            elif key in cls._FLAT:
                section, name = cls._FLAT[key]
                setattr(getattr(cfg, section), name, value)
            elif key in sections:
                section = getattr(cfg, sections[key])
                for k, v in (value or {}).items():
                    if not hasattr(section, k):
                        raise ValueError(f"unknown {key} field {k!r}")
                    setattr(section, k, v)
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        cfg.parallel.apply_prefill_parallel()
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.parallel.world_size < 1 or self.parallel.tensor_parallel_size < 1:
            raise ValueError("parallel sizes must be >= 1")
        par = self.parallel
        if par.expert_parallel_size < 1:
            raise ValueError("parallel sizes must be >= 1")
        if par.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 is not built (attention runs data parallel inside an "
                             "expert-parallel group: use expert_parallel_size)")
        self._validate_expert_parallel(par)
        if self.parallel.executor not in ("auto", "uni", "mp"):
            raise ValueError(f"unknown executor {self.parallel.executor!r} (auto, uni, mp)")
        if self.parallel.executor == "uni" and self.parallel.world_size > 1:
            raise ValueError("the in-process executor runs one rank; use executor 'mp' for parallel sizes > 1")
        if self.kv_transfer.connector not in (None, "ems"):
            raise ValueError(f"unknown kv connector {self.kv_transfer.connector!r} (supported: ems)")
        if self.kv_transfer.connector == "ems" and not self.kv_transfer.ems_controller:
            raise ValueError("the ems kv connector needs ems_controller HOST:PORT")
        if not 0 <= self.engine_core_nice <= 19:
            raise ValueError(f"engine_core_nice={self.engine_core_nice}: 0..19 (raising a priority needs privileges)")
        if self.load_format not in ("disk", "ems"):
            raise ValueError(f"unknown load_format {self.load_format!r} (disk, ems)")
        if self.speculative.method not in (None, "mtp"):
            raise ValueError(f"unknown speculative method {self.speculative.method!r} (supported: mtp)")
        if self.speculative.method == "mtp" and self.speculative.num_speculative_tokens < 1:
            raise ValueError("speculative method mtp needs num_speculative_tokens >= 1")
        steps = self.scheduler.num_scheduler_steps
        if steps is not None and steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {steps}")
        if steps is not None and steps > 1 and not self.compiles_decode:
            raise ValueError("num_scheduler_steps > 1 needs the compiled decode step: not with enforce_eager, "
                             "speculative decoding, expert parallelism or prefill_parallel sp-tp-sp")
        if self.batch_invariant and (par.expert_parallel_size > 1 or par.sequence_parallel):
            raise ValueError("batch_invariant with expert parallelism or prefill_parallel sp-tp-sp is not built yet "
                             "(their runners build their own steps; docs/determinism.md)")
        if self.batch_invariant and self.quantization.method == "fp8":
            raise ValueError("batch_invariant with quantization fp8 is not built (the FP8 operator's sums depend on "
                             "the row count); leave quantization unset and the FP8 checkpoint is dequantized at load")
        if self.quantization.method not in (None, "w8a8", "compressed-tensors", "fp8"):
            raise ValueError(f"unknown quantization {self.quantization.method!r} (w8a8, compressed-tensors, fp8); a "
                             "quantized checkpoint is detected from its config.json")

    @property
    def _compilable_runner(self) -> bool:
        """The runner this config builds (worker._make_runner) can run compiled steps: not
        eager, not speculating (its steps verify k + 1 tokens a sequence), and neither expert
        parallelism nor SP-TP-SP (their collectives and row counts are not compiled)."""
        par = self.parallel
        return not (self.enforce_eager or self.speculative.num_draft_tokens or par.expert_parallel_size > 1
                    or par.sequence_parallel)

    @property
    def compiles_decode(self) -> bool:
        """Decode-only steps run on the compiled graph, which also runs several decode steps per
        schedule."""
        return self._compilable_runner and self.compile_decode

    @property
    def compiles_prefill(self) -> bool:
        """Steps of whole new prompts run on the compiled prefill graphs (not in batch-invariant
        mode: there prompts run the decode graph, a row per token)."""
        return self._compilable_runner and self.compile_prefill and not self.batch_invariant

    @property
    def decode_steps(self) -> int:
        """Decode steps per schedule (SchedulerConfig.num_scheduler_steps resolved)."""
        steps = self.scheduler.num_scheduler_steps
        if steps is None:
            return AUTO_SCHEDULER_STEPS if self.compiles_decode else 1
        return steps

    def _validate_expert_parallel(self, par: ParallelConfig) -> None:
        if par.dispatch_dtype not in ("auto", "int8", "bfloat16", "float32"):
            raise ValueError(f"unknown dispatch_dtype {par.dispatch_dtype!r} (auto, int8, bfloat16, float32)")
        if min(par.num_redundant_experts, par.eplb_interval) < 0 or par.eplb_window < 1:
            raise ValueError("num_redundant_experts and eplb_interval must be >= 0, eplb_window >= 1")
        if par.microbatches not in (1, 2):
            raise ValueError(f"microbatches {par.microbatches}: 1 or 2")
        if par.shared_expert_placement not in ("replicated", "dedicated"):
            raise ValueError(f"shared_expert_placement {par.shared_expert_placement!r}: replicated or dedicated")
        if par.sequence_parallel:
            if par.shared_expert_placement != "replicated":
                raise ValueError("dedicated shared experts under prefill_parallel sp-tp-sp are not built")
            if self.speculative.method is not None:
                raise ValueError("speculative decoding with prefill_parallel sp-tp-sp is not built yet")
            return
        if par.expert_parallel_size == 1:
            if par.num_redundant_experts or par.eplb_interval or par.microbatches != 1:
                raise ValueError("redundant experts / EPLB / microbatches need expert_parallel_size > 1")
            return
        if par.shared_expert_placement == "dedicated":
            if not 1 <= par.shared_expert_ranks < par.expert_parallel_size:
                raise ValueError("dedicated shared experts need 1 <= shared_expert_ranks < expert_parallel_size")
        if self.speculative.method is not None:
            raise ValueError("speculative decoding with expert_parallel_size > 1 is not built yet")

    @staticmethod
    def add_cli_args(p) -> None:
        """The engine flags shared by `serve`, `generate` and the benches."""
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
        p.add_argument("--device", default="cpu")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--num-blocks", type=int, default=None)
        p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
        p.add_argument("--no-prefix-caching", action="store_true")
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
        p.add_argument("--num-scheduler-steps", type=int, default=None,
                       help="decode steps per schedule while every request decodes greedily and none waits "
                            f"(default: {AUTO_SCHEDULER_STEPS} with the compiled decode step, else 1)")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--expert-parallel-size", "-ep", type=int, default=1,
                       help="EP ranks (x tp processes): attention data parallel, routed experts partitioned")
        p.add_argument("--dispatch-dtype", default="auto", choices=["auto", "int8", "bfloat16", "float32"],
                       help="how MoE dispatch sends tokens between EP ranks (auto: the model dtype)")
        p.add_argument("--num-redundant-experts", type=int, default=0,
                       help="EPLB: extra expert replicas placed from measured load (needs -ep > 1)")
        p.add_argument("--eplb-interval", type=int, default=0, help="EPLB: rebalance every N steps (0: never)")
        p.add_argument("--eplb-window", type=int, default=100, help="EPLB: steps of token counts a rebalance uses")
        p.add_argument("--shared-expert-placement", default="replicated", choices=["replicated", "dedicated"],
                       help="dedicated: shared experts only on the last --shared-expert-ranks EP ranks")
        p.add_argument("--shared-expert-ranks", type=int, default=1)
        p.add_argument("--microbatches", type=int, default=1, choices=[1, 2],
                       help="2: overlap one microbatch's dispatch/combine with the other's compute (needs -ep > 1)")
        p.add_argument("--prefill-parallel", default=None, choices=list(PREFILL_PARALLEL),
                       help="attention across --prefill-parallel-size ranks: sp-tp-sp (tokens cut over the ranks, "
                            "heads split for attention, experts partitioned), tp, or dp (attention data parallel)")
        p.add_argument("--prefill-parallel-size", type=int, default=1)
        p.add_argument("--distributed-executor-backend", default="auto", choices=["auto", "uni", "mp"])
        p.add_argument("--kv-connector", default=None, choices=["ems"])
        p.add_argument("--ems-controller", default=None, help="HOST:PORT of the EMS controller")
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--speculative-method", default=None, choices=["mtp"],
                       help="speculative decoding: draft with the model's MTP module, verify in one step")
        p.add_argument("--num-speculative-tokens", type=int, default=1, help="draft tokens per step (with mtp)")
        p.add_argument("--load-format", default="disk", choices=["disk", "ems"],
                       help="ems: instances load weights through the EMS model cache (one copy in the pool)")
        p.add_argument("--model-source-mbps", type=float, default=0.0,
                       help="with --load-format ems: read the model directory at this many MB/s (object storage)")
        p.add_argument("--enforce-eager", action="store_true", default=None,
                       help="run decode and prefill steps eagerly instead of the torch.compile'd forward (no "
                            "compile at start-up)")
        p.add_argument("--no-compile-prefill", action="store_true", default=None,
                       help="compile decode steps only: prefill steps run eagerly (a shorter start-up)")
        p.add_argument("--batch-invariant", action="store_true", default=None,
                       help="a request's tokens and logprobs bitwise the same in any batch, chunking or cache hit "
                            "(docs/determinism.md; MATRIXINFER_BATCH_INVARIANT=1)")
        p.add_argument("--num-threads", type=int, default=None,
                       help="intra-op threads per rank (default: the machine's cores over the ranks)")
        p.add_argument("--engine-core-nice", type=int, default=None,
                       help="niceness of the engine core processes, so the HTTP front end streaming their tokens "
                            "preempts them (default: 10; 0 for equal priority)")
        p.add_argument("--deployment", default=None,
                       help="a deployment YAML (see matrixinfer/deployment.py): model, dtype and parallel sizes "
                            "from the file that `matrixinfer simulate deployment` reads")

    @classmethod
    def for_roles(cls, dep, **flags) -> dict[str, "EngineConfig"]:
        """The engine configuration each role of a deployment file (matrixinfer/deployment.py)
        runs: {"decode": ...} for a colocated deployment (its one kind of instance), {"prefill":
        ..., "decode": ...} for PDC, each from its own section (the paper's prefill is SP-TP-SP
        with EP32, its decode EP320). `flags`, the command line's engine flags, fill in what the
        file does not say; the file wins where both do. Instance counts are the launcher's.
        A role the engine refuses is a ValueError naming the role."""
        if dep.colocated and dep.decode.instances != 1:
            raise ValueError(f"decode.instances: {dep.decode.instances}: one colocated instance per `serve` process")
        roles = {"decode": dep.decode} if dep.colocated else {"prefill": dep.prefill, "decode": dep.decode}
        configs = {}
        for name, role in roles.items():
            try:
                configs[name] = cls.from_kwargs(dep.model, **{**flags, **_role_engine_args(dep, name, role)})
            except (TypeError, ValueError) as e:
                raise ValueError(f"deployment role {name}: {e}") from None
        return configs

    def layout(self) -> str:
        """What an instance of this configuration runs, in one line (`serve` prints it per role)."""
        par, parts = self.parallel, []
        if par.sequence_parallel:
            parts.append(f"SP-TP-SP prefill over {par.prefill_parallel_size} ranks (MoE EP{par.prefill_parallel_size})")
        elif par.world_size == 1:
            parts.append("one process")
        else:
            parts.append(" x ".join(f"{k}{n}" for k, n in (("TP", par.tensor_parallel_size),
                                                             ("EP", par.expert_parallel_size)) if n > 1))
        if par.expert_parallel_size > 1 or par.sequence_parallel:
            ep = [f"dispatch {par.dispatch_dtype}"]
            if par.num_redundant_experts:
                ep.append(f"{par.num_redundant_experts} redundant expert(s)")
            if par.eplb_interval:
                ep.append(f"EPLB every {par.eplb_interval} steps")
            if par.microbatches > 1:
                ep.append(f"{par.microbatches} microbatches")
            if par.shared_expert_placement == "dedicated":
                ep.append(f"shared experts on {par.shared_expert_ranks} dedicated rank(s)")
            parts.append(", ".join(ep))
        if self.speculative.num_draft_tokens:
            parts.append(f"MTP {self.speculative.num_draft_tokens} draft token(s)")
        parts.append({None: f"dtype {self.dtype}"}.get(self.quantization.method, f"{self.quantization.method} weights"))
        decode = f"compiled, {self.decode_steps} steps a schedule" if self.compiles_decode else "eager"
        parts.append(f"decode step {decode}, prefill step {'compiled' if self.compiles_prefill else 'eager'}")
        parts.append(f"prefix cache {'on' if self.cache.enable_prefix_caching else 'off'}")
        if self.batch_invariant:
            parts.append("batch-invariant")
        if self.kv_transfer.connector:
            parts.append(f"KV connector {self.kv_transfer.connector}")
        return "; ".join(parts)

    @classmethod
    def from_cli(cls, args) -> "EngineConfig":
        """The engine the flags describe; with --deployment, its decode role (what a colocated
        instance runs: `serve` takes every role through for_roles)."""
        kw = cls.cli_kwargs(args)
        if args.deployment:
            from matrixinfer.deployment import load_deployment

            return cls.for_roles(load_deployment(args.deployment), **kw)["decode"]
        return cls.from_kwargs(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                               expert_parallel_size=args.expert_parallel_size, **kw)

    @staticmethod
    def cli_kwargs(args) -> dict:
        """The engine flags as from_kwargs arguments (all but the model, dtype and layout sizes,
        which a deployment file may give instead)."""
        kv = {"connector": args.kv_connector, "ems_controller": args.ems_controller}
        kw = dict(device=args.device, seed=args.seed or 0,
                  block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  max_num_seqs=args.max_num_seqs, dispatch_dtype=args.dispatch_dtype,
                  num_redundant_experts=args.num_redundant_experts, eplb_interval=args.eplb_interval,
                  eplb_window=args.eplb_window, microbatches=args.microbatches,
                  shared_expert_placement=args.shared_expert_placement, shared_expert_ranks=args.shared_expert_ranks,
                  prefill_parallel=getattr(args, "prefill_parallel", None),
                  prefill_parallel_size=getattr(args, "prefill_parallel_size", 1),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  num_scheduler_steps=getattr(args, "num_scheduler_steps", None),
                  distributed_executor_backend=args.distributed_executor_backend, kv_transfer_config=kv,
                  load_format=args.load_format, model_source_mbps=args.model_source_mbps)
        if args.no_prefix_caching:  # on by default
            kw["enable_prefix_caching"] = False
        if getattr(args, "enforce_eager", None):
            kw["enforce_eager"] = True
        if getattr(args, "no_compile_prefill", None):
            kw["compile_prefill"] = False
        if getattr(args, "batch_invariant", None):
            kw["batch_invariant"] = True
        if getattr(args, "num_threads", None):
            kw["num_threads"] = args.num_threads
        if getattr(args, "engine_core_nice", None) is not None:
            kw["engine_core_nice"] = args.engine_core_nice
        if getattr(args, "speculative_method", None):
            kw["speculative_config"] = {"method": args.speculative_method,
                                        "num_speculative_tokens": args.num_speculative_tokens}
        return kw


def _role_engine_args(dep, name: str, role) -> dict:
    """A deployment role's section as engine arguments (EngineConfig.from_kwargs names)."""
    kw = {"quantization": "w8a8"} if dep.dtype == "int8" else {"dtype": dep.dtype}
    if dep.batch_invariant:
        kw["batch_invariant"] = True
    tp, ep = role.tensor_parallel_size, role.expert_parallel_size
    if name == "prefill" and role.prefill_parallel == "sp-tp-sp":
        if min(tp, ep) > 1 and tp != ep:
            raise ValueError(f"prefill: sp-tp-sp splits the heads and the experts over the same ranks: "
                             f"tensor_parallel_size {tp} and expert_parallel_size {ep} must be one size")
        return {**kw, "prefill_parallel": "sp-tp-sp", "prefill_parallel_size": max(tp, ep)}
    kw.update(tensor_parallel_size=tp, expert_parallel_size=ep)
    if name == "decode":
        if role.dispatch_dtype == "fp8":
            raise ValueError("decode.dispatch_dtype fp8: the engine dispatches int8 or bf16 (the CPU path has no "
                             "FP8 arithmetic, and neither has the 910C the paper serves on)")
        if ep > 1:
            kw["dispatch_dtype"] = {"bf16": "bfloat16"}.get(role.dispatch_dtype, role.dispatch_dtype)
        kw.update(num_redundant_experts=role.num_redundant_experts, eplb_interval=role.eplb_interval,
                  microbatches=role.microbatches, shared_expert_placement=role.shared_expert_placement)
        if role.speculative_num_tokens:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": role.speculative_num_tokens}
    return kw
