"""Errors a worker raises that the driver reports by their fields (they cross Ray: they pickle with
them). No heavy imports here: the driver imports this module to recognise them."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["NonFiniteWeightsError"]


class NonFiniteWeightsError(RuntimeError):
    """A role's weights hold NaN or infinite values; ``action`` ("save" or "send") was refused, so no
    checkpoint and no engine ever holds them."""

    def __init__(self, role: str, rank: int, names: list[str], action: Literal["save", "send"]) -> None:
        self.role, self.rank, self.names, self.action = role, rank, list(names), action
        shown = ", ".join(self.names[:5]) + (
            f" and {len(self.names) - 5} more" if len(self.names) > 5 else ""
        )
        verb = "saving them" if action == "save" else "sending them to the engines"
        super().__init__(f"{role} rank {rank}: non-finite weights ({shown}); refused {verb}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds from self.args (the formatted message), which does not fit __init__.
        return (type(self), (self.role, self.rank, self.names, self.action), {"args": self.args})
