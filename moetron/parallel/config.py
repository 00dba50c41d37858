"""Parallel layout configuration, validated before any process group exists.

A layout is two rank grids over the same ranks ("parallel folding"): attention uses
TP x CP x DP x PP and experts use ETP x EP x EDP x PP. DP and EDP are whatever is left of the
world size, so they are derived in `resolve(world_size)` rather than configured.
"""

from __future__ import annotations

from dataclasses import dataclass

DIMS = ("tp", "cp", "ep", "dp", "pp")


def parse_order(order: str) -> tuple[str, ...]:
    """Split an order string like "tp-cp-ep-dp-pp"; the first name varies fastest."""
    names = tuple(order.split("-"))
    if sorted(names) != sorted(DIMS):
        raise ValueError(
            f"order={order!r} must name each of {'-'.join(DIMS)} exactly once, separated by '-'"
        )
    return names


@dataclass
class ParallelConfig:
    """Sizes of each parallel dimension.

    etp=None means "same as tp" (Megatron-Core's default). sp=True with tp=1 is accepted and
    does nothing: sequence parallel shards activations over the TP group, so a recipe that enables
    it must still run on one process (tiny proxies, tests) without toggling a second field.

    distributed_optimizer=True (default) shards AdamW's state over the data-parallel ranks
    (ZeRO-1: gradients reduce-scattered, parameters all-gathered after the step); False keeps
    a full replica of the optimizer on every rank over all-reduced gradients, which costs
    memory but no parameter all-gather. Both give the same numbers; with one data-parallel
    replica (or one process) the choice changes nothing.

    zero_stage (None: 1 with the distributed optimizer, replicated AdamW without): 1 = the
    distributed optimizer above; 2 = also the gradients, reduce-scattered after every micro-batch
    into this rank's shard; 3 = also the parameters (PyTorch FSDP2 `fully_shard`; data parallel
    only). Any zero_stage implies distributed_optimizer=true; false with a zero_stage is an error.
    Checkpoints resume across stages. docs/zero.md.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    order: str = "tp-cp-ep-dp-pp"
    layout: str | None = None  # pipeline layout string (REFERENCE §3); None: balanced automatically
    schedule: str = "1f1b"  # pipeline schedule: 1f1b, interleaved, zb1p, dualpipe, dualpipev
    dispatcher: str = "alltoall"  # MoE token dispatcher under EP: alltoall, allgather, flex
    fb_overlap: str = "off"  # forward of one micro-batch with the backward of another (DualPipe(V) F&B pairs; 1F1B /
    # interleaved pair each backward with the next forward): off, layer, or moe (attention/dispatch/experts/combine)
    flex_backend: str = "torch"  # backend of the flex dispatcher: torch, deepep, nvshmem
    distributed_optimizer: bool = True  # ZeRO-1 over data parallel; False: replicated AdamW
    zero_stage: int | None = None  # 1, 2 (+ sharded gradients), 3 (+ sharded parameters, FSDP2)
    # Communication overlap (Megatron-Core names; docs/megatron_switches.md).
    overlap_grad_reduce: bool = True  # DP buckets reduce during backward (every pipeline schedule)
    overlap_param_gather: bool = False  # ZeRO-1 all-gathers wait in forward pre-hooks, bucket by bucket
    overlap_param_gather_with_optimizer_step: bool = False  # each bucket's gather starts right after its update
    bucket_size: int | None = None  # elements per DP bucket; None: max(40M, 1M * dp)
    tp_comm_overlap: bool = False  # chunked all-gather->GEMM / GEMM->reduce-scatter (needs sp)
    tp_comm_overlap_chunks: int = 2  # pieces each overlapped TP collective is cut into
    # Context-parallel attention exchange (Megatron's --cp-comm-type; docs/parallel.md): allgather (K/V or MLA
    # latent), p2p (ring), a2a (Ulysses), a2a+p2p (a2a inside groups of hierarchical_cp[0] consecutive CP ranks,
    # a ring of hierarchical_cp[1] over them; Megatron's --hierarchical-context-parallel-sizes)
    cp_comm_type: str = "allgather"
    hierarchical_cp: list[int] | None = None

    def __post_init__(self) -> None:
        if self.etp is None:
            self.etp = self.tp
        for name in ("tp", "cp", "ep", "etp", "pp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(f"distributed_optimizer={self.distributed_optimizer!r} must be true or false "
                             "(true: ZeRO-1 sharded AdamW, false: AdamW replicated on every rank)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"vpp={self.vpp} needs pipeline parallelism: virtual stages interleave across "
                "pp ranks, so set pp > 1 or vpp=1"
            )
        parse_order(self.order)
        schedules = ("1f1b", "interleaved", "zb1p", "dualpipe", "dualpipev")
        if self.schedule not in schedules:
            raise ValueError(f"schedule={self.schedule!r} is unknown; choose one of {schedules}")
        if self.fb_overlap not in ("off", "layer", "moe"):
            raise ValueError(f"fb_overlap={self.fb_overlap!r} is unknown; choose off, layer or moe")
        if self.dispatcher not in ("alltoall", "allgather", "flex"):
            raise ValueError(f"dispatcher={self.dispatcher!r} is unknown; choose alltoall, allgather or flex")
        self._check_switches()
        self._check_cp_comm()

    def _check_cp_comm(self) -> None:
        kinds = ("allgather", "p2p", "a2a", "a2a+p2p")
        if self.cp_comm_type not in kinds:
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type!r} is unknown; choose one of {', '.join(kinds)}")
        if self.cp_comm_type != "allgather" and self.cp == 1:
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type} with parallel.cp=1: there is no context-"
                             "parallel exchange; set parallel.cp > 1, or parallel.cp_comm_type=allgather")
        h = self.hierarchical_cp
        if h is None:
            if self.cp_comm_type == "a2a+p2p":
                raise ValueError("parallel.cp_comm_type=a2a+p2p needs parallel.hierarchical_cp=[a2a, p2p] (the all-to-all "
                                 f"and ring sizes, product cp={self.cp}), e.g. [2,{max(self.cp // 2, 1)}]")
            return
        if self.cp_comm_type != "a2a+p2p":
            raise ValueError(f"parallel.hierarchical_cp={h!r} is only used by parallel.cp_comm_type=a2a+p2p (got "
                             f"{self.cp_comm_type}): set parallel.cp_comm_type=a2a+p2p, or drop parallel.hierarchical_cp")
        if (not isinstance(h, (list, tuple)) or len(h) != 2
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in h)):
            raise ValueError(f"parallel.hierarchical_cp={h!r} must be two sizes [a2a, p2p] (inner all-to-all, outer "
                             "ring), each an integer >= 1")
        if h[0] * h[1] != self.cp:
            raise ValueError(f"parallel.hierarchical_cp={list(h)}: {h[0]} x {h[1]} = {h[0] * h[1]} is not "
                             f"parallel.cp={self.cp}")
        self.hierarchical_cp = [int(x) for x in h]

    def _check_switches(self) -> None:
        """Options that would be silently ignored in this layout are errors naming the fix."""
        for name in ("overlap_grad_reduce", "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
                     "tp_comm_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"parallel.{name}={getattr(self, name)!r} must be true or false")
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or isinstance(
                self.bucket_size, bool) or self.bucket_size < 1):
            raise ValueError(f"parallel.bucket_size={self.bucket_size!r} must be a positive number of elements "
                             "(or null for the default max(40M, 1M x dp))")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise ValueError(f"parallel.vpp={self.vpp} with parallel.schedule={self.schedule!r}: only the interleaved "
                             "schedule runs virtual stages; set parallel.schedule=interleaved, or parallel.vpp=1")
        if self.fb_overlap != "off" and self.pp == 1:
            raise ValueError(f"parallel.fb_overlap={self.fb_overlap!r} with parallel.pp=1: the overlap pairs the "
                             "forward and backward of two micro-batches inside a pipeline schedule; set "
                             "parallel.pp >= 2, or parallel.fb_overlap=off")
        if self.flex_backend not in ("torch", "deepep", "nvshmem"):
            raise ValueError(f"parallel.flex_backend={self.flex_backend!r} is unknown; choose torch, deepep or nvshmem")
        if self.flex_backend != "torch" and self.dispatcher != "flex":
            raise ValueError(f"parallel.flex_backend={self.flex_backend} is the flex dispatcher's backend, but "
                             f"parallel.dispatcher={self.dispatcher!r}: set parallel.dispatcher=flex, or "
                             "parallel.flex_backend=torch")
        if self.tp_comm_overlap and not self.sp:
            raise ValueError("parallel.tp_comm_overlap=true needs sequence parallel (its all-gather->GEMM and "
                             "GEMM->reduce-scatter are the ones overlapped): set parallel.sp=true, or "
                             "parallel.tp_comm_overlap=false")
        if not isinstance(self.tp_comm_overlap_chunks, int) or self.tp_comm_overlap_chunks < 2:
            raise ValueError(f"parallel.tp_comm_overlap_chunks={self.tp_comm_overlap_chunks!r} must be an integer "
                             ">= 2 (the pieces each overlapped TP collective is cut into)")
        self._check_zero_stage()
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true: only the "
                             "distributed optimizer all-gathers parameters")
        if self.overlap_param_gather and self.pp > 1:
            raise ValueError("parallel.overlap_param_gather=true with parallel.pp > 1 is not supported: pipeline "
                             "stages read weights outside module forwards, so a gather could be read unfinished; "
                             "set parallel.overlap_param_gather=false (the gathers then finish inside the step)")
        if self.overlap_param_gather_with_optimizer_step and not self.overlap_param_gather:
            raise ValueError("parallel.overlap_param_gather_with_optimizer_step=true needs "
                             "parallel.overlap_param_gather=true (as in Megatron-Core)")

    def _check_zero_stage(self) -> None:
        """zero_stage needs the distributed optimizer; stage 3 (FSDP2) runs data parallel only."""
        z = self.zero_stage
        if z is None:
            return
        if z not in (1, 2, 3) or isinstance(z, bool):
            raise ValueError(f"parallel.zero_stage={z!r} is unknown; choose 1 (optimizer state), 2 (+ gradients) "
                             "or 3 (+ parameters), or null (1, or none with distributed_optimizer=false)")
        if not self.distributed_optimizer:
            raise ValueError(f"parallel.zero_stage={z} shards the optimizer state, but parallel.distributed_optimizer="
                             "false asks for AdamW replicated on every rank: set parallel.distributed_optimizer=true, "
                             "or drop parallel.zero_stage")
        if z == 3:
            bad = [f"{k}={getattr(self, k)}" for k in ("tp", "cp", "ep", "etp", "pp") if getattr(self, k) != 1]
            if bad:
                raise ValueError(f"parallel.zero_stage=3 (FSDP2 fully_shard over the data-parallel ranks) runs data "
                                 f"parallel only, not with {', '.join('parallel.' + b for b in bad)}: use "
                                 "parallel.zero_stage=2 (it composes with every layout), or set those to 1")
            bad = [k for k in ("overlap_param_gather", "overlap_param_gather_with_optimizer_step") if getattr(self, k)]
            if bad or self.bucket_size is not None:
                name = f"parallel.{bad[0]}" if bad else "parallel.bucket_size"
                raise ValueError(f"{name} with parallel.zero_stage=3: FSDP2 gathers and reduces per transformer "
                                 f"layer and prefetches by itself; drop {name}, or use parallel.zero_stage 1 or 2")
            if not self.overlap_grad_reduce:
                raise ValueError("parallel.overlap_grad_reduce=false with parallel.zero_stage=3: FSDP2 reduce-scatters "
                                 "each layer's gradients during backward; drop the override, or use zero_stage 1 or 2")

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect: 0 (replicated AdamW), 1, 2 or 3."""
        return self.zero_stage if self.zero_stage is not None else int(self.distributed_optimizer)

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallel is actually in effect (it needs a TP group to shard over)."""
        return self.sp and self.tp > 1

    def resolve(self, world_size: int) -> ParallelSizes:
        """Check the layout against a world size and derive dp and edp."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
        attn = self.tp * self.cp * self.pp
        if world_size % attn:
            raise ValueError(
                f"world_size={world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {attn} (attention grid TP x CP x DP x PP)"
            )
        expert = self.etp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(
                f"world_size={world_size} is not divisible by etp*ep*pp = "
                f"{self.etp}*{self.ep}*{self.pp} = {expert} (expert grid ETP x EP x EDP x PP)"
            )
        sizes = ParallelSizes(
            world_size=world_size, tp=self.tp, cp=self.cp, dp=world_size // attn, pp=self.pp,
            ep=self.ep, etp=self.etp, edp=world_size // expert, vpp=self.vpp,
            sp=self.sequence_parallel, order=parse_order(self.order),
            hierarchical_cp=tuple(self.hierarchical_cp or ()),
        )
        _check_pp_groups_agree(sizes)
        return sizes


