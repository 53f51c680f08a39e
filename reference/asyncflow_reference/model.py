"""A small decoder-only transformer in plain PyTorch (fp32), for the reference engines.

``TransformerLM(config, seed=...)``: token + learned position embeddings, ``n_layers``
pre-norm blocks (LayerNorm -> causal multi-head self-attention -> residual, LayerNorm -> GELU
MLP -> residual), a final LayerNorm and an LM head, untied unless ``config.tie_embeddings``
(then ``lm_head.weight`` *is* ``tok_emb.weight``, as in GPT-2 and many Llama/Qwen2 configs:
``state_dict`` lists the one tensor under both names, ``TIED`` maps the alias to the name
weights travel under). ``model(tokens)`` maps ``[B, T]``
token ids to logits ``[B, T, V]``.

Two incremental paths serve the inference engine, over a slot-based ``KVCache`` (``max_batch``
slots x ``max_seq_len`` positions per layer):

* ``prefill(tokens, lengths, cache, slots)``: run whole (right-padded) sequences from
  position 0, write their keys/values into the given slots, and return the logits at each
  row's last real position.
* ``decode(tokens, positions, cache)``: one new token per slot for slots ``0 .. n-1`` (the
  engine keeps its running sequences in a prefix of the slots), attending to the slot's cached
  positions ``<= positions[i]``.

The q/k/v projection has no bias: a key bias has a structurally zero gradient (softmax
ignores a constant added to every score of a query), so its gradient is pure rounding noise,
which Adam would scale up into full-size updates that differ run to run.

Both use the same weights and the same attention kernel (``scaled_dot_product_attention``) as
the full forward, so in fp32 they agree with it to ~1e-6 (the tests hold them to 1e-5).
Parameter names are ``state_dict`` names, the names the engines exchange weights under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncflow_core.contracts.errors import ConfigError


def _check_int(field: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"ModelConfig.{field} must be an int in [{lo}, {hi}], got {value!r}")


def _check_float(field: str, value: object, lo: float, hi: float) -> None:
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or not lo < number <= hi:
        raise ConfigError(
            f"ModelConfig.{field} must be a finite number in ({lo}, {hi}], got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a ``TransformerLM``. Every field is checked on construction; a bad value raises
    ``ConfigError`` naming the field and its valid range.

    ``d_ff`` ``None`` means ``4 * d_model``. ``init_std`` is the standard deviation of the
    normal initialisation of embeddings and linear weights (output projections of each block
    are scaled down by ``sqrt(2 * n_layers)``); larger values give peakier initial
    distributions, handy for tests. ``tie_embeddings``: the LM head shares the token
    embedding's weight.
    """

    vocab_size: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64
    d_ff: int | None = None
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False

    def build(self, *, seed: int = 0) -> TransformerLM:
        """The ``TransformerLM`` of this shape, initialised from ``seed`` (a ``ModelSpec``:
        trainers that take a model spec build it this way)."""
        return TransformerLM(self, seed=seed)

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 2, 2**31 - 1)
        _check_int("d_model", self.d_model, 1, 65_536)
        _check_int("n_layers", self.n_layers, 1, 1_024)
        _check_int("n_heads", self.n_heads, 1, self.d_model)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"ModelConfig.n_heads must divide d_model={self.d_model}, got "
                f"n_heads={self.n_heads}; pick a divisor of d_model"
            )
        _check_int("max_seq_len", self.max_seq_len, 2, 2**20)
        if self.d_ff is not None:
            _check_int("d_ff", self.d_ff, 1, 2**20)
        _check_float("norm_eps", self.norm_eps, 0.0, 1.0)
        _check_float("init_std", self.init_std, 0.0, 10.0)
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(
                f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}"
            )

    @property
    def ff_dim(self) -> int:
        """The MLP's hidden width: ``d_ff``, or ``4 * d_model`` when ``d_ff`` is None."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class KVCache:
    """Keys and values of ``max_batch`` slots: per layer two ``[max_batch, n_heads,
    max_seq_len, head_dim]`` fp32 tensors. A slot's positions beyond its length hold stale
    values that attention masks out."""

    def __init__(self, config: ModelConfig, max_batch: int) -> None:
        shape = (max_batch, config.n_heads, config.max_seq_len, config.head_dim)
        self.max_batch = max_batch
        self.k: list[Tensor] = [torch.zeros(shape) for _ in range(config.n_layers)]
        self.v: list[Tensor] = [torch.zeros(shape) for _ in range(config.n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def move(self, src: Tensor, dst: Tensor, length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` into slots ``dst``."""
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f = config.d_model, config.ff_dim
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.ln1 = nn.LayerNorm(d, eps=config.norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # see the module docstring
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=config.norm_eps)
        self.fc1 = nn.Linear(d, f)
        self.fc2 = nn.Linear(f, d)

    def _mlp(self, x: Tensor) -> Tensor:
        h: Tensor = self.ln2(x)
        h = self.fc1(h)
        h = F.gelu(h)
        out: Tensor = self.fc2(h)
        return x + out

    def forward(
        self, x: Tensor, cache: tuple[Tensor, Tensor] | None = None, slots: Tensor | None = None
    ) -> Tensor:
        """Full causal attention over ``x`` ``[B, T, D]``; with ``cache``, also write this
        chunk's keys/values into positions ``0 .. T-1`` of ``slots``."""
        b, t, d = x.shape
        h: Tensor = self.ln1(x)
        qkv: Tensor = self.qkv(h)
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            assert slots is not None
            cache[0][slots, :, :t] = k
            cache[1][slots, :, :t] = v
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn: Tensor = self.proj(a.transpose(1, 2).reshape(b, t, d))
        return self._mlp(x + attn)

    def step(
        self, x: Tensor, positions: Tensor, mask: Tensor, cache: tuple[Tensor, Tensor]
    ) -> Tensor:
        """One token per slot: ``x`` ``[n, D]`` at ``positions`` ``[n]`` for slots
        ``0 .. n-1``; writes its key/value there and attends where ``mask`` ``[n, 1, 1,
        span]`` is True (positions ``<= positions``)."""
        n, d = x.shape
        h: Tensor = self.ln1(x)
        qkv: Tensor = self.qkv(h)
        q, k, v = qkv.view(n, 3, self.n_heads, self.head_dim).unbind(1)  # [n, H, hd] each
        rows = torch.arange(n)
        kc, vc = cache
        kc[rows, :, positions] = k
        vc[rows, :, positions] = v
        span = mask.shape[-1]
        a = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc[:n, :, :span], vc[:n, :, :span], attn_mask=mask
        )
        attn: Tensor = self.proj(a.reshape(n, d))
        return self._mlp(x + attn)


