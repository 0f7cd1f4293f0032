"""Critic values to actor ranks through the Ray object store, as one flat buffer per payload.

Inputs are torch tensors or numpy arrays; outputs are always torch tensors.
"""

from ppo_value_transport._box import Box
from ppo_value_transport._codec import pack, pack_fields, unpack, unpack_fields
from ppo_value_transport._dtypes import TORCH_DTYPES
from ppo_value_transport._errors import MissingValuesError
from ppo_value_transport._pairing import Pieces, Rows, pair_values, unpack_pieces
from ppo_value_transport._routing import dispatch, gather, require_values, route

__version__ = "0.2.0"

SUPPORTED_DTYPES: tuple[str, ...] = tuple(TORCH_DTYPES)

__all__ = [
    "SUPPORTED_DTYPES",
    "Box",
    "MissingValuesError",
    "Pieces",
    "Rows",
    "__version__",
    "dispatch",
    "gather",
    "pack",
    "pack_fields",
    "pair_values",
    "require_values",
    "route",
    "unpack",
    "unpack_fields",
    "unpack_pieces",
]
