"""Decoding with a preallocated KV cache, one decode step captured per CUDA graph.

The Hugging Face decode loop re-enters Python for every layer of every token, grows its KV cache with
``torch.cat`` (copying the whole cache each step) and builds a new attention mask each step; at batch
256 on an H200 that, not the matrix multiplies, sets the pace. Here the forward pass of a model family
the decoder knows (its :class:`~ppo_weight_sync.families.DecoderSpec`, resolved per layer by
:mod:`ppo_rollout.engine.model_spec`: norms, q/k norms, activation, rotary tables, sliding windows) is
written against the model's own modules (embeddings, RMSNorms, MLPs, projections, ``lm_head``: the
same tensors, so weight updates and memory release need nothing new) with attention on a static cache:

- one cache of ``[batch, kv_heads, capacity, head_dim]`` per layer, allocated once; step ``t`` writes
  column ``prompt_width + t - 1`` for every row (rows are left-padded, so one column index fits all);
- a key-valid mask ``[batch, capacity]`` that the step extends in place;
- attention over the first ``L`` columns only, ``L`` the step's KV bucket (a multiple of
  :data:`KV_BLOCK`): one graph per bucket, so a step reads about as much cache as it uses;
- the step's inputs and outputs live in fixed buffers (:class:`DecodeBuffers`), the step counter and
  positions are device tensors, so one captured graph replays every step of its bucket.
- a sliding-window layer (Gemma 3's local layers) sees the last ``window`` columns of those: its mask
  or ranged-kernel range narrowed once per forward, from the same device tensors.

The sampling noise is drawn outside the graph, in eager mode, with the call's generator and the shape
``torch.multinomial`` uses, so a seed gives the same noise as the plain loop (see
:func:`ppo_rollout.engine.core.pick_with_noise`).

A decode step is several hundred small kernels whose launches, not their work, set its time (about
3.5 ms at 0.82B on an H200, whatever the KV length), so the forward is written in fewer of them
(``fused=True``, the default; ``fused=False`` is the earlier form, kept for comparison):

- the RMSNorms as ``F.rms_norm`` (one fused kernel on CUDA) on float32, then the family's weight
  convention in its order of roundings: cast back, times the weight (``LlamaRMSNorm``,
  ``Qwen2RMSNorm``), or times ``1 + weight`` in float32, then cast (``Gemma3RMSNorm``); a norm of any
  other class is called as it is;
- rotary embeddings as ``x * cos + roll(x, D/2) * sin_signed``, ``sin_signed`` the sine with its first
  half negated (made once per forward): the same products as ``x * cos + rotate_half(x) * sin``, as
  ``-a * b == a * -b`` exactly, without the negation and concatenation per tensor;
- q/k/v and gate/up as one matmul each: the decoder stores each layer's q, k, v weights (and biases)
  as consecutive row blocks of one buffer and makes the model's parameters views into it
  (``decode_fusions.fuse_projections``; gate and up alike), so there is no second copy: a weight
  update that copies into a parameter writes the buffer, a memory release moves the one storage, and
  the weights checksum reads the model's own named tensors. One rotation covers each token's q and k
  heads of the joint output (tables ``[B, T, 1, D]`` broadcast over the heads; with q/k norms, each
  part is normed and rotated apart). A layer whose
  projections are not plain ``nn.Linear`` (LoRA, quantised) or no longer joined (a parameter replaced
  by a tensor of its own) is computed module by module.

On CPU both forms give the same logits (tests/test_static_decode.py: float32 within 1e-6; with
torch 2.15 bit for bit, float32 and bfloat16, as CPU's ``F.rms_norm`` is the same composite of
operations). On CUDA the fused norm kernel sums the squares in its own order, so the logits differ by
rounding: in float32 benchmarks/gpu_generate.py checks that the tokens stay ``generate``'s and the
decode loop's; in bfloat16 that every greedy difference is a near-tie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ppo_rollout.engine import ranged_attention
from ppo_rollout.engine.decode_fusions import (
    GATE_UP,
    QKV,
    FusedLinear,
    RmsNorm,
    RopeTables,
    fuse_projections,
    rotate_rolled,
    signed_sin,
)
from ppo_rollout.engine.model_spec import LayerPlan, unsupported_reason

__all__ = [
    "KV_BLOCK",
    "STOP_CHECK_EVERY",
    "DecodeBuffers",
    "LlamaStaticDecoder",
    "StaticDecoder",
    "batch_bucket",
    "kv_bucket",
    "round_up",
    "stop_check_due",
    "unsupported_reason",
]

KV_BLOCK = 64
"""KV-length granularity of the decode graphs (and of the cache's capacity)."""

STOP_CHECK_EVERY = 16
"""Decode steps between two host reads of "every row finished" (each read is a device sync)."""

STOP_SLOTS = 16
"""Stop-token slots in the captured step (unused slots hold -1, which no token equals)."""


def round_up(n: int, multiple: int) -> int:
    if n < 0 or multiple < 1:
        raise ValueError(f"round_up needs n >= 0 and multiple >= 1, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple


def batch_bucket(rows: int) -> int:
    """The batch size a decode graph is captured for: a power of two up to 8, then a multiple of 16.

    Calls whose batch falls in one bucket share the captured graphs (the extra rows are finished
    from the start and their tokens thrown away).
    """
    if rows < 1:
        raise ValueError(f"a decode batch needs at least one row, got {rows}")
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return round_up(rows, 16)


def kv_bucket(columns: int, capacity: int, block: int = KV_BLOCK) -> int:
    """KV length a step attends over: ``columns`` (the valid cache columns) rounded up to ``block``."""
    if columns < 1 or columns > capacity:
        raise ValueError(f"kv_bucket: columns must be in [1, capacity={capacity}], got {columns}")
    return min(round_up(columns, block), capacity)


def stop_check_due(step: int, every: int = STOP_CHECK_EVERY) -> bool:
    """Whether the host reads the finished flags after decode step ``step`` (0-based, step 0 = the
    token sampled from the prefill). Finished rows keep decoding pad tokens that are cut off, and
    the noise drawn for them does not shift other rows' noise, so checking late changes no output."""
    if every < 1:
        raise ValueError(f"stop checks need every >= 1, got {every}")
    return (step + 1) % every == 0


@dataclass
class DecodeBuffers:
    """Every tensor a captured decode step reads or writes (fixed addresses for the graphs).

    ``col`` is the cache column of the token in ``tok``; ``step`` the output column it samples into.
    With ``per_row`` (continuous batching: every row a request of its own, placed at its own time)
    both are ``[batch]``, one per row, and a row stops advancing once ``step`` reaches its ``limits``.
    """

    keys: list[torch.Tensor]  # per layer [batch, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [batch, capacity] bool: cache columns a row attends to
    tok: torch.Tensor  # [batch] int64: the token fed to the next step
    pos: torch.Tensor  # [batch] int64: its position id
    col: torch.Tensor  # [1] int64
    step: torch.Tensor  # [1] int64
    noise: torch.Tensor  # [batch, vocab] float32: Exp(1) draws for sampling
    finished: torch.Tensor  # [batch] bool
    lengths: torch.Tensor  # [batch] int64
    stop_ids: torch.Tensor  # [STOP_SLOTS] int64, -1 padded
    tokens_out: torch.Tensor  # [batch, max_new] int64
    logps_out: torch.Tensor  # [batch, max_new] float32
    limits: torch.Tensor  # [batch] int64: with per_row, each row's max_new_tokens
    per_row: bool = False

    @property
    def batch(self) -> int:
        return int(self.tok.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.valid.shape[1])

    @property
    def max_new(self) -> int:
        return int(self.tokens_out.shape[1])


Sampler = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(logits [B, V], noise [B, V]) -> (tokens [B] int64, log-probs [B] float32)."""


class StaticDecoder:
    """The forward pass of a ``*ForCausalLM`` of a family the decoder knows (its
    :class:`~ppo_weight_sync.families.DecoderSpec`: Llama, Qwen2, Gemma 3) over a :class:`DecodeBuffers`
    cache."""

    def __init__(self, model: Any, fused: bool = True) -> None:
        self.plan = plan = LayerPlan.of(model)
        spec = plan.spec
        config = model.config
        base = model.model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.rotary = base.rotary_emb
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scaling = plan.scaling
        self.vocab = int(self.embed.weight.shape[0])
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # Decode attention: "ranged" (each row over its own cache columns only, a Triton kernel: see
        # ranged_attention.py; the default where it runs), "matmul" (transformers' eager form over the
        # step's KV bucket with an additive mask) or "sdpa" (PyTorch's fused kernels, same mask: the
        # memory-efficient kernel). Switching it needs the decode graphs dropped, as ``fused`` does.
        self.attention = "ranged" if ranged_attention.available(self.device) else "matmul"
        # Fewer kernels per step (see the module docstring); False: the earlier form, for comparison.
        # Read at every forward: switching it needs the decode graphs dropped (they hold the old form).
        self.fused = fused

        def norms(name: str) -> list[RmsNorm]:
            return [RmsNorm.of(layer.get_submodule(name), spec) for layer in self.layers]

        self._input_norms = norms("input_layernorm")
        # The norm before the MLP; with sandwich norms also one on each sublayer's output.
        self._post_norms = norms(
            "pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm"
        )
        self._attn_out_norms = norms("post_attention_layernorm") if spec.sandwich_norms else None
        self._mlp_out_norms = norms("post_feedforward_layernorm") if spec.sandwich_norms else None
        self._q_norms = norms("self_attn.q_norm") if spec.qk_norm else None
        self._k_norms = norms("self_attn.k_norm") if spec.qk_norm else None
        self._final_norm = RmsNorm.of(self.norm, spec)
        if fused:
            # The model's q/k/v and gate/up weights become views into one buffer per group (no copy
            # kept beside them: weight updates write through, memory release moves one storage).
            fuse_projections(model)
        self._qkv = [FusedLinear.of(layer.self_attn, QKV) for layer in self.layers]
        self._gate_up = [FusedLinear.of(layer.mlp, GATE_UP) for layer in self.layers]

    # -- buffers ------------------------------------------------------------------------------------
    def allocate(self, batch: int, capacity: int, max_new: int, per_row: bool = False) -> DecodeBuffers:
        dev = self.device
        counters = batch if per_row else 1
        shape = (batch, self.kv_heads, capacity, self.head_dim)

        def cache() -> list[torch.Tensor]:
            # zeros, not empty: rows padded into a batch bucket attend to a never-written column, and
            # garbage there could be NaN (0 * NaN is NaN even at zero attention weight).
            return [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]

        return DecodeBuffers(
            keys=cache(),
            values=cache(),
            valid=torch.zeros((batch, capacity), dtype=torch.bool, device=dev),
            tok=torch.zeros(batch, dtype=torch.long, device=dev),
            pos=torch.zeros(batch, dtype=torch.long, device=dev),
            col=torch.zeros(counters, dtype=torch.long, device=dev),
            step=torch.zeros(counters, dtype=torch.long, device=dev),
            noise=torch.ones((batch, self.vocab), dtype=torch.float32, device=dev),
            finished=torch.zeros(batch, dtype=torch.bool, device=dev),
            lengths=torch.zeros(batch, dtype=torch.long, device=dev),
            stop_ids=torch.full((STOP_SLOTS,), -1, dtype=torch.long, device=dev),
            tokens_out=torch.zeros((batch, max_new), dtype=torch.long, device=dev),
            logps_out=torch.zeros((batch, max_new), dtype=torch.float32, device=dev),
            limits=torch.zeros(batch, dtype=torch.long, device=dev),
            per_row=per_row,
        )

    # -- forward ------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, head_dim] as transformers' rotary embedding computes them (``prefix``: the
        layer type's table, ``rotary_emb.<prefix>inv_freq``)."""
        inv_freq = getattr(self.rotary, f"{prefix}inv_freq").to(device=positions.device, dtype=torch.float32)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(self.rotary, f"{prefix}attention_scaling", 1.0))
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _rope_tables(self, positions: torch.Tensor, prefix: str = "") -> RopeTables:
        """The rotary tables of one forward over ``positions`` [B, T] (see :class:`RopeTables`)."""
        cos, sin = self._rope(positions, prefix)
        cos, sin = cos[:, None], sin[:, None]
        if not self.fused:
            return RopeTables(cos, sin, None)
        return RopeTables(cos, sin, signed_sin(sin))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads * D] -> [B, heads, T, D] (a view)."""
        return x.view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def _qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s q/k norms over each head (families with ``qk_norm``), else q and k as they are."""
        if self._q_norms is None or self._k_norms is None:
            return q, k
        return self._q_norms[i](q, self.fused), self._k_norms[i](k, self.fused)

    def _qkv_heads(
        self, i: int, attn: Any, x: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s rotated queries and keys and its values [B, heads or kv_heads, T, D]."""
        fused = self._qkv[i] if rope.sin_signed is not None else None
        qkv = fused(x) if fused is not None else None
        if qkv is None or rope.sin_signed is None:
            q, k = self._qk_norm(i, self._split_heads(attn.q_proj(x)), self._split_heads(attn.k_proj(x)))
            v = self._split_heads(attn.v_proj(x))
            if rope.sin_signed is None:
                return self._rotate(q, rope.cos, rope.sin), self._rotate(k, rope.cos, rope.sin), v
            return rotate_rolled(q, rope.cos, rope.sin_signed), rotate_rolled(k, rope.cos, rope.sin_signed), v
        # One matmul: [B, T, (heads + 2 kv_heads) * D], each token's q heads, k heads, v heads in turn.
        # One rotation covers each token's q and k heads, against tables [B, T, 1, D] that broadcast
        # over them: the same products as rotating q and k apart.
        heads = qkv.view(x.shape[0], x.shape[1], -1, self.head_dim)
        qk = self.heads + self.kv_heads
        cos, sin_signed = rope.cos.transpose(1, 2), rope.sin_signed.transpose(1, 2)
        if self._q_norms is not None:
            # Each of q and k through its own norm first, then rotated apart.
            q, k = self._qk_norm(i, heads[:, :, : self.heads], heads[:, :, self.heads : qk])
            q, k = rotate_rolled(q, cos, sin_signed), rotate_rolled(k, cos, sin_signed)
            return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, qk:].transpose(1, 2)
        rotated = rotate_rolled(heads[:, :, :qk], cos, sin_signed)
        q = rotated[:, :, : self.heads].transpose(1, 2)
        k = rotated[:, :, self.heads :].transpose(1, 2)
        return q, k, heads[:, :, qk:].transpose(1, 2)

    def _mlp(self, i: int, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` (transformers' gated MLP with the family's activation), gate
        and up as one matmul when the fused forward has them joined."""
        fused = self._gate_up[i] if self.fused else None
        gate_up = fused(x) if fused is not None else None
        if fused is None or gate_up is None:
            return mlp(x)
        inner = fused.widths[0]
        return mlp.down_proj(self.plan.activation(gate_up[..., :inner]) * gate_up[..., inner:])

    def _out_norm(self, norms: list[RmsNorm] | None, i: int, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output through layer ``i``'s output norm (sandwich norms), else as it is."""
        return x if norms is None else norms[i](x, self.fused)

    def _windowed(
        self,
        bias: torch.Tensor | None,
        ranges: tuple[torch.Tensor, torch.Tensor] | None,
        kv_len: int,
        col: Any,
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The mask and ranges of the sliding layers: those of full attention less the columns
        ``window`` or more before the query's (transformers' rule: key ``j`` is seen from query ``i``
        when ``i - j < window``, in cache columns, which differ by the same amount as positions)."""
        window = self.plan.window
        if window is None:
            return bias, ranges
        if ranges is not None:
            return bias, (torch.maximum(ranges[0], ranges[1] - window), ranges[1])
        if bias is None:
            return None, None
        columns = torch.arange(kv_len, device=bias.device)
        if col is None:  # a prefill: query t at column t
            queries = torch.arange(bias.shape[2], device=bias.device)[:, None]
            far = columns[None, :] <= queries - window  # [T, kv_len]
        else:  # a decode step: row r's query at column col (one for all rows, or col[r])
            far = (columns[None, :] <= col[:, None] - window)[:, None, None, :]
        return bias.masked_fill(far, float("-inf")), None

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor | None,
        kv_len: int,
        decode: bool,
        ranges: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Attention of ``q`` [B, heads, T, D] over one layer's cache: the ranged kernel, transformers'
        eager form (one decode query) or SDPA under ``bias``."""
        rows = q.shape[0]
        if ranges is not None and decode:
            return ranged_attention.ranged_attention(
                q, keys, values, ranges[0], ranges[1], kv_len, self.scaling
            )
        if bias is None:
            raise ValueError("forward needs an attention mask (bias) unless it is given ranges")
        if self.attention == "matmul" and decode:
            return self._attend_matmul(q, keys[:rows, :, :kv_len], values[:rows, :, :kv_len], bias)
        return F.scaled_dot_product_attention(
            q,
            keys[:rows, :, :kv_len],
            values[:rows, :, :kv_len],
            attn_mask=bias,
            scale=self.scaling,
            enable_gqa=self.kv_heads != self.heads,
        )

    def _write_cache(
        self,
        i: int,
        buffers: DecodeBuffers,
        k: torch.Tensor,
        v: torch.Tensor,
        col: torch.Tensor | None,
        flat_cols: torch.Tensor | None,
    ) -> None:
        """Layer ``i``'s new keys and values into its cache (see :meth:`forward` for the columns)."""
        keys, values = buffers.keys[i], buffers.values[i]
        rows, width = k.shape[0], k.shape[2]
        if col is None:
            keys[:rows, :, :width].copy_(k)
            values[:rows, :, :width].copy_(v)
        elif flat_cols is not None:
            # [B, H, C, D] as [B * H * C, D]: row r, head h, column col[r] is one row of it.
            keys.view(-1, self.head_dim).index_copy_(0, flat_cols, k.reshape(-1, self.head_dim))
            values.view(-1, self.head_dim).index_copy_(0, flat_cols, v.reshape(-1, self.head_dim))
        else:
            keys.index_copy_(2, col, k)
            values.index_copy_(2, col, v)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        buffers: DecodeBuffers,
        bias: torch.Tensor | None,
        kv_len: int,
        col: torch.Tensor | None,
        per_row: bool = False,
        last: torch.Tensor | None = None,
        ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of the last position of ``ids`` [B, T] (``last`` [B] int64: of position
        ``last[r]`` of row ``r``, for right-padded rows of their own lengths).

        ``col`` None: a prefill, whose keys and values go to columns ``[0, T)`` of rows ``[0, B)``;
        otherwise T is 1 and they go to column ``col`` of every row (``per_row``: column ``col[r]`` of
        row ``r``). ``bias`` [B, 1, T, kv_len] is the additive attention mask over the first ``kv_len``
        columns; ``ranges`` (starts, ends) [B], given with ``col`` instead of a mask (``bias`` None): row
        ``r`` attends to columns ``[starts[r], ends[r])`` through the ranged kernel. Sliding-window
        layers narrow either to their window.
        """
        rows, width = ids.shape
        flat_cols = self._flat_columns(buffers, col) if per_row and col is not None else None
        fused = self.fused
        ropes = {prefix: self._rope_tables(positions, prefix) for prefix in sorted(set(self.plan.rope))}
        window_bias, window_ranges = self._windowed(bias, ranges if col is not None else None, kv_len, col)
        hidden = self.embed(ids)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            residual = hidden
            x = self._input_norms[i](hidden, fused)
            q, k, v = self._qkv_heads(i, attn, x, ropes[self.plan.rope[i]])
            self._write_cache(i, buffers, k, v, col, flat_cols)
            sliding = self.plan.windows[i] is not None
            out = self._attend(
                q,
                buffers.keys[i],
                buffers.values[i],
                window_bias if sliding else bias,
                kv_len,
                col is not None,
                window_ranges if sliding else ranges,
            )
            out = attn.o_proj(out.transpose(1, 2).reshape(rows, width, -1))
            hidden = residual + self._out_norm(self._attn_out_norms, i, out)
            residual = hidden
            out = self._mlp(i, layer.mlp, self._post_norms[i](hidden, fused))
            hidden = residual + self._out_norm(self._mlp_out_norms, i, out)
        if last is None:
            hidden = hidden[:, -1:, :]
        else:
            hidden = hidden[torch.arange(rows, device=hidden.device), last][:, None, :]
        return self.lm_head(self._final_norm(hidden, fused))[:, 0, :]

    def _flat_columns(self, buffers: DecodeBuffers, col: torch.Tensor) -> torch.Tensor:
        """Row indices of a flattened cache layer for column ``col[r]`` of every row and KV head."""
        heads = torch.arange(self.kv_heads, device=col.device)
        rows = torch.arange(col.shape[0], device=col.device)
        return (((rows[:, None] * self.kv_heads + heads[None, :]) * buffers.capacity) + col[:, None]).reshape(
            -1
        )

    def _attend_matmul(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """transformers' eager attention (two batched matmuls around a float32 softmax), for one query.

        With grouped-query attention the query heads that share a KV head are stacked as that head's
        queries (``[B, kv_heads, groups, D]``), so no K/V is repeated in memory.
        """
        rows = q.shape[0]
        q = q.reshape(rows, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling + bias
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values).reshape(rows, self.heads, 1, self.head_dim)

    def prefill_bias(self, valid: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, T] additive mask: causal, padding columns off, and the diagonal always on (a
        padding row that sees nothing would give NaN, which would reach its cached keys)."""
        width = valid.shape[1]
        causal = torch.ones((width, width), dtype=torch.bool, device=valid.device).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=valid.device)
        return self._bias(allowed[:, None])

    def _bias(self, allowed: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return zeros.masked_fill(~allowed, float("-inf"))

    def step(self, buffers: DecodeBuffers, kv_len: int, sampler: Sampler, pad_token_id: int) -> None:
        """One decode step in the form ``buffers`` were allocated for (the body of a captured graph)."""
        if buffers.per_row:
            self.slot_step(buffers, kv_len, sampler, pad_token_id)
        else:
            self.decode_step(buffers, kv_len, sampler, pad_token_id)

    def _step_logits(self, b: DecodeBuffers, kv_len: int) -> torch.Tensor:
        """A decode step's logits [B, V], with this step's column already valid: the ranged kernel over
        each row's columns up to it, or the step's KV bucket under the valid mask."""
        if self.attention != "ranged":
            bias = self._bias(b.valid[:, None, None, :kv_len])
            return self.forward(b.tok[:, None], b.pos[:, None], b, bias, kv_len, b.col, per_row=b.per_row)
        # A slot's request starts at its column 0; a static batch's rows are left-padded, each starts
        # at its first valid column.
        starts = torch.zeros_like(b.col) if b.per_row else b.valid[:, :kv_len].to(torch.int32).argmax(dim=1)
        ranges = (starts, (b.col + 1).expand(b.batch).contiguous())  # the kernel reads one end a row
        return self.forward(
            b.tok[:, None], b.pos[:, None], b, None, kv_len, b.col, per_row=b.per_row, ranges=ranges
        )

    def slot_step(self, buffers: DecodeBuffers, kv_len: int, sampler: Sampler, pad_token_id: int) -> None:
        """One token for every unfinished row of per-row buffers, in place.

        Each row writes its own cache column and output column; a finished row (or an empty slot)
        samples a pad token into the column after its last token and advances nothing, so its
        outputs stay exact and its cache columns stay within its request's capacity.
        """
        b = buffers
        # Per-row positions as indices into the flattened buffers: index_fill_ and index_copy_, the
        # operations the batch step's graphs already hold.
        row_index = torch.arange(b.batch, device=b.tok.device)
        b.valid.view(-1).index_fill_(0, row_index * b.capacity + b.col, True)
        logits = self._step_logits(b, kv_len)
        tokens, logp = sampler(logits, b.noise)
        tokens = tokens.masked_fill(b.finished, pad_token_id)
        out_index = row_index * b.max_new + b.step
        b.tokens_out.view(-1).index_copy_(0, out_index, tokens)
        b.logps_out.view(-1).index_copy_(0, out_index, logp)
        live = (~b.finished).long()
        b.step.add_(live)
        b.col.add_(live)
        b.pos.add_(live)
        b.finished.logical_or_(b.step >= b.limits)
        b.tok.copy_(tokens)

    def decode_step(self, buffers: DecodeBuffers, kv_len: int, sampler: Sampler, pad_token_id: int) -> None:
        """One token for every row, entirely in place on ``buffers`` (the body of a captured graph)."""
        b = buffers
        b.valid.index_fill_(1, b.col, True)
        logits = self._step_logits(b, kv_len)
        tokens, logp = sampler(logits, b.noise)
        tokens = tokens.masked_fill(b.finished, pad_token_id)
        b.tokens_out.index_copy_(1, b.step, tokens[:, None])
        b.logps_out.index_copy_(1, b.step, logp[:, None])
        hit = ~b.finished & (tokens[:, None] == b.stop_ids[None, :]).any(dim=-1)
        b.lengths.copy_(torch.where(hit, b.step + 1, b.lengths))
        b.finished.logical_or_(hit)
        b.tok.copy_(tokens)
        b.pos.add_(1)
        b.col.add_(1)
        b.step.add_(1)


LlamaStaticDecoder = StaticDecoder
"""The same class, by the name the engine's modules import."""
