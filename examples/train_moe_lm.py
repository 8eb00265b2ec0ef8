"""Train a small byte-level MoE language model end to end with ``torch_moe.nn.MoE``.

    python examples/train_moe_lm.py                      # ~2 min on 2 CPU cores
    python examples/train_moe_lm.py --balance aux        # Switch aux loss
    python examples/train_moe_lm.py --preset deepseek-v3 --experts 16 --top-k 4
    python examples/train_moe_lm.py --steps 600 --resume # continue the last run to step 600
    torchrun --nproc-per-node 2 examples/train_moe_lm.py --ep 2   # expert + data parallel

The model and corpus live in ``moe_lm.py`` next to this file: a pre-norm decoder with
the MoE layer as the FFN of every block, trained on a synthetic English-like corpus
generated from a seeded grammar (no download). ``--out`` receives ``metrics.jsonl``
(one line per step), ``train.png`` (loss and per-expert load over steps) and
``checkpoint/`` (torch.distributed.checkpoint, single process, no process group).

Load balancing (``--balance``): ``none``; ``aux``: the Switch loss ``E * sum_e f_e P_e``
through ``MoE(aux_loss="switch")``, its gradient injected by the layer; ``bias``:
aux-loss-free balancing (DeepSeek-V3), ``update_expert_bias(rate)`` after every
optimizer step. The logged imbalance is max/mean tokens per expert, averaged over layers.

Expert parallelism (``--ep N`` under ``torchrun --nproc-per-node N``, gloo on CPU, NCCL on
CUDA): every MoE layer is parallelized with ``torch_moe.distributed.ExpertParallel`` over
all N ranks, which are also the data-parallel ranks. ``--batch-size`` is the global batch:
every rank draws the same global batch and trains on its own ``batch_size / N`` rows, the
loss of each rank is divided by N, the replicated (dense) gradients are summed over the
ranks and the expert gradients are already complete, so a run gives the loss curve of the
``--ep 1`` run with the same seed (up to fp32 rounding). Gradient clipping uses the norm
over all ranks' expert shards. Rank 0 prints and writes the metrics and the plot; the
DCP checkpoint holds the expert weights as DTensor shards and loads at any ``--ep``.
``--balance aux`` uses each rank's own aux loss (as data parallelism does), so only
``none`` and ``bias`` reproduce the ``--ep 1`` curve exactly.

NB: checkpoints are replaced, not overwritten. A save writes ``checkpoint.tmp/``, then
renames ``checkpoint/`` to ``checkpoint.prev/``, ``checkpoint.tmp/`` to ``checkpoint/``
and deletes ``checkpoint.prev/``. A failed save leaves ``checkpoint/`` untouched; a crash
between the two renames leaves ``checkpoint.prev/``, which ``--resume`` then uses.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_lm import ByteLoader, LMConfig, MoELM, make_corpus, moe_kwargs

from torch_moe.distributed import ExpertParallel
from torch_moe.nn import PRESETS
from torch_moe.quantization import RECIPES

# --precision: name -> autocast dtype (None: plain fp32). The one place to add recipes.
# A low-precision recipe keeps fp32 master weights under bf16 autocast (as "bf16") and runs
# the MoE experts' GEMMs per the recipe: MoE(precision=name), a CPU emulation on CPU.
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    **{name: torch.bfloat16 for name in RECIPES},
}
BALANCE = ("none", "aux", "bias")
# run-config fields that must match on --resume (model shape/meaning and the data order);
# the value is the flag that sets it, for the error message
RESUME_MUST_MATCH = {
    "dim": "--dim",
    "layers": "--layers",
    "heads": "--heads",
    "seq_len": "--seq-len",
    "pos": "--pos",
    "tie_embeddings": "--tie-embeddings",
    "seed": "--seed",
    "data_seed": "--data-seed",
    "corpus_bytes": "--corpus-bytes",
}
# MoE arguments that only weigh the balancing losses: free to change on --resume
LOSS_FIELDS = {"aux_loss", "aux_loss_coeff", "z_loss_coeff"}
MOE_FLAGS = {
    "hidden_dim": "--hidden-dim",
    "num_experts": "--experts",
    "top_k": "--top-k",
    "expert_bias": "--balance",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small byte-level MoE LM with torch_moe.nn.MoE.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--dim", type=int, default=128, help="model dim D")
    m.add_argument("--layers", type=int, default=4, help="transformer blocks")
    m.add_argument("--heads", type=int, default=4, help="attention heads")
    m.add_argument("--hidden-dim", type=int, default=128, help="expert hidden dim F")
    m.add_argument("--experts", type=int, default=8, help="routed experts E per layer")
    m.add_argument("--top-k", type=int, default=2, help="experts per token K")
    m.add_argument(
        "--preset",
        default="none",
        choices=["none", *PRESETS],
        help="routing style of a published MoE; the size flags above set the sizes",
    )
    m.add_argument("--pos", default="rope", choices=["rope", "learned"], help="positions")
    m.add_argument(
        "--tie-embeddings", action=argparse.BooleanOptionalAction, default=True, help="LM head"
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=400, help="total optimizer steps")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    t.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    t.add_argument("--lr", type=float, default=3e-3, help="peak LR (linear warmup, cosine to 10%%)")
    t.add_argument("--warmup", type=int, default=30, help="warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    t.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (0: off)")
    t.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    t.add_argument(
        "--precision",
        default="fp32",
        choices=list(PRECISIONS),
        help="fp32, bf16 autocast, or bf16 autocast with FP8/MXFP8 MoE experts (a recipe)",
    )
    t.add_argument("--balance", default="bias", choices=BALANCE, help="load balancing")
    t.add_argument("--aux-coeff", type=float, default=1e-2, help="--balance aux coefficient")
    t.add_argument("--bias-rate", type=float, default=1e-3, help="--balance bias update rate")
    t.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree (= torchrun processes)"
    )
    t.add_argument(
        "--compile",
        default="none",
        choices=["none", "inductor", "aot_eager"],
        help="torch.compile every MoE layer (fullgraph) with this backend",
    )
    t.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, ..."
    )
    t.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    d = p.add_argument_group("data and output")
    d.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic corpus")
    d.add_argument("--corpus-bytes", type=int, default=400_000, help="synthetic corpus size")
    d.add_argument("--out", default="runs/train_moe_lm", help="metrics, plot, checkpoint")
    d.add_argument("--ckpt-every", type=int, default=100, help="also saved at the end; 0: end only")
    d.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    d.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="stop after this many steps of this invocation (the schedule still ends at --steps)",
    )
    d.add_argument("--eval-batches", type=int, default=8, help="held-out batches at the end")
    d.add_argument("--sample-bytes", type=int, default=160, help="bytes to sample at the end")
    d.add_argument("--no-progress", action="store_true", help="no tqdm bar (it goes to stderr)")
    d.add_argument("--no-plot", action="store_true", help="no train.png (nor matplotlib import)")
    args = p.parse_args(argv)
    positive = ("dim", "layers", "heads", "hidden_dim", "experts", "top_k", "steps")
    for name in (*positive, "batch_size", "grad_accum", "seq_len", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep != world:
        p.error(
            f"--ep {args.ep} must equal the number of processes (WORLD_SIZE={world}): "
            f"launch with torchrun --nproc-per-node {args.ep}"
        )
    for name, value in (("--batch-size", args.batch_size), ("--experts", args.experts)):
        if value % args.ep:
            p.error(f"{name} ({value}) must be divisible by --ep ({args.ep})")
    return args


def model_config(args: argparse.Namespace) -> LMConfig:
    moe = moe_kwargs(
        args.preset,
        dim=args.dim,
        hidden_dim=args.hidden_dim,
        experts=args.experts,
        top_k=args.top_k,
        expert_bias=args.balance == "bias",
        aux_coeff=args.aux_coeff if args.balance == "aux" else 0.0,
    )
    return LMConfig(
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
        pos=args.pos,
        tie_embeddings=args.tie_embeddings,
        moe=moe,
        moe_precision=args.precision if args.precision in RECIPES else "bf16",
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine from ``--lr`` to ``--lr / 10``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


# ----------------------------------------------------------------------------- --ep N


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def init_expert_parallel(model: MoELM, args: argparse.Namespace, device: torch.device) -> None:
    """Every MoE layer's experts sharded over all ranks (``ExpertParallel``)."""
    mesh = init_device_mesh(device.type, (args.ep,), mesh_dim_names=("ep",))
    for moe in model.moe_layers():
        parallelize_module(moe, mesh, ExpertParallel())


