"""Generate with the MoE language model that ``train_moe_lm.py`` trained: a KV cache, a batch
of requests of different prompt lengths, and the MoE layers' inference path.

    python examples/train_moe_lm.py --steps 200 --out runs/lm           # train (or use yours)
    python examples/generate.py --ckpt runs/lm --max-new-bytes 64
    torchrun --nproc-per-node 2 examples/generate.py --ckpt runs/lm --ep 2   # the same bytes

Legend: B requests, S cached positions, D dim, H heads, Dh head dim.

Every step runs each block once on the new positions only: attention reads the cache
(keys and values of every earlier position of the request), the MoE layer takes its
inference path (``torch_moe.nn.MoE`` in eval mode without autograd: the training forward's
values, nothing saved, static shapes). Prompts are left-padded to a common length; a
request's positions (RoPE, the causal mask) start at its first real byte, and padding
positions are masked out, so each request gets the bytes it would get alone (checked by
``--check``: the same bytes as recomputing the whole sequence without a cache, one request
at a time). Decoding is greedy by default (``--temperature 0``).

``--compile`` compiles every MoE layer (``torch.compile``, ``fullgraph=True``, the token
count dynamic: prefill and decode steps share a graph); the bytes are the same.

``--ep N`` (under torchrun): every MoE layer's experts are split over the N ranks with
``ExpertParallel(mode="low_latency", max_tokens_per_rank=...)``: fixed-size buffers, one
all-to-all per direction, no host sync. The requests are split over the ranks (rank r takes
requests r, r+N, ...); all ranks step together. Rank 0 prints every request's bytes, which
equal the ``--ep 1`` run's.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_lm import MoELM, _apply_rope
from train_moe_lm import load_model

DEFAULT_PROMPTS = [
    "Anna saw the",
    "Once upon a time, Ben",
    "How many apples did",
    "The red fox",
    '"Hello," said Clara. "',
]


class KVCache:
    """Keys and values [B, H, S, Dh] of every layer, grown by one chunk per step."""

    def __init__(self, layers: int) -> None:
        self.k: list[Tensor | None] = [None] * layers
        self.v: list[Tensor | None] = [None] * layers

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.v[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self.k[layer], self.v[layer]  # type: ignore[return-value]


@torch.inference_mode()
def step(model: MoELM, idx_BN: Tensor, pos_BN: Tensor, valid_BS: Tensor, cache: KVCache) -> Tensor:
    """Logits [B, N, V] of N new positions per request (positions ``pos_BN``); ``valid_BS``
    marks the cache positions (old and new) that hold real bytes."""
    B, N = idx_BN.shape
    cfg = model.cfg
    x = model.embed(idx_BN)
    if model.pos_embed is not None:
        x = x + model.pos_embed(pos_BN.clamp(min=0))
    S = valid_BS.shape[1]
    # query i (absolute cache slot S - N + i) sees the valid slots up to itself
    causal = torch.ones(N, S, dtype=torch.bool, device=x.device).tril(S - N)
    mask = causal[None, None] & valid_BS[:, None, None, :]
    # a padding position attends to itself only (finite, never read by a real position)
    own = torch.zeros(N, S, dtype=torch.bool, device=x.device)
    own[torch.arange(N), torch.arange(S - N, S)] = True
    mask = mask | own[None, None]
    for layer, block in enumerate(model.blocks):
        h = block.attn_norm(x)
        attn = block.attn
        H = attn.heads
        q, k, v = attn.qkv(h).view(B, N, 3, H, cfg.dim // H).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, N, Dh]
        if attn.rope:
            p = pos_BN.clamp(min=0)
            cos, sin = attn.cos[p][:, None], attn.sin[p][:, None]  # [B, 1, N, Dh/2]
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        k_all, v_all = cache.append(layer, k, v)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        x = x + attn.proj(y.transpose(1, 2).reshape(B, N, cfg.dim))
        x = x + block.moe(block.moe_norm(x))
    x = model.norm(x)
    w = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, w).float()


def pick(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1).cpu()
    return torch.multinomial(probs, 1, generator=gen).view(-1).to(logits.device)


def generate(
    model: MoELM,
    prompts: list[bytes],
    max_new: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[bytes], list[float]]:
    """Continuations of ``prompts`` (batched, KV cache) and the per-step latencies (s)."""
    device = model.embed.weight.device
    B = len(prompts)
    P = max((len(p) for p in prompts), default=0)
    if P + max_new > model.cfg.seq_len:
        raise ValueError(
            f"generate: the longest prompt ({P} bytes) plus --max-new-bytes ({max_new}) "
            f"exceeds the model's seq_len ({model.cfg.seq_len})"
        )
    idx = torch.zeros(B, P, dtype=torch.long, device=device)
    valid = torch.zeros(B, P, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):  # left-padded
        if p:
            idx[b, P - len(p) :] = torch.tensor(list(p), device=device)
            valid[b, P - len(p) :] = True
    pos = valid.long().cumsum(1) - 1  # a request's positions start at its first byte
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(len(model.blocks))
    out: list[list[int]] = [[] for _ in range(B)]
    latencies = []
    t0 = time.perf_counter()
    logits = step(model, idx, pos, valid, cache)[:, -1]  # prefill
    latencies.append(time.perf_counter() - t0)
    next_pos = pos[:, -1:] + 1
    for _ in tqdm(range(max_new), disable=not progress, desc="decode", leave=False):
        nxt = pick(logits, temperature, gen)
        for b in range(B):
            out[b].append(int(nxt[b]))
        valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=device)], dim=1)
        t0 = time.perf_counter()
        logits = step(model, nxt[:, None], next_pos, valid, cache)[:, -1]
        latencies.append(time.perf_counter() - t0)
        next_pos = next_pos + 1
    return [bytes(o) for o in out], latencies


@torch.inference_mode()
def generate_without_cache(model: MoELM, prompt: bytes, max_new: int) -> bytes:
    """Greedy bytes by recomputing the whole sequence each step (the reference)."""
    device = model.embed.weight.device
    idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(max_new):
        nxt = model(idx)[0, -1].argmax()
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return bytes(idx[0, len(prompt) :].tolist())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="train_moe_lm.py's --out directory")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: five")
    p.add_argument("--max-new-bytes", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (torchrun)")
    p.add_argument("--check", action="store_true", help="compare with decoding without cache")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile every MoE layer (torch.compile, fullgraph, dynamic token count)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep != world:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} processes (WORLD_SIZE={world})")
    model, _run = load_model(args.ckpt)
    model.eval()
    prompts = [p.encode() for p in (args.prompt or DEFAULT_PROMPTS)]
    rank = 0
    if args.ep > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from torch_moe.distributed import ExpertParallel

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (args.ep,))
        mine = prompts[rank :: args.ep]
        budget = max(1, max(len(p) for p in prompts)) * math.ceil(len(prompts) / args.ep)
        style = ExpertParallel(mode="low_latency", max_tokens_per_rank=budget, src_data_rank=None)
        for moe in model.moe_layers():
            parallelize_module(moe, mesh, style)
    else:
        mine = prompts
    if args.compile:  # each layer's inference compiled (on CPU its experts' step one op)
        for moe in model.moe_layers():
            moe.compile(fullgraph=True, dynamic=True)
    t0 = time.perf_counter()
    outs, latencies = generate(
        model, mine, args.max_new_bytes, args.temperature, args.seed, not args.no_progress
    )
    total = time.perf_counter() - t0
    if args.ep > 1:  # gather every rank's requests on every rank, in request order
        gathered: list[list[bytes]] = [[] for _ in range(args.ep)]
        dist.all_gather_object(gathered, outs)
        outs = [gathered[i % args.ep][i // args.ep] for i in range(len(prompts))]
    decode = latencies[1:]
    result = {
        "outputs": outs,
        "tokens_per_s": len(mine) * args.max_new_bytes / max(total, 1e-9),
        # the median step: the first ones also pay the kernels' one-time probes and plans
        # (and under --compile, the decode graph's compile)
        "ms_per_token": 1e3 * statistics.median(decode) if decode else 0.0,
        "prefill_ms": 1e3 * latencies[0],
    }
    if args.check and rank == 0:
        if args.temperature > 0:
            raise SystemExit("--check compares greedy decoding: use --temperature 0")
        full = load_model(args.ckpt)[0].eval()
        for p, o in zip(prompts, outs, strict=True):
            ref = generate_without_cache(full, p, args.max_new_bytes)
            if o != ref:
                raise SystemExit(f"--check: {p!r} gave {o!r} with the cache, {ref!r} without")
        result["checked"] = True
    if rank == 0:
        for p, o in zip(prompts, outs, strict=True):
            print(f"{p.decode(errors='replace')!r} -> {o.decode(errors='replace')!r}")
        print(
            f"{len(prompts)} requests, {args.max_new_bytes} bytes each, --ep {args.ep}: "
            f"{result['tokens_per_s']:.0f} tokens/s per rank, {result['ms_per_token']:.2f} ms "
            f"per decode step (median), prefill {result['prefill_ms']:.1f} ms"
            + ("; same bytes as without the cache" if result.get("checked") else "")
        )
    if args.ep > 1:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    # With --ep, the parallelized model (freed with main's frame, but held in reference
    # cycles by its parallel-style hooks) still owns the destroyed process group: collect
    # it while the interpreter is alive, so that gloo's threads are joined now and not
    # during interpreter shutdown (which can abort: upstream_patches/0002-distributed-gloo-exit).
    gc.collect()
