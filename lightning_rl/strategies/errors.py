"""The one error a strategy raises when this machine cannot run it."""

from lightning_rl.errors import UserError


class StrategyUnavailableError(UserError, ValueError):
    """A strategy was asked for that this hardware or software cannot run; the message says what to use instead."""

    key = "trainer.strategy"