TIED = {"lm_head.weight": "tok_emb.weight"}
"""With ``tie_embeddings``: the alias in ``state_dict`` -> the name the tied tensor is
exported, checkpointed and loaded under (the embedding's, as vLLM and SGLang load a tied
Qwen2/Llama under ``model.embed_tokens.weight``)."""


class TransformerLM(nn.Module):
    """The decoder-only transformer of ``config``, initialised deterministically from ``seed``
    (a private ``torch.Generator``: the global RNG is neither used nor advanced)."""

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"TransformerLM takes a ModelConfig, got {type(config).__name__}")
        self.config = config
        with torch.random.fork_rng(devices=[]):  # torch's default inits draw from it
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @property
    def tied(self) -> dict[str, str]:
        """The ``state_dict`` aliases of tied tensors -> their canonical names (``TIED`` when
        ``config.tie_embeddings``, else empty)."""
        return dict(TIED) if self.config.tie_embeddings else {}

    def unique_state(self) -> dict[str, Tensor]:
        """``state_dict`` without tied aliases: every tensor once, under its canonical name
        (what export and checkpoints carry; safetensors refuses tensors that share memory)."""
        tied = self.tied
        return {n: t for n, t in self.state_dict().items() if n not in tied}

    def reset_parameters(self, seed: int) -> None:
        """Normal(0, init_std) embeddings and linear weights (block output projections divided
        by sqrt(2 n_layers)), zero biases, unit LayerNorm gains: a function of ``seed`` only."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    scale = std
                    if name.endswith((".proj.weight", ".fc2.weight")):
                        scale = std / math.sqrt(2 * self.config.n_layers)
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)

    def _blocks(self) -> list[Block]:
        return [b for b in self.blocks if isinstance(b, Block)]

    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x: Tensor = self.tok_emb(tokens)
        p: Tensor = self.pos_emb(positions)
        return x + p

    def hidden(self, tokens: Tensor) -> Tensor:
        """Final-normed hidden states ``[B, T, D]`` of ``tokens`` ``[B, T]``."""
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence of {t} tokens > max_seq_len={self.config.max_seq_len}")
        x = self._embed(tokens, torch.arange(t))
        for block in self._blocks():
            x = block(x)
        out: Tensor = self.ln_f(x)
        return out

    def head(self, hidden: Tensor) -> Tensor:
        """Logits from final-normed hidden states."""
        out: Tensor = self.lm_head(hidden)
        return out

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` (causal: position ``t`` sees
        ``0 .. t``; right padding therefore never affects real positions)."""
        return self.head(self.hidden(tokens))

    def prefill(self, tokens: Tensor, lengths: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Run right-padded ``tokens`` ``[k, T]`` (row ``i`` has ``lengths[i]`` real tokens)
        from position 0, store keys/values in cache ``slots`` ``[k]``, and return the logits
        ``[k, V]`` at each row's last real position."""
        k, t = tokens.shape
        x = self._embed(tokens, torch.arange(t))
        for layer, block in enumerate(self._blocks()):
            x = block(x, (cache.k[layer], cache.v[layer]), slots)
        last = x[torch.arange(k), lengths - 1]
        normed: Tensor = self.ln_f(last)
        return self.head(normed)

    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """One token per slot for slots ``0 .. n-1`` (``tokens``, ``positions``: ``[n]``);
        returns the next-token logits ``[n, V]``."""
        x = self._embed(tokens, positions)
        span = int(positions.max()) + 1
        mask = (torch.arange(span).unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
        for layer, block in enumerate(self._blocks()):
            x = block.step(x, positions, mask, (cache.k[layer], cache.v[layer]))
        normed: Tensor = self.ln_f(x)
        return self.head(normed)


__all__ = ["TIED", "Block", "KVCache", "ModelConfig", "TransformerLM"]
