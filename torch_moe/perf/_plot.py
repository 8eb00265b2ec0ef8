"""The sparsity-regime chart: predicted time, roofline fraction and memory against expert
granularity and tokens per expert (matplotlib, imported only when drawing).

Legend: T tokens per rank, D dim, F expert hidden dim, E experts, K top-k, g granularity.

Granularity g splits every expert into g finer ones at equal active and total parameters:
``E = g * E0``, ``K = g * K0``, ``F = F0 / g`` (DeepSeekMoE's fine-grained experts). The
roofline fraction is the routed-expert FLOPs (``6 * T*K*D*F`` forward, x3 with the
backward: the 18*T*K*D*F floor of benchmarks/bench_moe_layer.py) over the step time and
the hardware's large bf16 GEMM rate. Tokens per expert is ``T*K/E`` at the base model.
"""

from __future__ import annotations

from typing import Any

from torch_moe.perf._advisor import advise
from torch_moe.perf._hardware import Hardware
from torch_moe.perf._model import predict
from torch_moe.perf._workload import MoEWorkload

__all__ = ["granularities", "regime_chart", "regime_series"]


def granularities(base: MoEWorkload, max_experts: int = 512, max_top_k: int = 32) -> list[int]:
    """Powers of two g with E0*g <= max_experts, K0*g <= max_top_k, F0 / g >= 16 whole."""
    out = []
    g = 1
    while (
        base.num_experts * g <= max_experts
        and base.top_k * g <= max_top_k
        and base.hidden_dim % g == 0
        and base.hidden_dim // g >= 16
    ):
        out.append(g)
        g *= 2
    return out


def _routed_flops(w: MoEWorkload) -> float:
    return 6.0 * w.tokens * w.top_k * w.dim * w.hidden_dim * (3 if w.backward else 1)


def regime_series(
    base: MoEWorkload,
    hw: Hardware,
    *,
    world_size: int = 1,
    gpus_per_node: int | None = None,
    precisions: tuple[str, ...] = ("bf16", "fp8_blockwise"),
    tokens: tuple[int, ...] = (256, 1024, 4096, 16384),
) -> dict[str, Any]:
    """Predicted points: per precision and strategy, over granularity and over tokens."""
    rate = hw.rate("bf16")
    out: dict[str, Any] = {"granularity": {}, "tokens": {}}
    gs = granularities(base)
    for prec in precisions:
        lines = [("one device", 1)]
        if world_size > 1:
            lines.append(
                (f"{world_size} ranks, advisor's best (with its gradient sync)", world_size)
            )
        for label, ws in lines:
            pts = []
            for g in gs:
                w = base.replace(
                    num_experts=base.num_experts * g,
                    top_k=min(base.top_k * g, base.num_experts * g),
                    hidden_dim=base.hidden_dim // g,
                    precision=prec,
                )
                if ws == 1:
                    p = predict(w, hw)
                    step, mem, desc = p.time, p.memory["peak_step"], "one device"
                else:
                    a = advise(w, hw, world_size=ws, gpus_per_node=gpus_per_node, precisions=[prec])
                    p = a.best.prediction
                    step, mem, desc = a.best.step_time, a.best.memory, a.best.strategy.describe()
                pts.append(
                    dict(
                        g=g,
                        experts=w.num_experts,
                        top_k=w.top_k,
                        hidden=w.hidden_dim,
                        time=step,
                        per_token=step / w.tokens,
                        roofline=_routed_flops(w) / step / rate,
                        memory=mem,
                        strategy=desc,
                    )
                )
            out["granularity"][f"{prec}, {label}"] = pts
        pts = []
        for t in tokens:
            w = base.replace(tokens=t, precision=prec)
            p = predict(w, hw)
            pts.append(
                dict(
                    tokens=t,
                    tokens_per_expert=t * w.top_k / w.num_experts,
                    time=p.time,
                    roofline=_routed_flops(w) / p.time / rate,
                    memory=p.memory["peak_step"],
                )
            )
        out["tokens"][f"{prec}, one device"] = pts
    return out


def regime_chart(
    series: dict[str, Any], path: str, title: str, measured: dict[str, Any] | None = None
) -> None:
    """Draw :func:`regime_series` (and optional measured points with the same keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_t, ax_r), (ax_m, ax_k) = axes
    for i, (label, pts) in enumerate(series["granularity"].items()):
        color = f"C{i}"
        xs = [p["g"] for p in pts]
        ax_t.plot(xs, [p["per_token"] * 1e6 for p in pts], "o-", color=color, label=label)
        ax_r.plot(xs, [p["roofline"] for p in pts], "o-", color=color, label=label)
        ax_m.plot(xs, [p["memory"] / 2**30 for p in pts], "o-", color=color, label=label)
    for i, (label, pts) in enumerate(series["tokens"].items()):
        ax_k.plot(
            [p["tokens_per_expert"] for p in pts],
            [p["roofline"] for p in pts],
            "o-",
            color=f"C{i * 2}",
            label=f"{label} (predicted)",
        )
    if measured:
        for i, (label, pts) in enumerate(measured.get("granularity", {}).items()):
            ax_t.plot(
                [p["g"] for p in pts],
                [p["per_token"] * 1e6 for p in pts],
                "x--",
                color=f"C{i + 5}",
                label=f"{label} (measured)",
            )
            ax_r.plot(
                [p["g"] for p in pts],
                [p["roofline"] for p in pts],
                "x--",
                color=f"C{i + 5}",
                label=f"{label} (measured)",
            )
        for i, (label, pts) in enumerate(measured.get("tokens", {}).items()):
            ax_k.plot(
                [p["tokens_per_expert"] for p in pts],
                [p["roofline"] for p in pts],
                "x--",
                color=f"C{i + 5}",
                label=f"{label} (measured)",
            )
    ax_t.set_ylabel("step time per token (us)")
    ax_r.set_ylabel("routed FLOPs / time / bf16 GEMM rate")
    ax_m.set_ylabel("peak + Adam memory per rank (GiB)")
    for ax in (ax_t, ax_r, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("granularity g (E = g E0, K = g K0, F = F0 / g)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_k.set_xscale("log")
    ax_k.set_xlabel("tokens per expert (T K / E)")
    ax_k.set_ylabel("routed FLOPs / time / bf16 GEMM rate")
    ax_k.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_k.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
