"""`deep_ep.EventOverlap` (deep_ep/utils/event.py) and a CPU `EventHandle` that publishes results."""

from typing import Any, Callable, Optional, Tuple

import torch


class EventHandle:
    """Stands for a CUDA event: `current_stream_wait()` makes the outputs valid (runs `publish` once)."""

    def __init__(self, publish: Optional[Callable[[], None]] = None) -> None:
        self._publish = publish

    def current_stream_wait(self) -> None:
        if self._publish is not None:
            publish, self._publish = self._publish, None
            with torch.no_grad():  # the kernels' writes: invisible to autograd
                publish()


class EventOverlap:
    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
