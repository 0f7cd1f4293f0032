"""The training batch of one data-parallel rank, validated, and its padded micro-batches.

Input: the fields of INTERFACES.md's training batch (one 1-D tensor per sample per field). Response
token ``t`` of a sample of length ``L`` with response length ``R`` sits at position ``P + t`` with
``P = L - R``; it is predicted by the logits at position ``P + t - 1``, and the critic's value ``t`` (the
estimate before token ``t``) is read at that same position. Response-space tensors are ``[N, R_max]``,
right-padded with zeros and ``response_mask`` marking the real tokens.

Multi-turn samples: the response is every turn's generated tokens and the observation tokens between
turns, in order. ``loss_mask`` is 1 exactly on generated tokens; the optional ``turn_rewards`` (nonzero
on generated tokens only) and ``turn_ids`` (each token's 0-based turn, non-decreasing) default to zeros,
which is the single-turn case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

REQUIRED_FIELDS = ("tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "prompt_index")
OPTIONAL_FIELDS = ("turn_rewards", "turn_ids")


def pad_right(rows: Sequence[torch.Tensor], width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stack 1-D tensors into ``[len(rows), width]``, zero-padded on the right."""
    out = torch.zeros(len(rows), width, dtype=dtype or (rows[0].dtype if rows else torch.float32))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


