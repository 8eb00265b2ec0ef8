"""A small decoder-only MoE language model and a synthetic byte corpus (no download).

Legend: B batch, S sequence, D dim, H heads, Dh head dim, V vocab (256 bytes).

``MoELM`` is pre-norm: ``x = x + attn(norm(x)); x = x + moe(norm(x))`` in every block,
causal attention through ``F.scaled_dot_product_attention``, RoPE or learned positions,
``torch_moe.nn.MoE`` as the FFN (optionally FP8/MXFP8 experts: ``LMConfig.moe_precision``),
tied or untied embeddings.

``make_corpus(seed, num_bytes)`` writes English-like paragraphs from a seeded template
grammar: a recurring character per paragraph (pronouns agree), transitive and
intransitive verbs in present and past, quoted dialogue, questions, counting and small
arithmetic facts. It is deterministic given the seed, so a run needs no data download
and a loss curve is reproducible.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_moe.nn import PRESETS, MoE

__all__ = ["ByteLoader", "LMConfig", "MoELM", "make_corpus", "moe_kwargs"]

VOCAB = 256

# ----------------------------------------------------------------------------- corpus

_NAMES = [
    ("Anna", "she"), ("Ben", "he"), ("Clara", "she"), ("David", "he"), ("Elena", "she"),
    ("Felix", "he"), ("Grace", "she"), ("Hugo", "he"), ("Iris", "she"), ("Jonas", "he"),
    ("Kira", "she"), ("Leo", "he"), ("Maya", "she"), ("Nico", "he"), ("Olga", "she"),
    ("Paul", "he"), ("Rosa", "she"), ("Sam", "he"), ("Tara", "she"), ("Victor", "he"),
]  # fmt: skip
_NOUNS = [
    ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("horse", "horses"),
    ("fox", "foxes"), ("box", "boxes"), ("book", "books"), ("letter", "letters"),
    ("apple", "apples"), ("cup", "cups"), ("key", "keys"), ("lamp", "lamps"),
    ("boat", "boats"), ("stone", "stones"), ("song", "songs"), ("map", "maps"),
    ("child", "children"), ("teacher", "teachers"), ("farmer", "farmers"),
    ("window", "windows"), ("river", "rivers"), ("tree", "trees"), ("coin", "coins"),
]  # fmt: skip
_ADJS = [
    "small", "old", "red", "quiet", "heavy", "bright", "green", "strange", "happy",
    "tired", "warm", "cold", "wooden", "clever", "broken", "little", "golden", "dark",
]  # fmt: skip
# (base, third person, past)
_VERBS_T = [
    ("find", "finds", "found"), ("see", "sees", "saw"), ("carry", "carries", "carried"),
    ("open", "opens", "opened"), ("paint", "paints", "painted"), ("hide", "hides", "hid"),
    ("watch", "watches", "watched"), ("lose", "loses", "lost"), ("take", "takes", "took"),
    ("clean", "cleans", "cleaned"), ("follow", "follows", "followed"),
    ("give", "gives", "gave"), ("buy", "buys", "bought"), ("read", "reads", "read"),
]  # fmt: skip
_VERBS_I = [
    ("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("sing", "sings", "sang"),
    ("wait", "waits", "waited"), ("laugh", "laughs", "laughed"), ("walk", "walks", "walked"),
    ("rest", "rests", "rested"), ("smile", "smiles", "smiled"), ("swim", "swims", "swam"),
]  # fmt: skip
_ADVS = ["slowly", "quickly", "quietly", "carefully", "happily", "again", "at last", "often"]
_PLACES = [
    "the garden", "the market", "the old house", "the river", "the school", "the forest",
    "the kitchen", "the station", "the hill", "the library", "the harbor", "the village",
]  # fmt: skip
_TIMES = [
    "In the morning", "After lunch", "That evening", "On Monday", "Later", "At night",
    "Before dawn", "One day", "In the winter", "After the rain",
]  # fmt: skip
_PREPS = ["near", "behind", "under", "inside", "next to", "across"]
_NUMS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
]  # fmt: skip
_GREETINGS = ["Hello", "Good morning", "Look", "Listen", "Come here", "Wait"]


def _paragraph(r: random.Random) -> str:
    name, pron = r.choice(_NAMES)
    other, _ = r.choice([n for n in _NAMES if n[0] != name])
    poss = "her" if pron == "she" else "his"

    def np_() -> str:  # a noun phrase
        noun = r.choice(_NOUNS)[0]
        return f"the {r.choice(_ADJS)} {noun}" if r.random() < 0.5 else f"the {noun}"

    def subj() -> str:  # the paragraph's character, by name or pronoun
        return name if r.random() < 0.5 else pron.capitalize()

    out = []
    first = f"{r.choice(_TIMES)}, {name} {r.choice(_VERBS_T)[2]} {np_()} {r.choice(_PREPS)} {r.choice(_PLACES)}."
    out.append(first)
    for _ in range(r.randint(2, 6)):
        kind = r.randrange(9)
        if kind == 0:
            out.append(f"{subj()} {r.choice(_VERBS_I)[2]} {r.choice(_ADVS)}.")
        elif kind == 1:
            v = r.choice(_VERBS_T)
            out.append(f"{subj()} {v[1]} {np_()} every day.")
        elif kind == 2:
            out.append(f'"{r.choice(_GREETINGS)}, {other}," said {name}.')
        elif kind == 3:
            out.append(f"Did {other} {r.choice(_VERBS_T)[0]} {np_()}?")
        elif kind == 4:
            n = r.randint(2, 20)
            out.append(f"{subj()} had {_NUMS[n]} {r.choice(_NOUNS)[1]} in {poss} bag.")
        elif kind == 5:
            a, b = r.randint(0, 10), r.randint(0, 10)
            out.append(f"{name} knew that {_NUMS[a]} plus {_NUMS[b]} is {_NUMS[a + b]}.")
        elif kind == 6:
            out.append(f"If {np_()} is {r.choice(_ADJS)}, {pron} will {r.choice(_VERBS_T)[0]} it.")
        elif kind == 7:
            out.append(f"Where is {np_()}? It is {r.choice(_PREPS)} {r.choice(_PLACES)}.")
        else:
            items = r.sample([n[1] for n in _NOUNS], 3)
            out.append(f"{other} bought {items[0]}, {items[1]} and {items[2]} at the market.")
    return " ".join(out)


def make_corpus(seed: int = 0, num_bytes: int = 400_000) -> bytes:
    """About ``num_bytes`` of paragraphs separated by blank lines, deterministic in ``seed``."""
    r = random.Random(seed)
    parts, size = [], 0
    while size < num_bytes:
        p = _paragraph(r) + "\n\n"
        parts.append(p)
        size += len(p)
    return "".join(parts).encode("ascii")


class ByteLoader:
    """Shuffled, non-overlapping windows of ``seq_len + 1`` bytes, epoch after epoch.

    The order of epoch ``e`` is ``randperm`` under seed ``(seed, e)``, so the position
    ``(epoch, index)`` is the whole state: ``state_dict`` / ``load_state_dict`` resume it.
    """

    def __init__(self, data: bytes, seq_len: int, batch_size: int, seed: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_windows = (len(data) - 1) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(
                f"ByteLoader: the corpus ({len(data)} bytes) holds {self.num_windows} windows "
                f"of seq_len={seq_len}, fewer than batch_size={batch_size}"
            )
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._perm(self.epoch)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(inputs [B, S], targets [B, S]) as int64."""
        if self.index + self.batch_size > self.num_windows:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        starts = self._order[self.index : self.index + self.batch_size] * self.seq_len
        self.index += self.batch_size
        rows = starts[:, None] + torch.arange(self.seq_len + 1)
        chunk = self.data[rows].long()
        return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------- model


