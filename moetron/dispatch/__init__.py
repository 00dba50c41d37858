"""Routing and token dispatch: permute/unpermute and the local, all-gather, all-to-all and flex dispatchers."""

from moetron.dispatch.base import LocalDispatcher, TokenDispatcher
from moetron.dispatch.flex import FlexBuffer, FlexTokenDispatcher
from moetron.dispatch.routing import Routing

__all__ = ["FlexBuffer", "FlexTokenDispatcher", "LocalDispatcher", "Routing", "TokenDispatcher"]
