"""The loopback model: a scripted model server on 127.0.0.1 for tests, the demo and benchmarks."""

from shoal.loopback.server import LoopbackModel, Request, shared
from shoal.loopback.wire import INPUT_TOKENS, MODEL, OUTPUT_TOKENS

__all__ = ["INPUT_TOKENS", "MODEL", "OUTPUT_TOKENS", "LoopbackModel", "Request", "shared"]
