"""Forward pre-hooks that wait for the distributed optimizer's parameter all-gathers, module by module.

With `overlap_param_gather` an optimizer step only launches the all-gathers; each module waits for
the buckets of its own parameters just before its forward, so a bucket's gather overlaps the compute
of the layers before it. A mixin of `DataParallel` (moetron/parallel/data_parallel.py), which owns
`slots`, `buckets`, `module`, `_handles` and `finish_param_sync()`.
"""

from __future__ import annotations

from torch import nn


class GatherWaits:
    """The waits (`_register_gather_waits` installs them when DataParallel is built with
    `overlap_param_gather=True`)."""

    def _wait_gather(self, bucket) -> None:
        if bucket.gather_work is not None:
            bucket.gather_work.wait()
            bucket.gather_work = None

    def _register_gather_waits(self) -> None:
        """Forward pre-hooks that wait for the buckets of each module's own parameters.

        A parameter read without calling its module (MoETransformer.head reads lm_head.weight
        through F.linear) would be missed, so the first forward (before any step, nothing
        pending) records which modules really run; from then on the buckets of the others are
        waited for when the root module's forward starts.
        """
        by_param = {id(s.param): s.bucket for s in self.slots}
        self._owned_buckets: dict[int, list] = {}  # module id -> its parameters' buckets
        self._owner_names: dict[int, str] = {}
        self._ran: set[int] | None = None  # modules whose forward ran, while learning
        self._early_buckets: list | None = None
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_hook))
        for name, sub in self.module.named_modules():
            mine = {id(by_param[id(p)]): by_param[id(p)]
                    for p in sub.parameters(recurse=False) if id(p) in by_param}
            if mine:
                self._owned_buckets[id(sub)] = list(mine.values())
                self._owner_names[id(sub)] = name
                self._handles.append(sub.register_forward_pre_hook(self._module_pre_hook))
        self._handles.append(self.module.register_forward_hook(self._root_post_hook))

    @property
    def modules_waited_at_forward_start(self) -> list[str] | None:
        """Modules whose parameters are used without calling them (None until the first forward)."""
        if self._early_buckets is None:
            return None
        return sorted(self._owner_names[m] for m in self._not_run)

    def _root_pre_hook(self, module: nn.Module, args) -> None:
        if self._early_buckets is None:
            self.finish_param_sync()
            self._ran = set()
        else:
            for bucket in self._early_buckets:
                self._wait_gather(bucket)

    def _module_pre_hook(self, module: nn.Module, args) -> None:
        if self._ran is not None:
            self._ran.add(id(module))
        for bucket in self._owned_buckets[id(module)]:
            self._wait_gather(bucket)

    def _root_post_hook(self, module: nn.Module, args, out) -> None:
        if self._ran is not None:
            self._not_run = [m for m in self._owned_buckets if m not in self._ran]
            early = {id(b): b for m in self._not_run for b in self._owned_buckets[m]}
            self._early_buckets = list(early.values())
            self._ran = None
        self.finish_param_sync()  # whatever the forward did not touch is complete when it returns
