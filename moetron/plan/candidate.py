"""One parallel layout the planner can evaluate: sizes, schedule, micro-batch and recompute choice.

`Candidate.parse("tp=2 pp=8 vpp=4 ep=64 recompute=mla_up_proj,moe_act")` reads the `--explain` form; the
keys are ParallelConfig's names (plus mbs and recompute). Design notes: docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetron.ops.recompute import MODULES

SCHEDULES = ("1f1b", "interleaved", "zb1p", "dualpipev")
CP_COMM_TYPES = ("allgather", "p2p", "a2a", "a2a+p2p")  # parallel.cp_comm_type
KEYS = ("tp", "cp", "ep", "etp", "pp", "vpp", "mbs", "schedule", "recompute", "fb_overlap", "sp", "zero_stage",
        "cp_comm_type")


class Pruned(ValueError):
    """A layout that cannot run; the message is the reason."""


@dataclass(frozen=True)
class Candidate:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual stages per rank (interleaved); dualpipev always holds 2
    schedule: str = "1f1b"
    mbs: int = 1
    recompute: tuple[str, ...] = ()  # selective modules (Megatron-Core names)
    full_recompute: bool = False  # recompute_every_n_layers=1
    fb_overlap: bool = False  # EP all-to-all hidden behind another micro-batch's compute
    sp: bool = True  # sequence parallel whenever tp > 1 (Megatron's requirement for MoE with TP)
    zero_stage: int = 1  # parallel.zero_stage: 1 optimizer state, 2 + gradients, 3 + parameters (dp only)
    cp_comm_type: str = "allgather"  # parallel.cp_comm_type (cp > 1)

    @property
    def chunks(self) -> int:
        """Model chunks (pipeline stages) per PP rank."""
        if self.pp == 1:
            return 1
        return 2 if self.schedule == "dualpipev" else (self.vpp if self.schedule == "interleaved" else 1)

    @property
    def recompute_label(self) -> str:
        if self.full_recompute:
            return "full"
        return ",".join(self.recompute) or "none"

    def dp(self, gpus: int) -> int:
        return gpus // (self.tp * self.cp * self.pp)

    def edp(self, gpus: int) -> int:
        return gpus // (self.etp * self.ep * self.pp)

    def key(self) -> tuple:
        """The parallel layout without the per-run knobs (micro-batch size, recompute, overlap)."""
        return (self.tp, self.cp, self.ep, self.etp, self.pp, self.chunks, self.schedule, self.zero_stage,
                self.cp_comm_type)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"cp={self.cp}", f"ep={self.ep}", f"etp={self.etp}", f"pp={self.pp}"]
        if self.chunks > 1 and self.schedule == "interleaved":
            parts.append(f"vpp={self.vpp}")
        parts += [f"schedule={self.schedule}", f"mbs={self.mbs}", f"recompute={self.recompute_label}"]
        if self.zero_stage != 1:
            parts.append(f"zero_stage={self.zero_stage}")
        if self.cp > 1:
            parts.append(f"cp_comm_type={self.cp_comm_type}")
        if self.fb_overlap:
            parts.append("fb_overlap=moe")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """`key=value` words; recompute is a comma list of modules, `full`, or `none`."""
        values: dict = {}
        for word in text.replace(";", " ").split():
            if "=" not in word:
                raise ValueError(f"--explain: {word!r} is not key=value (keys: {', '.join(KEYS)})")
            key, value = word.split("=", 1)
            key = key.strip().lower()
            if key not in KEYS:
                raise ValueError(f"--explain: unknown key {key!r}; use {', '.join(KEYS)}")
            if key == "schedule":
                if value not in SCHEDULES:
                    raise ValueError(f"--explain: schedule={value!r}; choose one of {', '.join(SCHEDULES)}")
                values[key] = value
            elif key == "cp_comm_type":
                if value not in CP_COMM_TYPES:
                    raise ValueError(f"--explain: cp_comm_type={value!r}; choose one of {', '.join(CP_COMM_TYPES)}")
                values[key] = value
            elif key == "recompute":
                if value in ("full", "none", ""):
                    values["full_recompute"] = value == "full"
                    values["recompute"] = ()
                else:
                    mods = tuple(m for m in value.split(",") if m)
                    bad = [m for m in mods if m not in MODULES]
                    if bad:
                        raise ValueError(f"--explain: recompute module {bad[0]!r} is unknown; choose from "
                                         f"{', '.join(MODULES)}, or full / none")
                    values["recompute"] = mods
            elif key in ("fb_overlap", "sp"):
                values[key] = value.lower() in ("1", "true", "yes", "on", "moe", "layer")
            else:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ValueError(f"--explain: {key}={value!r} must be an integer") from None
                if values[key] < 1:
                    raise ValueError(f"--explain: {key}={value} must be >= 1")
        if "etp" not in values:
            values["etp"] = 1
        cand = cls(**values)
        if "schedule" not in values and cand.pp > 1:
            cand = replace(cand, schedule="interleaved" if cand.vpp > 1 else "1f1b")
        if cand.fb_overlap and (cand.pp == 1 or cand.schedule == "zb1p"):
            raise ValueError("--explain: fb_overlap pairs a forward with another micro-batch's full backward: it "
                             "needs pp >= 2 and a schedule other than zb1p (whose backward is split); drop "
                             "fb_overlap or change the schedule")
        if cand.zero_stage not in (1, 2, 3):
            raise ValueError(f"--explain: zero_stage={cand.zero_stage}; choose 1, 2 or 3")
        if cand.zero_stage == 3 and (cand.tp, cand.cp, cand.ep, cand.etp, cand.pp) != (1, 1, 1, 1, 1):
            raise ValueError("--explain: zero_stage=3 (FSDP2) runs data parallel only (tp=cp=ep=pp=1); use "
                             "zero_stage=2 with model parallelism")
        if cand.cp_comm_type != "allgather" and cand.cp == 1:
            raise ValueError(f"--explain: cp_comm_type={cand.cp_comm_type} needs cp > 1")
        if cand.vpp > 1 and cand.schedule != "interleaved":
            raise ValueError(f"--explain: vpp={cand.vpp} needs schedule=interleaved (dualpipev always holds 2 "
                             "chunks per rank)")
        return cand