def local_rows(args: argparse.Namespace) -> slice:
    """This rank's rows of the global batch."""
    b = args.batch_size // args.ep
    r = dist.get_rank() if args.ep > 1 else 0
    return slice(r * b, (r + 1) * b)


def sync_dense_grads(model: nn.Module) -> None:
    """Sum the replicated parameters' gradients over the ranks (one flat all-reduce); the
    expert (DTensor) gradients already hold every rank's contribution."""
    grads = [
        p.grad for p in model.parameters() if p.grad is not None and not isinstance(p, DTensor)
    ]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """``clip_grad_norm_`` whose norm also covers the expert shards on the other ranks."""
    sharded = [p.grad for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    dense = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    local = [g.to_local() for g in sharded]
    sq_sharded = torch.nn.utils.get_total_norm(local).square()
    dist.all_reduce(sq_sharded)
    total = (torch.nn.utils.get_total_norm(dense).square() + sq_sharded).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(dense + local, coef)
    return total


# ----------------------------------------------------------------------------- checkpoints


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    # DCP warns on every call that it assumes one process when no process group exists
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    out: Path, model: MoELM, opt: torch.optim.Optimizer, train: dict[str, Any], run: dict
) -> Path:
    """Atomically replace ``out/checkpoint`` (see the NB in the module docstring)."""
    final, tmp, prev = out / "checkpoint", out / "checkpoint.tmp", out / "checkpoint.prev"
    rank0 = is_rank0()  # --ep N: every rank writes its shards, rank 0 the rest
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    error: BaseException | None = None
    try:
        msd, osd = get_state_dict(model, opt)
        with _single_process_dcp():
            dcp.save(
                {"model": msd, "optim": osd, "train": train},
                checkpoint_id=tmp,
                no_dist=not dist.is_initialized(),
            )
        if rank0:
            with open(tmp / "config.json", "w") as f:
                json.dump(run, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
    except BaseException as e:
        error = e
    # rank 0's own writes can fail alone: every rank learns whether any failed before the
    # checkpoint replaces the last one (a rank that returned while rank 0 raised went on
    # to the next step's collectives against rank 0's handler's)
    failed = [None if error is None else repr(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, None if error is None else repr(error))
    if error is not None or any(failed):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        others = "; ".join(f"rank {r}: {f}" for r, f in enumerate(failed) if f)
        raise RuntimeError(f"save_checkpoint: the save failed on another rank ({others})")
    if rank0:
        if final.exists():
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(final, prev)
        os.rename(tmp, final)
        _fsync_dir(out)
        shutil.rmtree(prev, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def find_checkpoint(out: Path) -> Path:
    for name in ("checkpoint", "checkpoint.prev"):
        if (out / name).is_dir():
            return out / name
    raise FileNotFoundError(
        f"--resume: no checkpoint at {out / 'checkpoint'}; run without --resume to start "
        "a new run, or pass the --out of the run to continue"
    )


def read_run_config(ckpt: Path) -> dict[str, Any]:
    try:
        with open(ckpt / "config.json") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"checkpoint {ckpt} is corrupted or incomplete: cannot read config.json ({e})"
        ) from e


def check_same_config(ckpt: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise naming the first field that differs between the checkpoint and this run."""
    pairs = [(k, flag, saved.get(k), current[k]) for k, flag in RESUME_MUST_MATCH.items()]
    saved_moe, moe = saved.get("moe") or {}, current["moe"]
    for k in sorted((set(saved_moe) | set(moe)) - LOSS_FIELDS):
        pairs.append((f"moe.{k}", MOE_FLAGS.get(k, "--preset"), saved_moe.get(k), moe.get(k)))
    for field, flag, old, new in pairs:
        if old != new:
            raise ValueError(
                f"--resume: checkpoint {ckpt} has {field}={old!r} but this run has "
                f"{field}={new!r} (set by {flag}); pass the checkpoint's value or use a new --out"
            )


def load_checkpoint(
    ckpt: Path, model: MoELM, opt: torch.optim.Optimizer, train: dict[str, Any]
) -> dict[str, Any]:
    """Load model, optimizer and ``train`` (filled in place) from ``ckpt``."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "train": train}
    try:
        # read the metadata first: dcp.load would log tracebacks while falling back to
        # per-rank metadata files that a single-process checkpoint does not have
        dcp.FileSystemReader(ckpt).read_metadata()
        with _single_process_dcp():
            dcp.load(state, checkpoint_id=ckpt, no_dist=not dist.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        raise RuntimeError(
            f"checkpoint {ckpt} is corrupted or incomplete: {type(e).__name__}: {last}"
        ) from e
    return state["train"]


def check_model_matches(ckpt: Path, msd: dict[str, Any]) -> None:
    """Raise naming the first tensor whose saved shape differs from the model that the
    checkpoint's config.json builds (or that one of them lacks), before loading anything."""
    try:
        saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    except Exception as e:
        raise RuntimeError(f"checkpoint {ckpt} is corrupted or incomplete: {e}") from e
    for name, t in msd.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise RuntimeError(
                f"checkpoint {ckpt} has no tensor model.{name}, which its config builds"
            )
        size = getattr(meta, "size", None)
        if size is not None and tuple(size) != tuple(t.shape):
            raise RuntimeError(
                f"checkpoint {ckpt} does not match its config.json: model.{name} is saved as "
                f"{list(size)}, the config builds {list(t.shape)}"
            )


def load_model(out: str | Path) -> tuple[MoELM, dict[str, Any]]:
    """The model saved in ``out`` (its ``--out``) and the run config, e.g. for sampling."""
    ckpt = find_checkpoint(Path(out))
    run = read_run_config(ckpt)
    model = MoELM(LMConfig(**{k: run[k] for k in LMConfig.__dataclass_fields__ if k in run}))
    msd = model.state_dict()
    check_model_matches(ckpt, msd)
    with _single_process_dcp():
        dcp.load({"model": msd}, checkpoint_id=ckpt, no_dist=True)
    model.load_state_dict(msd)
    return model, run


def _rng_state() -> bytes:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return pickle.dumps({"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()})


def _set_rng_state(blob: bytes) -> None:
    s = pickle.loads(blob)
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    random.setstate(s["python"])


# ----------------------------------------------------------------------------- metrics


def write_plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    loss = torch.tensor([r["loss"] for r in records])
    # load fraction per expert, mean over layers: [steps, E]
    load = torch.tensor([r["tokens_per_expert"] for r in records], dtype=torch.float64)
    frac = (load / load.sum(-1, keepdim=True)).mean(1)
    fig, (ax0, ax1, ax2) = plt.subplots(
        3, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1, 2]}
    )
    ax0.plot(steps, loss, lw=0.6, alpha=0.4, label="loss")
    w = min(20, len(loss))
    if w > 1:
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], w, 1)[0, 0]
        ax0.plot(steps[w - 1 :], smooth, lw=1.5, label=f"mean of {w}")
    ax0.set_ylabel("train loss (nats/byte)")
    ax0.legend()
    ax0.set_title(title, fontsize=9)
    ax1.plot(steps, [r["imbalance"] for r in records], lw=0.8)
    ax1.set_ylabel("max/mean load")
    im = ax2.imshow(
        frac.T.numpy(),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, frac.shape[1] - 0.5, -0.5),
    )
    ax2.set_ylabel("expert")
    ax2.set_xlabel("step")
    fig.colorbar(
        im, ax=ax2, orientation="horizontal", pad=0.25, label="load fraction (mean over layers)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_metrics(path: Path, upto: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["step"] <= upto]


# ----------------------------------------------------------------------------- main


def train_step(model, opt, loader, lr: float, args, autocast, device) -> float:
    """One optimizer step over ``--grad-accum`` micro-batches; returns the mean LM loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=device)
    rows = local_rows(args)  # --ep N: this rank's share of the global batch
    for _ in range(args.grad_accum):
        x, y = (t[rows].to(device) for t in loader.next_batch())
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        # the aux loss rides along (MoE.aux_loss_scale); / ep: the mean over the ranks
        (loss / (args.grad_accum * args.ep)).backward()
        loss_sum += loss.detach()
    if args.ep > 1:
        sync_dense_grads(model)
        dist.all_reduce(loss_sum)
        loss_sum /= args.ep
    if args.clip > 0:
        clip_grad_norm(list(model.parameters()), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (loss_sum / args.grad_accum).item()


def balance_step(moes: list, args) -> list[dict[str, Any]]:
    """Each layer's load over the step (``load_stats``); then the bias update or a reset."""
    stats = []
    for moe in moes:  # --ep N: log the load over all ranks (the counts are per rank)
        local = moe.tokens_per_expert.clone()
        if dist.is_initialized():
            dist.all_reduce(moe.tokens_per_expert)
        stats.append(moe.load_stats())
        moe.tokens_per_expert.copy_(local)
    for moe in moes:
        if args.balance == "bias":
            # the load summed over the ranks that route tokens through this layer (all of
            # them here: --ep N is also the data-parallel degree)
            group = dist.group.WORLD if dist.is_initialized() else None
            moe.update_expert_bias(args.bias_rate, group=group)  # also resets the counts
        else:
            moe.reset_load_stats()
    return stats


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.ep > 1:  # under torchrun: rank, world size and rendezvous from the environment
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    own_group = args.ep > 1 and not dist.is_initialized()  # a caller's group stays the caller's
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank0 = is_rank0()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    cfg = model_config(args)
    run = {**vars(args), **cfg.to_dict(), "torch": torch.__version__}

    ckpt = None
    if args.resume:
        ckpt = find_checkpoint(out)
        check_same_config(ckpt, read_run_config(ckpt), run)
    elif (out / "checkpoint").exists() or (out / "checkpoint.prev").exists():
        raise FileExistsError(
            f"{out / 'checkpoint'} exists; pass --resume to continue that run, or a new --out"
        )

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    corpus = make_corpus(args.data_seed, args.corpus_bytes)
    split = len(corpus) * 95 // 100
    loader = ByteLoader(corpus[:split], args.seq_len, args.batch_size, args.seed)
    model = MoELM(cfg).to(device)
    total, active = model.num_params()
    if args.ep > 1:
        init_expert_parallel(model, args, device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    moes = model.moe_layers()
    for moe in moes:
        moe.aux_loss_scale = 1.0 / (args.grad_accum * args.ep)
        if args.compile != "none":  # in place: the module tree and state dict stay as they are
            moe.compile(fullgraph=True, backend=args.compile)

    step = 0
    metrics_path = out / "metrics.jsonl"
    if ckpt is not None:
        train = load_checkpoint(
            ckpt, model, opt, {"step": 0, "loader": loader.state_dict(), "rng": b""}
        )
        step = int(train["step"])
        loader.load_state_dict(train["loader"])
        _set_rng_state(train["rng"])
    records = _read_metrics(metrics_path, step) if ckpt is not None else []
    out.mkdir(parents=True, exist_ok=True)
    if rank0:  # --ep N: rank 0 prints and writes the metrics and the plot
        with open(metrics_path, "w") as f:  # drop lines logged after the checkpoint
            f.writelines(json.dumps(r) + "\n" for r in records)
    log = print if rank0 else (lambda *a, **k: None)
    log(
        f"MoE LM: {total / 1e6:.2f}M params ({active / 1e6:.2f}M active/token), "
        f"{cfg.layers} layers x MoE({', '.join(f'{k}={v}' for k, v in cfg.moe.items())}); "
        f"corpus {len(corpus) / 1e3:.0f} KB; {args.precision} on {device}"
        + (f"; resumed at step {step} from {ckpt}" if ckpt else "")
    )
    amp_dtype = PRECISIONS[args.precision]
    autocast = (
        (lambda: torch.autocast(device.type, dtype=amp_dtype))
        if amp_dtype is not None
        else contextlib.nullcontext
    )
    last_step = args.steps if not args.stop_after else min(args.steps, step + args.stop_after)
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    bar = tqdm(
        total=args.steps,
        initial=step,
        disable=args.no_progress or not rank0,
        dynamic_ncols=True,
        leave=False,
    )
    t_start, steps_run = time.perf_counter(), 0
    model.train()
    with open(metrics_path if rank0 else os.devnull, "a") as mf:
        while step < last_step:
            t0 = time.perf_counter()
            lr = lr_at(step, args)
            loss = train_step(model, opt, loader, lr, args, autocast, device)
            stats = balance_step(moes, args)
            step += 1
            steps_run += 1
            dt = time.perf_counter() - t0
            rec = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "tokens_per_s": tokens_per_step / dt,
                "imbalance": sum(s["imbalance"] for s in stats) / len(stats),
                "tokens_per_expert": [s["tokens_per_expert"] for s in stats],
            }
            if args.balance == "aux":
                rec["aux_loss"] = sum(m.last_losses["aux_loss"].item() for m in moes) / len(moes)
            records.append(rec)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            bar.update(1)
            bar.set_postfix(
                loss=f"{rec['loss']:.3f}",
                tok_s=f"{rec['tokens_per_s']:.0f}",
                imb=f"{rec['imbalance']:.2f}",
            )
            if args.ckpt_every and step % args.ckpt_every == 0 and step < last_step:
                train = {"step": step, "loader": loader.state_dict(), "rng": _rng_state()}
                save_checkpoint(out, model, opt, train, {**run, "step": step})
    bar.close()
    train_s = time.perf_counter() - t_start
    if steps_run:
        train = {"step": step, "loader": loader.state_dict(), "rng": _rng_state()}
        save_checkpoint(out, model, opt, train, {**run, "step": step})

    val_loss = evaluate(model, corpus[split:], args, autocast, device)
    n = min(10, len(records))
    result = {
        "step": step,
        "loss": records[-1]["loss"] if records else float("nan"),
        "first_loss": sum(r["loss"] for r in records[:n]) / max(n, 1),
        "last_loss": sum(r["loss"] for r in records[-n:]) / max(n, 1),
        "val_loss": val_loss,
        "imbalance": records[-1]["imbalance"] if records else float("nan"),
        "last_imbalance": sum(r["imbalance"] for r in records[-n:]) / max(n, 1),
        "tokens_per_s": tokens_per_step * steps_run / train_s if steps_run else float("nan"),
        "train_s": train_s,
        "out": str(out),
    }
    if records and rank0 and not args.no_plot:
        write_plot(
            records,
            out / "train.png",
            f"{cfg.layers}x MoE E={args.experts} K={args.top_k} preset={args.preset} "
            f"balance={args.balance} {args.precision}, {tokens_per_step} tokens/step",
        )
    log(
        f"step {step}: loss {result['first_loss']:.3f} -> {result['last_loss']:.3f} "
        f"(mean of first/last {n} steps), val loss {val_loss:.3f}, "
        f"{result['tokens_per_s']:.0f} tokens/s, imbalance {result['last_imbalance']:.2f} "
        f"(max/mean load, last {n} steps), train {train_s:.0f} s"
    )
    if args.sample_bytes > 0:
        model.eval()
        text = model.generate(b"One day, ", args.sample_bytes, seed=args.seed)
        log("sample: One day, " + text.decode("ascii", errors="replace").replace("\n", " "))
    plot = "" if args.no_plot else f"{out / 'train.png'}, "
    log(f"wrote {metrics_path}, {plot}{out / 'checkpoint'}")
    if own_group:
        dist.destroy_process_group()
    return result


@torch.no_grad()
def evaluate(model: MoELM, data: bytes, args: argparse.Namespace, autocast, device) -> float:
    """Mean loss over the first ``--eval-batches`` batches of held-out windows (in order)."""
    if args.eval_batches < 1:
        return float("nan")
    model.eval()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = min((len(buf) - 1) // args.seq_len, args.eval_batches * args.batch_size)
    rows = torch.arange(n)[:, None] * args.seq_len + torch.arange(args.seq_len + 1)
    total = 0.0
    mine = local_rows(args)
    for chunk in buf[rows].to(device).split(args.batch_size):
        chunk = chunk[
            mine.start * len(chunk) // args.batch_size : mine.stop * len(chunk) // args.batch_size
        ]
        with autocast():
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        if args.ep > 1:
            dist.all_reduce(loss)
        total += loss.item()
    model.train()
    return total / (n * args.seq_len)


if __name__ == "__main__":
    main()
    # With --ep, the parallelized model (freed with main's frame, but held in reference
    # cycles by its parallel-style hooks) still owns the destroyed process group: collect
    # it while the interpreter is alive, so that gloo's threads are joined now and not
    # during interpreter shutdown (which can abort: upstream_patches/0002-distributed-gloo-exit).
    gc.collect()
