"""Routing and token dispatch: permute/unpermute and the local, all-gather, all-to-all and flex dispatchers."""

from moetron.dispatch.base import LocalDispatcher, TokenDispatcher
from moetron.dispatch.flex import FlexDispatcher, FlexTokenDispatcher
from moetron.dispatch.routing import Routing

__all__ = ["FlexDispatcher", "FlexTokenDispatcher", "LocalDispatcher", "Routing", "TokenDispatcher"]
