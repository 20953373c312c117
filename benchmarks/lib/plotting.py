"""Optional plots for the serving benchmarks. matplotlib is a dev dependency, not a runtime one:
every function returns None when it wrote the PNG, else the reason it did not."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=label)


def latency_cdfs(runs: list[dict], path: Path, title: str) -> str | None:
    """One panel per latency (TTFT, TPOT, ITL, end-to-end), one CDF per run (a rate); plus
    goodput and throughput against the rate when there are several rates.

    runs: [{"label": str, "rate": float, "ttft_ms": [...], "tpot_ms": [...], "itl_ms": [...],
            "e2e_s": [...], "goodput": float, "output_throughput": float}]"""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot written"
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
              ("e2e_s", "end-to-end (s)")]
    rated = [r for r in runs if r.get("rate") not in (None, float("inf"))]
    extra = 1 if len(rated) > 1 else 0
    fig, axes = plt.subplots(1, len(panels) + extra, figsize=(4.2 * (len(panels) + extra), 3.6))
    for ax, (key, name) in zip(axes, panels):
        for r in runs:
            _cdf(ax, r.get(key) or [], r["label"])
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests" if key != "itl_ms" else "share of token gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if key == "itl_ms":  # token gaps span sub-ms bursts to prefill stalls
            ax.set_xscale("log")
    axes[0].legend(fontsize=7)
    if extra:
        ax = axes[-1]
        xs = [r["rate"] for r in rated]
        ax.plot(xs, [r["goodput"] for r in rated], "o-", label="goodput (req/s)")
        ax.plot(xs, [r["request_throughput"] for r in rated], "s--", label="throughput (req/s)")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def goodput_vs_rate(series: dict[str, list[tuple[float, float]]], path: Path, title: str,
                    ylabel: str = "goodput (req/s)") -> str | None:
    """One line per layout: (offered rate, goodput) points; one bar per layout when every
    layout ran at one and the same rate."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot written"
    fig, ax = plt.subplots(figsize=(5.5, 4))
    rates = {p[0] for points in series.values() for p in points}
    if len(rates) == 1 and all(len(points) == 1 for points in series.values()):
        labels = list(series)
        ax.bar(range(len(labels)), [series[k][0][1] for k in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
        ax.set_xlabel(f"layout, at {rates.pop():g} req/s offered")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    else:
        for label, points in series.items():
            points = sorted(points)
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
