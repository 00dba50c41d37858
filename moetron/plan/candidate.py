"""One parallel layout the planner can evaluate: sizes, schedule, micro-batch and recompute choice.

`Candidate.parse("tp=2 pp=8 vpp=4 ep=64 recompute=mla_up_proj,moe_act")` reads the `--explain` form; the
keys are ParallelConfig's names (plus mbs and recompute). Design notes: docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetron.ops.recompute import MODULES

SCHEDULES = ("1f1b", "interleaved", "zb1p", "dualpipev")
KEYS = ("tp", "cp", "ep", "etp", "pp", "vpp", "mbs", "schedule", "recompute", "fb_overlap", "sp")


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
        return (self.tp, self.cp, self.ep, self.etp, self.pp, self.chunks, self.schedule)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"cp={self.cp}", f"ep={self.ep}", f"etp={self.etp}", f"pp={self.pp}"]
        if self.chunks > 1 and self.schedule == "interleaved":
            parts.append(f"vpp={self.vpp}")
        parts += [f"schedule={self.schedule}", f"mbs={self.mbs}", f"recompute={self.recompute_label}"]
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
        if cand.vpp > 1 and cand.schedule != "interleaved":
            raise ValueError(f"--explain: vpp={cand.vpp} needs schedule=interleaved (dualpipev always holds 2 "
                             "chunks per rank)")
        return cand
