"""Enumerate the layouts of a model on a cluster, prune the invalid ones with the reason, price the rest.

`Planner(inputs).search(top)` walks tp, cp, pp, ep, etp, schedule (with vpp), micro-batch size; for each it
takes the least recompute that fits in memory (more recompute only adds time), ranks by an analytic bubble,
then re-ranks the best with the pipeline simulator running the runtime's own schedules. Everything per
layout is cached, so DeepSeek-V3 on 2048 GPUs plans in seconds. Design notes: docs/planning.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from moetron.config import ModelConfig
from moetron.model.size import training_flops_per_token
from moetron.pipeline.layout import balanced_layout, item_costs, parse_layout
from moetron.pipeline.schedules import build_schedule
from moetron.pipeline.simulator import simulate
from moetron.plan.staged import staged_run
from moetron.plan.candidate import CP_COMM_TYPES, SCHEDULES, Candidate, Pruned
from moetron.plan.comm import check_zero_and_cp, dp_exposed
from moetron.plan.cost import LATENCY_S, OVERLAP_SM_SHARE, Setting, StageTime, group_link, head_time, layer_time
from moetron.plan.gpus import GPU
from moetron.plan.memory import (GiB, comm_buffer_bytes, imbalance_headroom, layer_param_counts, rank_state,
                                 shared_ffn, stage_activation_bytes)


@dataclass(frozen=True)
class PlanInputs:
    config: ModelConfig
    gpus: int
    gpu: GPU
    per_node: int
    seq: int
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"
    fp8: str | None = None
    device: str = "cuda"
    reserve_gib: float = 4.0  # CUDA context, allocator fragmentation, NCCL: never available to tensors
    imbalance: float = 1.1  # the busiest rank receives this x its share of routed rows (headroom)
    moetron_only: bool = True  # prune what moetron's trainer cannot run yet (CP with MTP)
    # FP8 storage assumptions (docs/planning.md). moetron's own: linear inputs saved in FP8, one FP8 copy of
    # each weight per step (per micro-batch under delayed scaling). fp8_weight_cache: once per step under
    # delayed scaling too (Transformer Engine's first-micro-batch cache). fp8_cache: DeepSeek-V3's
    # low-precision activation storage (technical report section 3.3): SwiGLU input and attention output
    # in FP8 / E5M6, routed rows received expert-major in FP8 with no regroup copy.
    fp8_weight_cache: bool = False
    fp8_cache: bool = False
    # the search space (`--schedules`, `--no-fb-overlap`, `--zero-stages`): e.g. what another framework offers
    schedules: tuple[str, ...] = SCHEDULES
    fb_overlap: bool = True  # the search may hide the EP all-to-all behind the paired micro-batch (DualPipeV)
    # schedules under which the search also tries fb_overlap (`--fb-overlap-schedules`): moetron's pairing
    # pays off under DualPipeV; Megatron-Core's combined-1F1B A2A overlap (moe_a2a_overlap) runs interleaved
    fb_overlap_schedules: tuple[str, ...] = ("dualpipev",)
    zero_stages: tuple[int, ...] = (1, 2, 3)
    dispatcher: str = "alltoall"  # parallel.dispatcher: alltoall (moetron's default) or flex (DeepEP)
    # whose activation storage the memory follows (`--activations`): moetron's own (measured by
    # tests/test_plan.py), or megatron (Megatron-Core with Transformer Engine: plan/memory.py
    # `_megatron_storage`), to compare with runs published from that framework
    activations: str = "moetron"
    # ZeRO-1's gradient reduce-scatter overlapped with the last micro-batch's backward (moetron's
    # overlap_grad_reduce, Megatron's default); False prices a run that turned it off
    overlap_grad_reduce: bool = True


@dataclass
class Evaluation:
    cand: Candidate
    microbatches: int
    layout: str
    memory: dict[str, float]  # bytes on the fullest rank, by part
    time: dict[str, float]  # seconds per step, by part
    step_s: float
    tokens_per_s_gpu: float
    tflops: float
    mfu: float
    simulated: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


RECOMPUTE_OPTIONS = {  # from least to most memory saved; the first that fits wins
    "deepseek_v3": [(), ("moe_act",), ("moe_act", "layernorm"), ("mla_up_proj", "moe_act", "layernorm"),
                    ("mla_up_proj", "mlp", "moe_act", "layernorm", "shared_experts"), ("moe", "layernorm",
                                                                                       "mla_up_proj"), "full"],
    "qwen3_moe": [(), ("moe_act",), ("moe_act", "layernorm"), ("core_attn", "moe_act", "layernorm"),
                  ("moe", "layernorm"), "full"],
}


class Planner:
    def __init__(self, inputs: PlanInputs):
        self.i = inputs
        c = inputs.config
        self.setting = Setting(inputs.seq, inputs.dtype, bool(inputs.fp8), inputs.gpu, inputs.per_node,
                               inputs.device, inputs.dispatcher, inputs.fp8 or "")
        self.capacity = inputs.gpu.memory_gib * GiB - inputs.reserve_gib * GiB
        self.flops_per_token = training_flops_per_token(c, inputs.seq)
        self._costs = item_costs(c, inputs.seq)
        self._layouts: dict = {}
        self._states: dict = {}
        self._acts: dict = {}
        self._layer_times: dict = {}
        self._peaks: dict = {}
        self._act_peaks: dict = {}
        self._headroom: dict = {}
        self.pruned: Counter = Counter()

    # --- structure --------------------------------------------------------------------------------
    def check(self, cand: Candidate) -> int:
        """Raise Pruned with the reason, or return the number of micro-batches per step."""
        c, i = self.i.config, self.i
        tp, cp, ep, etp, pp = cand.tp, cand.cp, cand.ep, cand.etp, cand.pp
        if i.gpus % (tp * cp * pp):
            raise Pruned(f"tp*cp*pp = {tp * cp * pp} does not divide {i.gpus} GPUs")
        if i.gpus % (etp * ep * pp):
            raise Pruned(f"etp*ep*pp = {etp * ep * pp} does not divide {i.gpus} GPUs")
        if tp > i.per_node:
            raise Pruned(f"tp={tp} spans more than one NVLink domain ({i.per_node} GPUs)")
        if etp * ep * pp > i.gpus:
            raise Pruned("etp*ep*pp exceeds the GPUs")
        if c.num_attention_heads % tp:
            raise Pruned(f"tp={tp} does not divide num_attention_heads={c.num_attention_heads}")
        if c.attention_type == "gqa" and c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise Pruned(f"tp={tp} and num_kv_heads={c.num_kv_heads} neither divides the other")
        if c.vocab_size % tp:
            raise Pruned(f"tp={tp} does not divide vocab_size={c.vocab_size}")
        if c.num_experts % ep:
            raise Pruned(f"ep={ep} does not divide num_experts={c.num_experts}")
        if c.moe_intermediate_size % etp or shared_ffn(c) % tp:
            raise Pruned(f"etp={etp} / tp={tp} does not divide the expert ffn sizes")
        if c.intermediate_size % tp:
            raise Pruned(f"tp={tp} does not divide intermediate_size={c.intermediate_size}")
        if cp > 1 and i.seq % (2 * cp):
            raise Pruned(f"2*cp = {2 * cp} does not divide seq_len={i.seq}")
        if tp > 1 and (i.seq // cp) % tp:
            raise Pruned(f"tp={tp} does not divide the per-cp-rank sequence {i.seq // cp} (sequence parallel)")
        if i.moetron_only and cp > 1 and c.num_mtp_layers:
            raise Pruned("cp>1 with MTP: moetron's context parallel does not shift MTP labels yet")
        if pp * cand.chunks > c.num_layers + c.num_mtp_layers + 2:
            raise Pruned(f"pp*chunks = {pp * cand.chunks} stages for {c.num_layers} layers")
        dp = cand.dp(i.gpus)
        check_zero_and_cp(c, cand, dp, i.per_node)
        if i.global_batch % (dp * cand.mbs):
            raise Pruned(f"global batch {i.global_batch} is not a multiple of dp*mbs = {dp}*{cand.mbs}")
        m = i.global_batch // (dp * cand.mbs)
        if pp > 1:
            if cand.schedule == "interleaved" and cand.vpp > 1 and m < pp:
                raise Pruned(f"interleaved: {m} micro-batches < pp={pp}")
            if cand.schedule == "dualpipev" and (m % 2 or m < 2 * pp):
                raise Pruned(f"dualpipev: {m} micro-batches, needs an even number >= 2*pp = {2 * pp}")
        return m

    def layout(self, cand: Candidate):
        key = (cand.pp, cand.chunks, cand.schedule)
        if key not in self._layouts:
            c = self.i.config
            text = balanced_layout(self._costs, pp=cand.pp, vpp=cand.chunks)
            layout = parse_layout(text, num_layers=c.num_layers, mtp_layers=c.num_mtp_layers, pp=cand.pp,
                                  vpp=cand.chunks)
            sched = build_schedule(cand.schedule, pp=cand.pp, microbatches=2 * cand.pp * cand.chunks,
                                   vpp=cand.vpp if cand.schedule == "interleaved" else None)
            stages = [[layout.stages[s] for s in sched.stages_of_rank(r)] for r in range(cand.pp)]
            self._layouts[key] = (text, stages)
        return self._layouts[key]

    def _moe_count(self, stage) -> int:
        c = self.i.config
        layers = stage.decoder_layers if stage is not None else range(c.num_layers)
        extra = len(stage.mtp_layers) if stage is not None else c.num_mtp_layers
        return sum(1 for j in layers if c.is_moe_layer(j)) + extra

    def _sim_m(self, cand: Candidate, m: int) -> int:
        """Micro-batches simulated: enough for the steady state, even for DualPipeV."""
        m_eff = min(m, 2 * cand.pp + 2)
        return m_eff - (m_eff % 2 if cand.schedule == "dualpipev" else 0)

    def inflight(self, cand: Candidate, m: int) -> list[list[tuple[int, ...]]]:
        """Per PP rank, the maximal vectors of micro-batches in flight per chunk (forward started,
        backward not finished) over the simulated run of the runtime's schedule."""
        if cand.pp == 1:
            return [[(1,)]]
        m_eff = self._sim_m(cand, m)
        key = (cand.schedule, cand.pp, cand.chunks, m_eff)
        if key not in self._peaks:
            r = simulate(cand.schedule, pp=cand.pp, microbatches=m_eff,
                         vpp=cand.vpp if cand.schedule == "interleaved" else None, F=1.0, B=1.0,
                         W=1.0 if cand.schedule == "zb1p" else None)
            self._peaks[key] = _inflight_vectors(r)
        return self._peaks[key]

    # --- memory -------------------------------------------------------------------------------------
    def state(self, cand: Candidate):
        key = (cand.tp, cand.cp, cand.ep, cand.etp, cand.pp, cand.chunks, cand.schedule, cand.zero_stage)
        if key not in self._states:
            c, i = self.i.config, self.i
            stages = self.layout(cand)[1] if cand.pp > 1 else [[]]
            self._states[key] = [rank_state(c, cand, s, i.gpus, i.dtype) for s in stages]
        return self._states[key]

    def activation(self, cand: Candidate, stage) -> int:
        index = None if stage is None else (cand.pp, cand.chunks, stage.index)
        key = (cand.tp, cand.cp, cand.mbs, cand.recompute, cand.full_recompute, cand.sp, index)
        if key not in self._acts:
            self._acts[key] = stage_activation_bytes(self.i.config, stage, cand, self.i.seq, self.i.dtype,
                                                     self.i.device, bool(self.i.fp8), self.i.fp8_cache,
                                                     self.i.activations)
        return self._acts[key]

    def _per_microbatch_weights(self) -> bool:
        # moetron quantises each weight once per step under current scaling (cache_fp8_weights); delayed
        # scaling re-quantises per micro-batch
        return self.i.fp8 == "delayed" and not self.i.fp8_weight_cache

    def fp8_weights(self, cand: Candidate, stage) -> int:
        """moetron's FP8 linears save the quantised weight for the input-gradient GEMM: one byte per GEMM
        weight of the chunk, held per micro-batch in flight (precision/fp8_matmul.py)."""
        if not self._per_microbatch_weights():
            return 0
        c = self.i.config
        layers = list(stage.decoder_layers) if stage is not None else list(range(c.num_layers))
        layers += [c.num_layers + j for j in (stage.mtp_layers if stage is not None else range(c.num_mtp_layers))]
        return sum(sum(layer_param_counts(c, j, cand.tp, cand.ep, cand.etp)) for j in layers)

    def memory(self, cand: Candidate, m: int) -> dict[str, float]:
        """Bytes on the fullest PP rank, by part."""
        c, i = self.i.config, self.i
        states, vectors = self.state(cand), self.inflight(cand, m)
        stages = self.layout(cand)[1] if cand.pp > 1 else [[None]]
        extra = 1 if cand.fb_overlap and cand.schedule != "dualpipev" else 0
        numel = max(s.dense_numel + s.expert_numel for s in states)
        buffers = comm_buffer_bytes(c, cand, i.seq, i.dtype, bool(i.fp8), i.gpus, numel)
        by_ep = (cand.ep, cand.etp) if self._per_microbatch_weights() else None
        key = (cand.schedule, cand.pp, cand.chunks, self._sim_m(cand, m), extra, cand.tp, cand.cp, cand.mbs,
               cand.recompute, cand.full_recompute, cand.sp, by_ep)
        if key not in self._act_peaks:  # activations do not depend on ep / etp: shared by those layouts
            peaks = []
            for rank_stages, rank_vectors in zip(stages, vectors):
                acts = [self.activation(cand, s) for s in rank_stages]
                weights = [self.fp8_weights(cand, s) for s in rank_stages]
                moes = [self._moe_count(s) for s in rank_stages]
                options = []
                for v in rank_vectors:
                    a = sum(n * x for n, x in zip(v, acts)) + extra * max(acts)
                    w = sum(n * x for n, x in zip(v, weights)) + extra * max(weights)
                    options.append((a + w, a, w, sum(n * k for n, k in zip(v, moes)) + extra * max(moes)))
                peaks.append(max(options)[1:])
            self._act_peaks[key] = peaks
        hkey = (cand.tp, cand.cp, cand.ep, cand.mbs, cand.recompute, cand.full_recompute, cand.sp)
        if hkey not in self._headroom:  # per in-flight MoE layer
            self._headroom[hkey] = imbalance_headroom(c, cand, i.seq, i.dtype, 1, 1, i.imbalance, i.device,
                                                      bool(i.fp8), i.fp8_cache, i.activations)
        best = None
        for st, (act, w8, moe) in zip(states, self._act_peaks[key]):
            parts = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": act,
                     "fp8 weights": w8, "buffers": buffers,
                     "imbalance": self._headroom[hkey] * moe}
            if best is None or sum(parts.values()) > sum(best.values()):
                best = parts
        return best

    # --- time ---------------------------------------------------------------------------------------
    def layer(self, cand: Candidate, idx: int) -> StageTime:
        c = self.i.config
        moe = c.is_moe_layer(idx)
        key = (moe, cand.tp, cand.cp, cand.ep, cand.etp, cand.mbs, cand.recompute, cand.full_recompute, cand.sp,
               cand.cp_comm_type)
        if key not in self._layer_times:
            self._layer_times[key] = layer_time(c, moe, idx, cand, self.setting)
        return self._layer_times[key]

    def chunk_times(self, cand: Candidate) -> list[StageTime]:
        c = self.i.config
        if cand.pp == 1:
            groups = [(list(range(c.num_layers)), list(range(c.num_mtp_layers)), True)]
        else:
            groups = [(s.decoder_layers, s.mtp_layers, s.has_loss) for st in self.layout(cand)[1] for s in st]
        out = []
        for layers, mtp, loss in groups:
            t = StageTime()
            for j in layers:
                t.add(self.layer(cand, j))
            for j in mtp:
                t.add(self.layer(cand, c.num_layers + j))
                t.add(head_time(c, cand, self.setting))
            if loss:
                t.add(head_time(c, cand, self.setting))
            out.append(t)
        return out

    def step_time(self, cand: Candidate, m: int, simulated: bool) -> dict[str, float]:
        i = self.i
        chunks = self.chunk_times(cand)
        slow = max(chunks, key=lambda t: t.F + t.B + t.W)
        F, B, W = slow.F, slow.B, slow.W
        hidden_ep = 0.0
        pair = None
        if cand.fb_overlap and cand.ep > 1:
            if cand.schedule == "dualpipev" and cand.pp > 1:
                comp = F + B + W - 2 * slow.ep_fwd
                overlapped = min(comp, 2 * slow.ep_fwd)  # comm running beside compute, on SMs it takes
                pair = max(comp, 2 * slow.ep_fwd) + overlapped * OVERLAP_SM_SHARE
                hidden_ep = F + B + W - pair
            else:
                h = max(0.0, (m - cand.pp * cand.chunks) / m)
                kept = 1 - OVERLAP_SM_SHARE  # the overlapped comm's kernels take SMs from the compute
                hidden_ep = 2 * slow.ep_fwd * h * kept
                F, B = F - slow.ep_fwd * h * kept, B - slow.ep_fwd * h * kept
        dp = cand.dp(i.gpus)
        b = 4 if i.dtype == "fp32" else 2
        p2p = 0.0
        if cand.pp > 1:
            T = cand.mbs * i.seq // cand.cp // (cand.tp if cand.sp and cand.tp > 1 else 1)
            p2p = T * i.config.hidden_size * b / group_link(cand.pp, cand.tp * cand.cp * dp, i.per_node, i.gpu) \
                + LATENCY_S
        busy = m * sum((t.F + t.B + t.W) for t in chunks) / len(chunks) * cand.chunks
        if cand.pp == 1:
            makespan = m * (F + B + W)
        elif simulated:
            makespan, hidden = self._staged_makespan(cand, m, p2p)
            hidden_ep = hidden / (m * cand.chunks * cand.pp)  # staged_run sums over the pp ranks
        else:
            unit = F + B + W
            n = m * cand.chunks
            if cand.schedule == "dualpipev":
                makespan = n * (pair or unit) + (cand.pp - 1) * max(F, (pair or unit) - W) + 2 * (cand.pp - 1) * p2p
            elif cand.schedule == "zb1p":
                makespan = n * unit + (cand.pp - 1) * max(F + B - W, 0.0) + 2 * (cand.pp - 1) * p2p
            else:
                makespan = n * unit + (cand.pp - 1) * unit + 2 * (cand.pp - 1) * p2p * cand.chunks
        states = self.state(cand)
        worst = max(states, key=lambda s: s.dense_numel + s.expert_numel)
        pbytes = 4 if i.dtype == "fp32" else 2
        dense_link = group_link(dp * cand.cp, cand.tp, i.per_node, i.gpu)
        edp = cand.edp(i.gpus)
        expert_link = group_link(edp, cand.etp * cand.ep, i.per_node, i.gpu)
        g_d, g_e = dp * cand.cp, edp
        reduce = worst.dense_numel * 4 * (g_d - 1) / g_d / dense_link + worst.expert_numel * 4 * (g_e - 1) / g_e \
            / expert_link
        gather = worst.dense_numel * pbytes * (g_d - 1) / g_d / dense_link + worst.expert_numel * pbytes * \
            (g_e - 1) / g_e / expert_link
        dp_time = dp_exposed(cand.zero_stage, m, cand.chunks, F, B, W, reduce, gather, i.overlap_grad_reduce)
        optimizer = worst.optimizer / 12 * 32 / (i.gpu.hbm_tbps * 1e12)
        mean = {k: m * cand.chunks * sum(t.comm[k] for t in chunks) / len(chunks) for k in ("tp", "cp", "ep")}
        compute = busy - sum(mean.values())
        return {"compute": compute, "recompute": m * cand.chunks * sum(t.recompute for t in chunks) / len(chunks),
                "tp comm": mean["tp"], "cp comm": mean["cp"], "ep comm": mean["ep"],
                "ep hidden": -m * cand.chunks * hidden_ep,
                "pp bubble+p2p": makespan - (busy - m * cand.chunks * hidden_ep),
                "dp comm": dp_time, "optimizer": optimizer, "step": makespan + dp_time + optimizer}

    def _staged_makespan(self, cand: Candidate, m: int, p2p: float) -> tuple[float, float]:
        """(makespan, hidden EP time) of the runtime's schedule with each stage's own costs (plan/staged.py).
        Past the steady state a schedule repeats with a fixed period, so two runs at a few micro-batches
        extrapolate linearly to `m` (exact once periodic)."""
        c = self.i.config
        stages = [s for st in self.layout(cand)[1] for s in st]
        costs = dict(zip((s.index for s in stages), self.chunk_times(cand)))
        vpp = cand.vpp if cand.schedule == "interleaved" else None
        overlap = cand.fb_overlap and cand.ep > 1 and any(c.is_moe_layer(j) for j in range(c.num_layers))

        def run(n: int) -> tuple[float, float]:
            return staged_run(cand.schedule, cand.pp, n, vpp, costs, p2p, overlap)

        m1 = self._sim_m(cand, m)
        if m1 >= m:
            return run(m)
        step = 2 if cand.schedule == "dualpipev" else (cand.pp if cand.schedule == "interleaved" else 1)
        m2 = min(m, m1 + 2 * step)
        (a, ha), (b, hb) = run(m1), run(m2)
        scale = (m - m1) / (m2 - m1)
        return a + (b - a) * scale, ha + (hb - ha) * scale

    # --- one layout, and the search ------------------------------------------------------------------
    def evaluate(self, cand: Candidate, simulated: bool = True, check_memory: bool = True) -> Evaluation:
        m = self.check(cand)
        mem = self.memory(cand, m)
        total = sum(mem.values())
        if check_memory and total > self.capacity:
            raise Pruned(f"out of memory: {total / GiB:.1f} GiB > {self.capacity / GiB:.1f} GiB usable")
        t = self.step_time(cand, m, simulated)
        tokens = self.i.global_batch * self.i.seq / t["step"] / self.i.gpus
        tflops = tokens * self.flops_per_token / 1e12
        return Evaluation(cand, m, self.layout(cand)[0] if cand.pp > 1 else "(one stage)", mem, t, t["step"],
                          tokens, tflops, tflops / self.i.gpu.bf16_tflops, simulated)

    def candidates(self):
        c, i = self.i.config, self.i
        divs = [d for d in range(1, i.gpus + 1) if i.gpus % d == 0]
        tps = [t for t in (1, 2, 4, 8) if t <= i.per_node and i.gpus % t == 0]
        cps = [1] + ([2, 4, 8] if i.seq >= 8192 else [])
        pps = [p for p in divs if p <= c.num_layers + c.num_mtp_layers]
        eps = [e for e in divs if c.num_experts % e == 0]
        allowed = i.schedules
        for tp in tps:
            for cp in cps:
                for cp_comm in (CP_COMM_TYPES if cp > 1 else ("allgather",)):
                    for pp in pps:
                        schedules = [("1f1b", 1)] if pp == 1 else \
                            [("1f1b", 1), ("zb1p", 1), ("dualpipev", 1)] + [("interleaved", v) for v in (2, 4)]
                        schedules = [(s, v) for s, v in schedules if pp == 1 or s in allowed]
                        for ep in eps:
                            for etp in sorted({1, tp}):
                                for sched, vpp in schedules:
                                    overlap = i.fb_overlap and overlap_possible(ep, pp, sched, i.fb_overlap_schedules)
                                    # DualPipeV's pairs are its own: overlapped only; elsewhere both are tried
                                    variants = (True,) if overlap and sched == "dualpipev" else \
                                        ((False, True) if overlap else (False,))
                                    for mbs in (1, 2):
                                        for ov in variants:
                                            yield Candidate(tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, vpp=vpp,
                                                            schedule=sched, mbs=mbs, cp_comm_type=cp_comm,
                                                            fb_overlap=ov)

    def best_variant(self, cand: Candidate, zero_stages: tuple[int, ...] | None = None) -> Evaluation:
        """Per ZeRO stage the least recompute that fits (more recompute only adds time); the fastest of those.
        ZeRO-2 / 3 are tried only where the layout can use them (comm.py `check_zero_and_cp`)."""
        reasons, found = [], []
        for zero in (zero_stages or self.i.zero_stages):
            if found and not (found[0].cand.recompute or found[0].cand.full_recompute):
                break  # fits without recompute: sharding more only adds communication
            for option in RECOMPUTE_OPTIONS[self.i.config.family]:
                trial = replace(cand, recompute=() if option == "full" else tuple(option),
                                full_recompute=option == "full", zero_stage=zero)
                try:
                    found.append(self.evaluate(trial, simulated=False))
                    break
                except Pruned as exc:
                    reasons.append(str(exc))
                    if not str(exc).startswith("out of memory"):
                        break
        if found:
            return max(found, key=lambda e: e.tokens_per_s_gpu)
        oom = [r for r in reasons if r.startswith("out of memory")]
        raise Pruned("out of memory even with full recompute" if oom else reasons[0])

    def search(self, top: int = 10, simulate_top: int = 40) -> list[Evaluation]:
        best: dict[tuple, Evaluation] = {}
        for cand in self.candidates():
            try:
                self.check(cand)
                ev = self.best_variant(cand)
            except Pruned as exc:
                self.pruned[_reason_class(str(exc))] += 1
                continue
            key = cand.key()
            if key not in best or ev.tokens_per_s_gpu > best[key].tokens_per_s_gpu:
                best[key] = ev
        ranked = sorted(best.values(), key=lambda e: -e.tokens_per_s_gpu)[:max(simulate_top, top)]
        final = [self.evaluate(e.cand, simulated=True, check_memory=False) for e in ranked]
        final.sort(key=lambda e: -e.tokens_per_s_gpu)
        return final[:top] if top else final


