"""shoal: one coding agent, hundreds of conversations, their turns at once."""

from shoal.agent import Agent
from shoal.errors import (
    BackendCrashed,
    BadModel,
    CLINotFound,
    PlaceError,
    ProtocolMismatch,
    ProviderError,
    ShoalError,
    TurnFailed,
    TurnTimeout,
    UnknownBackend,
    WrongLoop,
)
from shoal.places import Copy, Here, Place
from shoal.prices import Price, set_price
from shoal.reply import Event, Notice, Reply, Started, StepUsage, Text, ToolFinished, ToolStarted, Usage
from shoal.session import Session, TurnStream

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "BackendCrashed",
    "BadModel",
    "CLINotFound",
    "Copy",
    "Event",
    "Here",
    "Notice",
    "Place",
    "PlaceError",
    "Price",
    "ProtocolMismatch",
    "ProviderError",
    "Reply",
    "Session",
    "ShoalError",
    "Started",
    "StepUsage",
    "Text",
    "ToolFinished",
    "ToolStarted",
    "TurnFailed",
    "TurnStream",
    "TurnTimeout",
    "UnknownBackend",
    "Usage",
    "WrongLoop",
    "set_price",
]