@dataclass
class LMConfig:
    """Everything that defines the parameters' shapes and meaning (checked on resume)."""

    dim: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    pos: str = "rope"  # "rope" | "learned"
    tie_embeddings: bool = True
    moe: dict[str, Any] | None = None  # MoE(**moe)
    # MoE(precision=...): "bf16" (the parameter/autocast dtype) or an FP8/MXFP8 recipe name;
    # kept out of ``moe`` because it does not change the parameters' meaning (free on resume)
    moe_precision: str = "bf16"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def moe_kwargs(
    preset: str,
    *,
    dim: int,
    hidden_dim: int,
    experts: int,
    top_k: int,
    expert_bias: bool = False,
    aux_coeff: float = 0.0,
) -> dict[str, Any]:
    """MoE constructor arguments: the routing style of ``preset`` at the given sizes.

    ``preset="none"`` is ``MoE``'s defaults (softmax, no renormalization). A preset's shared
    expert keeps its published size relative to the routed experts' hidden dim; its expert
    groups shrink to fit ``experts`` (at least 2 experts per group, half the groups kept).
    """
    kw: dict[str, Any] = {}
    if preset != "none":
        if preset not in PRESETS:
            raise ValueError(
                f"unknown preset {preset!r}; expected 'none' or one of {sorted(PRESETS)}"
            )
        p = PRESETS[preset]
        kw = {k: v for k, v in p.items() if k not in ("dim", "hidden_dim", "num_experts", "top_k")}
        if kw.get("shared_hidden_dim"):
            kw["shared_hidden_dim"] = max(
                1, round(hidden_dim * p["shared_hidden_dim"] / p["hidden_dim"])
            )
        if kw.get("num_expert_groups"):
            groups = kw["num_expert_groups"]
            while groups > 1 and (experts % groups or experts // groups < 2):
                groups -= 1
            if groups == 1:
                del kw["num_expert_groups"], kw["num_limited_groups"]
            else:
                keep = max(1, groups * p["num_limited_groups"] // p["num_expert_groups"])
                while keep < groups and keep * (experts // groups) < top_k:
                    keep += 1
                kw["num_expert_groups"], kw["num_limited_groups"] = groups, keep
    kw.update(dim=dim, hidden_dim=hidden_dim, num_experts=experts, top_k=top_k)
    kw["expert_bias"] = kw.get("expert_bias", False) or expert_bias
    if aux_coeff > 0:
        kw.update(aux_loss="switch", aux_loss_coeff=aux_coeff)
    return kw


def _rope(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [S, Dh/2]
    return angles.cos(), angles.sin()


def _apply_rope(x_BHSDh: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x_BHSDh.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BHSDh.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int, rope: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rope = rope
        if rope:
            cos, sin = _rope(seq_len, dim // heads)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x_BSD: Tensor) -> Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, Dh]
        if self.rope:
            q, k = (
                _apply_rope(q, self.cos[:S], self.sin[:S]),
                _apply_rope(k, self.cos[:S], self.sin[:S]),
            )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.seq_len, cfg.pos == "rope")
        self.moe_norm = nn.RMSNorm(cfg.dim)
        self.moe = MoE(**(cfg.moe or {}), precision=cfg.moe_precision)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoELM(nn.Module):
    """Byte-level decoder-only transformer with an MoE FFN in every block."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        if cfg.pos not in ("rope", "learned"):
            raise ValueError(f"pos must be 'rope' or 'learned', got {cfg.pos!r}")
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.dim) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for b in self.blocks:  # GPT-2: scale the residual projection by depth
            nn.init.normal_(b.attn.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.blocks]

    def forward(self, idx_BS: Tensor) -> Tensor:
        """Logits [B, S, V] in fp32."""
        x = self.embed(idx_BS)
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[: idx_BS.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w).float()

    def num_params(self) -> tuple[int, int]:
        """(total parameters, parameters active per token)."""
        total = sum(p.numel() for p in self.parameters())
        inactive = 0
        for moe in self.moe_layers():
            per_expert = moe.experts.w13[0].numel() + moe.experts.w2[0].numel()
            inactive += per_expert * (moe.num_experts - moe.top_k)
        return total, total - inactive

    @torch.no_grad()
    def generate(
        self, prompt: bytes, num_bytes: int, temperature: float = 0.8, seed: int = 0
    ) -> bytes:
        """Sample ``num_bytes`` continuation bytes (keeps the last ``seq_len`` as context)."""
        g = torch.Generator().manual_seed(seed)
        device = self.embed.weight.device
        idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
        for _ in range(num_bytes):
            logits = self(idx[:, -self.cfg.seq_len :])[0, -1] / temperature
            probs = torch.softmax(logits, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=g).to(device)
            idx = torch.cat([idx, nxt[None]], dim=1)
        return bytes(idx[0, len(prompt) :].tolist())
