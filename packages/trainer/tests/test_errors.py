"""Errors a worker raises cross Ray by pickle: they must come back with their fields."""

from __future__ import annotations

import pickle

from ppo_trainer.errors import NonFiniteWeightsError


def test_non_finite_weights_error_pickles_with_its_fields() -> None:
    names = [f"model.layers.{i}.weight" for i in range(7)]
    error = NonFiniteWeightsError("critic", 1, names, "save")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is NonFiniteWeightsError
    assert (copy.role, copy.rank, copy.names, copy.action) == ("critic", 1, names, "save")
    assert str(copy) == str(error)
    assert str(copy) == (
        "critic rank 1: non-finite weights (model.layers.0.weight, model.layers.1.weight, "
        "model.layers.2.weight, model.layers.3.weight, model.layers.4.weight and 2 more); refused saving them"
    )
