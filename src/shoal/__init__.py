"""shoal: one coding agent, hundreds of conversations, their turns at once."""

from shoal.agent import Agent
from shoal.errors import (
    BackendCrashed,
    BadModel,
    BudgetExceeded,
    CLINotFound,
    FlowDepthExceeded,
    FlowError,
    PlaceError,
    ProtocolMismatch,
    ProviderError,
    ShoalError,
    TurnFailed,
    TurnTimeout,
    UnknownBackend,
    WrongLoop,
)
from shoal.flows import Branch, Budget, Flow, current, flow, run
from shoal.loader import load
from shoal.places import Copy, Here, Place
from shoal.prices import Price, set_price
from shoal.reply import Event, Notice, Reply, Started, StepUsage, Text, ToolFinished, ToolStarted, Usage
from shoal.session import Session, TurnStream

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "BackendCrashed",
    "BadModel",
    "Branch",
    "Budget",
    "BudgetExceeded",
    "CLINotFound",
    "Copy",
    "Event",
    "Flow",
    "FlowDepthExceeded",
    "FlowError",
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
    "current",
    "flow",
    "load",
    "run",
    "set_price",
]