@dataclass(frozen=True)
class ParallelSizes:
    """A ParallelConfig resolved against a world size: every dimension, dp and edp included."""

    world_size: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    vpp: int
    sp: bool  # sequence parallel in effect (requested and tp > 1)
    order: tuple[str, ...]
    hierarchical_cp: tuple[int, ...] = ()  # (a2a, p2p) sub-groups of CP (cp_comm_type=a2a+p2p)

    def attention_grid(self) -> dict[str, int]:
        """Sizes per order name for TP x CP x DP x PP (ep is not a dimension of attention)."""
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    def expert_grid(self) -> dict[str, int]:
        """Sizes per order name for ETP x EP x EDP x PP: tp -> etp, dp -> edp, no cp."""
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}


def _check_pp_groups_agree(sizes: ParallelSizes) -> None:
    """Both grids share one pipeline: a rank must sit on the same stage in each.

    PP groups coincide exactly when the dimensions ordered before pp span the same number of
    ranks in both grids (always true when pp is last, as in the default order).
    """
    before = sizes.order[: sizes.order.index("pp")]
    attn, expert = sizes.attention_grid(), sizes.expert_grid()
    attn_span = _prod(attn[d] for d in before)
    expert_span = _prod(expert[d] for d in before)
    if attn_span != expert_span:
        names = "*".join(before) or "(nothing)"
        raise ValueError(
            f"order={'-'.join(sizes.order)!r} puts {names} before pp; they span {attn_span} ranks "
            f"in the attention grid but {expert_span} in the expert grid, so a rank would sit on "
            "different pipeline stages for attention and experts. Put pp last in the order or "
            "make the spans equal"
        )


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def validate_for_model(
    parallel: ParallelConfig,
    *,
    num_attention_heads: int,
    num_kv_heads: int | None = None,
    num_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
    ffn_hidden_size: int | None = None,
    num_layers: int | None = None,
    seq_length: int | None = None,
    custom_pipeline_layout: bool = False,
) -> None:
    """Check that the model's shapes split evenly over the layout; raise ValueError naming both."""
    tp, cp, ep, etp = parallel.tp, parallel.cp, parallel.ep, parallel.etp

    def divides(size_name: str, size: int, what: str, value: int | None) -> None:
        if value is not None and value % size:
            raise ValueError(f"{size_name}={size} does not divide {what}={value}")

    divides("tp", tp, "num_attention_heads", num_attention_heads)
    if num_kv_heads is not None and num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tp={tp} and num_kv_heads={num_kv_heads}: kv heads are split over tp when tp divides "
            "them and replicated when they divide tp; neither holds"
        )
    divides("ep", ep, "num_experts", num_experts)
    divides("etp", etp, "moe_ffn_hidden_size", moe_ffn_hidden_size)
    divides("tp", tp, "ffn_hidden_size", ffn_hidden_size)
    if num_layers is not None and not custom_pipeline_layout:
        stages = parallel.pp * parallel.vpp
        if num_layers % stages:
            raise ValueError(
                f"pp*vpp = {parallel.pp}*{parallel.vpp} = {stages} does not divide "
                f"num_layers={num_layers}; give a pipeline layout string for uneven stages"
            )
    a2a = {"a2a": cp, "a2a+p2p": (parallel.hierarchical_cp or [1])[0]}.get(parallel.cp_comm_type, 1)
    if a2a > 1:  # Ulysses splits this TP rank's heads (kv heads: or replicates them when fewer than a2a)
        heads, kv = num_attention_heads // tp, num_kv_heads
        kv = None if kv is None else (kv // tp if kv % tp == 0 else 1)
        if heads % a2a or (kv is not None and kv % a2a and a2a % kv):
            raise ValueError(
                f"parallel.cp_comm_type={parallel.cp_comm_type} splits attention heads over {a2a} ranks, but each "
                f"tp rank holds {heads} query heads and {kv} kv heads: {a2a} must divide the query heads, and "
                "divide the kv heads or be a multiple of them; use parallel.cp_comm_type=allgather or p2p")
    if seq_length is not None:
        if cp > 1 and seq_length % (2 * cp):
            raise ValueError(
                f"2*cp = {2 * cp} does not divide seq_length={seq_length} (the causal "
                "load-balanced split gives each cp rank two chunks)"
            )
        if parallel.sequence_parallel and (seq_length // cp) % tp:
            raise ValueError(
                f"tp={tp} does not divide the per-cp-rank sequence {seq_length}//{cp} = "
                f"{seq_length // cp} (sequence parallel shards it over tp)"
            )