@dataclass(frozen=True)
class Samples:
    """One rank's samples, validated; response-space fields already padded to ``[N, R_max]``."""

    tokens: tuple[torch.Tensor, ...]
    response_lengths: torch.Tensor  # [N] int64
    response_mask: torch.Tensor  # [N, R_max] float32, 1 on real response tokens
    loss_mask: torch.Tensor  # [N, R_max] float32, the batch's loss mask times response_mask
    reward: torch.Tensor  # [N] float32
    rollout_log_probs: torch.Tensor  # [N, R_max] float32
    prompt_index: torch.Tensor  # [N] int64
    turn_rewards: torch.Tensor  # [N, R_max] float32, per-turn rewards on generated tokens (0: none)
    turn_ids: torch.Tensor  # [N, R_max] int64, each token's 0-based turn (0 on padding)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_response(self) -> int:
        return self.response_mask.shape[1]

    @classmethod
    def from_fields(cls, fields: Mapping[str, Sequence[torch.Tensor]]) -> Samples:
        """Validate the batch fields (``ValueError`` naming the field and the sample) and pad them."""
        missing = [name for name in REQUIRED_FIELDS if name not in fields]
        if missing:
            raise ValueError(f"training batch lacks fields {missing}; it needs {list(REQUIRED_FIELDS)}")
        n = len(fields["tokens"])
        if n == 0:
            raise ValueError("training batch is empty (field 'tokens' has no samples)")
        present = REQUIRED_FIELDS + tuple(f for f in OPTIONAL_FIELDS if f in fields)
        for name in present:
            if len(fields[name]) != n:
                raise ValueError(f"field {name!r} has {len(fields[name])} samples but 'tokens' has {n}")
        tokens = tuple(t.reshape(-1).to(torch.int64).cpu() for t in fields["tokens"])
        lengths: list[int] = []
        for i in range(n):
            r = int(fields["response_length"][i].reshape(-1)[0])
            if not 0 <= r < tokens[i].numel():
                raise ValueError(
                    f"sample {i}: response_length={r} must be >= 0 and shorter than its "
                    f"{tokens[i].numel()} tokens (at least one prompt token precedes the response)"
                )
            for name in ("loss_mask", "rollout_log_probs", *present[len(REQUIRED_FIELDS) :]):
                if fields[name][i].numel() != r:
                    raise ValueError(
                        f"sample {i}: field {name!r} has {fields[name][i].numel()} entries but "
                        f"response_length is {r}"
                    )
            lengths.append(r)
        width = max(max(lengths), 1)
        response_mask = pad_right([torch.ones(r) for r in lengths], width, torch.float32)
        loss_mask = pad_right(
            [m.reshape(-1).float().cpu() for m in fields["loss_mask"]], width, torch.float32
        )
        loss_mask = loss_mask * response_mask
        turn_rewards, turn_ids = _turn_fields(fields, n, width, loss_mask)
        return cls(
            tokens=tokens,
            response_lengths=torch.tensor(lengths, dtype=torch.int64),
            response_mask=response_mask,
            loss_mask=loss_mask,
            reward=torch.stack([r.reshape(-1)[0].float().cpu() for r in fields["reward"]]),
            rollout_log_probs=pad_right(
                [x.reshape(-1).float().cpu() for x in fields["rollout_log_probs"]], width, torch.float32
            ),
            prompt_index=torch.stack(
                [p.reshape(-1)[0].to(torch.int64).cpu() for p in fields["prompt_index"]]
            ),
            turn_rewards=turn_rewards,
            turn_ids=turn_ids,
        )

    def pad_values(self, values: Sequence[torch.Tensor], what: str = "values") -> torch.Tensor:
        """Critic values (one ``[R_i]`` tensor per sample) to ``[N, R_max]``, checking count and lengths."""
        if len(values) != len(self):
            raise ValueError(f"{what}: got {len(values)} tensors for a batch of {len(self)} samples")
        for i, v in enumerate(values):
            if v.numel() != int(self.response_lengths[i]):
                raise ValueError(
                    f"{what}: sample {i} has {v.numel()} values but response_length "
                    f"{int(self.response_lengths[i])}"
                )
        return pad_right([v.reshape(-1).float().cpu() for v in values], self.max_response, torch.float32)

    def unpad(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[N, R_max]`` back to one ``[R_i]`` float32 CPU tensor per sample."""
        x = x.detach().float().cpu()
        return [x[i, : int(r)].clone() for i, r in enumerate(self.response_lengths.tolist())]


def _turn_fields(
    fields: Mapping[str, Sequence[torch.Tensor]], n: int, width: int, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optional ``turn_rewards`` and ``turn_ids``, padded (zeros where absent), validated: a turn
    reward on an observation token would be dropped by GAE, and turns only move forward."""
    turn_rewards = torch.zeros(n, width)
    if "turn_rewards" in fields:
        turn_rewards = pad_right([x.reshape(-1).float().cpu() for x in fields["turn_rewards"]], width)
        stray = (turn_rewards != 0) & (loss_mask == 0)
        if stray.any():
            i, t = (int(v) for v in stray.nonzero()[0])
            raise ValueError(
                f"sample {i}: field 'turn_rewards' is {float(turn_rewards[i, t])} at response token {t}, "
                "where loss_mask is 0; put each turn's reward on its last generated token"
            )
    turn_ids = torch.zeros(n, width, dtype=torch.int64)
    if "turn_ids" in fields:
        rows = [x.reshape(-1).cpu() for x in fields["turn_ids"]]
        for i, row in enumerate(rows):
            if row.is_floating_point() and not torch.equal(row, row.round()):
                raise ValueError(f"sample {i}: field 'turn_ids' holds non-integers; send int64 turn numbers")
            ids = row.to(torch.int64)
            if ids.numel() and (int(ids.min()) < 0 or bool((ids.diff() < 0).any())):
                raise ValueError(
                    f"sample {i}: field 'turn_ids' must be >= 0 and non-decreasing along the response "
                    f"(got {ids.tolist()[:16]}...)"
                )
            turn_ids[i, : ids.numel()] = ids
    return turn_rewards, turn_ids


@dataclass(frozen=True)
class MicroBatch:
    """Model inputs for some samples, plus where their response positions are."""

    rows: torch.Tensor  # [b] indices into the rank's samples
    input_ids: torch.Tensor  # [b, L_max]
    attention_mask: torch.Tensor  # [b, L_max]
    logit_positions: torch.Tensor  # [b, R_max] position whose output predicts response token t
    targets: torch.Tensor  # [b, R_max] response token ids (0 on padding)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without a host sync: a pageable host-to-GPU copy first waits for the GPU
    to drain its queue (CUDA's rule for pageable transfers), once per tensor and micro-batch, so the
    host could never run ahead of a small model's kernels; a pinned copy is queued behind them."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def collate(samples: Samples, rows: Sequence[int], device: torch.device) -> MicroBatch:
    """Right-pad the chosen samples' tokens; padding never affects real positions under causal attention."""
    chosen = [samples.tokens[i] for i in rows]
    width = max(t.numel() for t in chosen)
    input_ids = pad_right(chosen, width, torch.int64)
    attention_mask = pad_right([torch.ones(t.numel(), dtype=torch.int64) for t in chosen], width, torch.int64)
    r_max = samples.max_response
    steps = torch.arange(r_max)
    positions = torch.zeros(len(chosen), r_max, dtype=torch.int64)
    targets = torch.zeros(len(chosen), r_max, dtype=torch.int64)
    for j, i in enumerate(rows):
        length = samples.tokens[i].numel()
        r = int(samples.response_lengths[i])
        start = length - r
        # padding columns point at some real position; their outputs are masked out
        pos = (start - 1 + steps).clamp(min=0, max=max(length - 2, 0))
        positions[j] = pos
        targets[j, :r] = samples.tokens[i][start:]
    return MicroBatch(
        rows=torch.as_tensor(list(rows), dtype=torch.int64),
        input_ids=to_device(input_ids, device),
        attention_mask=to_device(attention_mask, device),
        logit_positions=to_device(positions, device),
        targets=to_device(targets, device),
    )


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of at most ``size`` items."""
    items = list(indices)
    return [items[i : i + size] for i in range(0, len(items), size)]


def split_even(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` in ``parts`` consecutive, near-equal, non-empty pieces (fewer if ``n < parts``)."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
