"""The dtypes a payload may carry, by name, on both sides of the wire."""

from __future__ import annotations

import numpy as np
import torch

# Every dtype travels as raw bytes inside one uint8 buffer and is viewed back on the receiver by
# name. That is also how bfloat16 crosses: numpy has no bfloat16, but a torch uint8 view of the
# bytes can be re-viewed as torch.bfloat16 without a copy.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_BY_TORCH: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
_BY_NUMPY: dict[np.dtype, str] = {np.dtype(k): k for k in TORCH_DTYPES if k != "bfloat16"}


def dtype_name(dtype: torch.dtype | np.dtype, where: str) -> str:
    """The wire name of ``dtype``; a ``ValueError`` naming ``where`` when it cannot travel."""
    name = _BY_TORCH.get(dtype) if isinstance(dtype, torch.dtype) else _BY_NUMPY.get(np.dtype(dtype))
    if name is None:
        raise ValueError(
            f"{where}: dtype {dtype} cannot travel; supported: {', '.join(TORCH_DTYPES)} "
            "(convert the tensor first, e.g. .to(torch.float32))"
        )
    return name
