"""Our own forward pass for GPT-2 and Llama, built for continuous batching.

Two entry points, both on the executor thread and under ``inference_mode``:

- :meth:`DecoderModel.prefill` runs whole prompts of new sequences (ragged,
  right-padded, causal), or the part of each after a prefix already cached in
  its slot, and writes their K/V into their cache slots;
- :meth:`DecoderModel.decode` runs ONE token for every running sequence at
  once, each at its own position, attending only to its own slot's first
  ``position + 1`` entries.

Both return float32 logits of the last position only: the vocabulary
projection is the largest matmul of a small model, so it is not spent on
prompt positions nobody samples from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from aserve.config.schema import CheckpointLimits
from aserve.engines.decoder.checkpoint import load_weights, read_spec
from aserve.engines.decoder.kv_cache import KVCache
from aserve.engines.decoder.rope import apply_rope, rope_tables
from aserve.engines.decoder.spec import CheckpointError, LayerWeights, ModelSpec, Weights

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}

# attend(layer, q, k, v) -> attention output; q (B, heads, L, hd), k/v (B, kv_heads, L, hd).
_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype '{dtype}' is not supported (use {', '.join(_DTYPES)})") from None


class DecoderModel:
    """A causal LM's weights plus the forward pass; holds no per-sequence state."""

    def __init__(
        self, spec: ModelSpec, weights: Weights, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self._act = _ACT[spec.activation]
        # RoPE tables cover the longest cache made (new_cache), not every
        # position the model declares: 128K positions would be 128 MiB of
        # tables for a 2048-token cache, and a config may declare millions.
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @classmethod
    def load(
        cls,
        folder: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        limits: CheckpointLimits | None = None,
    ) -> DecoderModel:
        """Load ``config.json`` + ``*.safetensors`` from ``folder``.

        Raises :class:`CheckpointError` for a missing file, an unsupported
        ``model_type``, sizes over ``limits``, or weights that do not match
        the config (found from the files' headers, before any is read).
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: not a folder")
        device = torch.device(device)
        dtype = resolve_dtype(dtype)
        spec = read_spec(folder, limits)
        return cls(spec, load_weights(folder, spec, device, dtype, limits), device, dtype)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A KV cache for ``num_slots`` sequences of up to ``max_len`` tokens."""
        if max_len > self.spec.max_positions:
            raise ValueError(
                f"max_model_len ({max_len}) exceeds the model's context length "
                f"({self.spec.max_positions} positions)"
            )
        s = self.spec
        if s.rope is not None and (self._cos is None or self._cos.shape[0] < max_len):
            self._cos, self._sin = rope_tables(s.rope, s.head_dim, max_len, self.device, self.dtype)
        return KVCache(
            s.num_layers, num_slots, s.num_kv_heads, max_len, s.head_dim, self.device, self.dtype
        )

    # --- the two entry points ---------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        cache: KVCache,
        slot_ids: Sequence[int],
        token_id_lists: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run new sequences' prompts; logits (n, vocab) of each last prompt token.

        ``starts[j]`` (default 0) is how many of sequence ``j``'s first tokens
        already have their K/V in its slot (a cached prefix):
        ``token_id_lists[j]`` are the tokens after them, fed at positions
        ``starts[j]`` on, attending to the slot's first ``starts[j]`` positions
        too.

        Prompts are right-padded to the longest: with a causal mask, real
        tokens never see the padding after them, so each row equals running
        that prompt alone. Without a cached prefix, padding K/V lands in slot
        positions past the prompt, which decode overwrites before it ever
        reads them; with one, only the real tokens' K/V are written.
        """
        slots = list(slot_ids)
        if len(slots) != len(token_id_lists) or not slots:
            raise ValueError("prefill needs one prompt per slot, and at least one")
        offsets = [0] * len(slots) if starts is None else list(starts)
        if len(offsets) != len(slots):
            raise ValueError("prefill needs one start per slot")
        cache.check_slots(slots)
        lengths = [len(t) for t in token_id_lists]
        for n, start in zip(lengths, offsets, strict=True):
            if n == 0:
                raise ValueError("cannot prefill an empty prompt")
            cache.check_length(start + n)
        batch, width = len(slots), max(lengths)
        ids = torch.zeros((batch, width), dtype=torch.long)
        for row, tokens in enumerate(token_id_lists):
            ids[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        ids = ids.to(self.device)
        slot_t = torch.tensor(slots, device=self.device)
        group = self.spec.num_heads // self.spec.num_kv_heads
        scales = self.spec.attn_scales
        if not any(offsets):
            pos = torch.arange(width, device=self.device).expand(batch, width)

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cache.k[i][slot_t, :, :width] = k
                cache.v[i][slot_t, :, :width] = v
                if group > 1:
                    k = k.repeat_interleave(group, dim=1)
                    v = v.repeat_interleave(group, dim=1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scales[i])

        else:
            pos, attend = self._offset_attend(cache, slot_t, offsets, lengths, width)
        hidden = self._blocks(ids, pos, attend)
        last = torch.tensor(lengths, device=self.device) - 1
        return self._logits(hidden[torch.arange(batch, device=self.device), last])

    def _offset_attend(
        self,
        cache: KVCache,
        slot_t: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        width: int,
    ) -> tuple[torch.Tensor, _Attend]:
        """Positions and attention for a prefill after cached prefixes: row
        ``b``'s query ``j`` is at position ``starts[b] + j`` and sees its slot's
        positions up to that one. Only real tokens' K/V are written (a padded
        row's padding could run past ``max_model_len``)."""
        dev = self.device
        start_t = torch.tensor(starts, device=dev)
        pos = start_t[:, None] + torch.arange(width, device=dev)[None, :]
        real = torch.arange(width, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        rows, cols = real.nonzero(as_tuple=True)
        dest_slots, dest_pos = slot_t[rows], pos[rows, cols]
        span = max(s + n for s, n in zip(starts, lengths, strict=True))
        # (B, 1, width, span): key position <= the query's position.
        mask = (torch.arange(span, device=dev)[None, None, :] <= pos[:, :, None])[:, None]
        pos = pos.clamp(max=cache.max_len - 1)  # padding rows' positions, never attended to
        group = self.spec.num_heads // self.spec.num_kv_heads
        scales = self.spec.attn_scales

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = cache.k[i], cache.v[i]
            kc[dest_slots, :, dest_pos] = k[rows, :, cols]
            vc[dest_slots, :, dest_pos] = v[rows, :, cols]
            ks, vs = kc[slot_t, :, :span], vc[slot_t, :, :span]
            if group > 1:
                ks = ks.repeat_interleave(group, dim=1)
                vs = vs.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scales[i])

        return pos, attend

    @torch.inference_mode()
    def decode(
        self,
        cache: KVCache,
        slot_ids: Sequence[int],
        last_tokens: Sequence[int],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """One step for every running sequence; logits (n, vocab).

        ``last_tokens[j]`` is fed at ``positions[j]`` (the number of tokens
        already in slot ``slot_ids[j]``), its K/V written there, and the
        query attends to positions ``0..positions[j]`` of that slot only.
        """
        slots = list(slot_ids)
        batch = len(slots)
        if not (batch == len(last_tokens) == len(positions)) or not slots:
            raise ValueError("decode needs one token and one position per slot, and at least one")
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        pos_t, attend = self._decode_attend(cache, slots, positions)
        hidden = self._blocks(ids, pos_t[:, None], attend)
        return self._logits(hidden[:, 0])

    @torch.inference_mode()
    def mixed(
        self,
        cache: KVCache,
        chunks: Sequence[tuple[int, Sequence[int], int]],
        slot_ids: Sequence[int],
        last_tokens: Sequence[int],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Prompt chunks and decodes in ONE pass of the weights (a chunked
        prefill's step); logits (len(chunks) + n, vocab): each chunk's last
        token, then each decode's.

        ``chunks`` are ``(slot, tokens, start)``: ``tokens`` fed at positions
        ``start`` on, attending to the slot's first ``start`` positions too.
        The decodes are :meth:`decode`'s. Every token runs through the linear
        layers as one row of a single packed sequence (no padding); attention
        is per chunk, over a view of its own slot, and batched for the decodes.
        """
        if not chunks or not slot_ids:
            raise ValueError("a mixed step needs at least one chunk and one decode")
        cache.check_slots([c[0] for c in chunks] + list(slot_ids))
        dev = self.device
        ids_l: list[int] = []
        pos_l: list[int] = []
        spans: list[tuple[int, int, int, int, torch.Tensor]] = []  # (slot, at, n, start, mask)
        for slot, tokens, start in chunks:
            n = len(tokens)
            if n == 0:
                raise ValueError("cannot prefill an empty chunk")
            cache.check_length(start + n)
            # (n, start + n): key position <= the query's position.
            mask = (
                torch.arange(start + n, device=dev)[None, :]
                <= (start + torch.arange(n, device=dev))[:, None]
            )
            spans.append((slot, len(ids_l), n, start, mask))
            ids_l += tokens
            pos_l += range(start, start + n)
        at = len(ids_l)
        _, dattend = self._decode_attend(cache, list(slot_ids), positions)
        ids = torch.tensor([*ids_l, *last_tokens], dtype=torch.long, device=dev)[None, :]
        pos = torch.tensor([*pos_l, *positions], dtype=torch.long, device=dev)[None, :]
        group = self.spec.num_heads // self.spec.num_kv_heads
        scales = self.spec.attn_scales

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = cache.k[i], cache.v[i]
            outs = []
            for slot, a, n, start, mask in spans:
                kc[slot, :, start : start + n] = k[0, :, a : a + n]
                vc[slot, :, start : start + n] = v[0, :, a : a + n]
                ks, vs = kc[slot : slot + 1, :, : start + n], vc[slot : slot + 1, :, : start + n]
                if group > 1:
                    ks = ks.repeat_interleave(group, dim=1)
                    vs = vs.repeat_interleave(group, dim=1)
                outs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, a : a + n], ks, vs, attn_mask=mask, scale=scales[i]
                    )
                )
            # The decodes' (1, heads, d, hd) as decode's (d, heads, 1, hd), and back.
            qd, kd, vd = (x[0, :, at:].transpose(0, 1).unsqueeze(2) for x in (q, k, v))
            outs.append(dattend(i, qd, kd, vd).squeeze(2).transpose(0, 1).unsqueeze(0))
            return torch.cat(outs, dim=2)

        hidden = self._blocks(ids, pos, attend)
        last = [a + n - 1 for _, a, n, _, _ in spans] + list(range(at, ids.shape[1]))
        return self._logits(hidden[0, torch.tensor(last, device=dev)])

    def _decode_attend(
        self, cache: KVCache, slots: list[int], positions: Sequence[int]
    ) -> tuple[torch.Tensor, _Attend]:
        """Positions and attention of one token per slot, fed at ``positions``:
        q, k, v (B, heads or kv_heads, 1, hd); each attends to its own slot's
        positions up to its own."""
        batch = len(slots)
        cache.check_slots(slots)
        for p in positions:
            cache.check_length(p + 1)
        span = max(positions) + 1  # attention reads only this much of each slot
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        first = slots[0]
        contiguous = slots == list(range(first, first + batch))
        mask = torch.arange(span, device=self.device)[None, :] <= pos_t[:, None]
        mask = mask[:, None, None, :]  # (B, 1, 1, span): broadcast over heads and queries
        spec = self.spec
        kv_heads, group, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = cache.k[i], cache.v[i]
            kc[slot_t, :, pos_t] = k[:, :, 0]
            vc[slot_t, :, pos_t] = v[:, :, 0]
            if contiguous:  # a view; no copy of the cache
                ks, vs = kc[first : first + batch, :, :span], vc[first : first + batch, :, :span]
            else:
                ks, vs = kc[slot_t, :, :span], vc[slot_t, :, :span]
            # Grouped-query attention without repeating K/V: with one query
            # token per sequence, the query heads sharing a KV head become
            # that KV head's query "positions".
            qg = q.reshape(batch, kv_heads, group, hd)
            out = F.scaled_dot_product_attention(
                qg, ks, vs, attn_mask=mask, scale=spec.attn_scales[i]
            )
            return out.reshape(batch, spec.num_heads, 1, hd)

        return pos_t, attend

    # --- the transformer ---------------------------------------------------------

    def _blocks(self, ids: torch.Tensor, pos: torch.Tensor, attend: _Attend) -> torch.Tensor:
        spec, w = self.spec, self.weights
        batch, length = ids.shape
        h = F.embedding(ids, w.embed)
        if w.pos_embed is not None:
            h = h + F.embedding(pos, w.pos_embed)
        cos = sin = None
        if spec.rope is not None:
            assert self._cos is not None and self._sin is not None  # made with the cache
            cos, sin = self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)
        heads, kv_heads, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        for i, layer in enumerate(w.layers):
            x = self._norm(h, layer.norm1_w, layer.norm1_b)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.split((spec.q_size, spec.kv_size, spec.kv_size), dim=-1)
            q = q.reshape(batch, length, heads, hd).transpose(1, 2)
            k = k.reshape(batch, length, kv_heads, hd).transpose(1, 2)
            v = v.reshape(batch, length, kv_heads, hd).transpose(1, 2)
            if cos is not None and sin is not None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attend(i, q, k, v).transpose(1, 2).reshape(batch, length, spec.q_size)
            h = h + F.linear(out, layer.o_w, layer.o_b)
            h = h + self._mlp(self._norm(h, layer.norm2_w, layer.norm2_b), layer)
        return h

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        up = F.linear(x, layer.up_w, layer.up_b)
        if self.spec.gated_mlp:
            gate, up = up.chunk(2, dim=-1)
            up = self._act(gate) * up
        else:
            up = self._act(up)
        return F.linear(up, layer.down_w, layer.down_b)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        eps = self.spec.norm_eps
        if self.spec.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)
        # RMSNorm in float32, then back, as the Llama reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        w = self.weights
        x = self._norm(last_hidden, w.final_norm_w, w.final_norm_b)
        return F.linear(x, w.lm_head).float()