def overlap_possible(ep: int, pp: int, schedule: str, schedules: tuple[str, ...] = ("dualpipev",)) -> bool:
    """Whether the search tries fb_overlap: it pairs a forward with another micro-batch's backward, which
    needs pp > 1 (parallel/config.py) and a full backward (ZB1P's split backward is left unpaired:
    pipeline/overlap.py `pair_forward_backward`). By default only DualPipeV, whose F&B pairs are the
    schedule's own: under 1f1b / interleaved moetron's pairing holds each forward's output until the
    paired backward ends (docs/planning.md); `schedules` widens it (Megatron's A2A overlap runs
    interleaved). `--explain fb_overlap=1` evaluates it anywhere it can run."""
    return ep > 1 and pp > 1 and schedule in schedules and schedule != "zb1p"


def _inflight_vectors(result) -> list[list[tuple[int, ...]]]:
    """From a simulated timeline: per rank, the undominated per-chunk in-flight counts."""
    sched = result.schedule
    out = []
    for rank in range(sched.pp):
        chunk_of = {s: j for j, s in enumerate(sched.stages_of_rank(rank))}
        events = []
        for e in result.timeline:
            if e.rank != rank:
                continue
            for part in e.action.parts():
                if part.kind == "F":
                    events.append((e.start, 1, chunk_of[part.stage]))
                elif part.kind == "B":
                    events.append((e.end, -1, chunk_of[part.stage]))
        level = [0] * len(chunk_of)
        seen: set[tuple[int, ...]] = set()
        for _, delta, chunk in sorted(events):
            level[chunk] += delta
            if delta > 0:
                seen.add(tuple(level))
        vectors = [v for v in seen if not any(w != v and all(a >= b for a, b in zip(w, v)) for w in seen)]
        out.append(vectors or [tuple(level)])
    return out


def _reason_class(text: str) -> str:
    """Group prune reasons that differ only in numbers."""
    return "".join("N" if ch.isdigit() else ch for ch in text).replace("NN", "N")
