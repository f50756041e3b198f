"""What a token costs, per model, in US dollars per million tokens. Extend it with `set_price`."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import BadArgument
from shoal.reply import Usage


@dataclass(frozen=True)
class Price:
    input: float  # $ per million input tokens
    output: float  # $ per million output tokens
    cached: float = 0.0  # $ per million cached input tokens


# The loopback model has a fixed, round price so tests and demos can check sums exactly.
PRICES: dict[str, Price] = {
    "loopback": Price(input=1.0, output=4.0, cached=0.1),
}


def set_price(model: str, price: Price) -> None:
    if not isinstance(model, str) or not model or not isinstance(price, Price):
        raise BadArgument(f"set_price takes a model name and a shoal.Price(input=..., output=...), "
                          f"got {model!r}, {price!r}")
    PRICES[model] = price


def priced(model: str, usage: Usage) -> Usage:
    """`usage` with its cost from the table; a model not in the table keeps the backend's own figure."""
    price = PRICES.get(model) or PRICES.get(model.rsplit("/", 1)[-1])
    if price is None:
        return usage
    uncached = max(usage.input_tokens - usage.cached_tokens, 0)
    cost = (uncached * price.input + usage.cached_tokens * price.cached + usage.output_tokens * price.output) / 1e6
    return Usage(usage.input_tokens, usage.output_tokens, usage.cached_tokens, cost)
