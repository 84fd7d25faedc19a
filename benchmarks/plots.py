"""Figures of the CPU benchmarks (matplotlib, Agg): time ratio vs window fill, sessions that fit vs budget.

    python -m benchmarks.plots RESULTS.json [--out docs]    # RESULTS.json as written by run_all --json-out
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

FORWARD_PNG = "bench_forward_ratio.png"
CAPACITY_PNG = "bench_capacity.png"
COLORS = {"tiny": "tab:blue", "mid": "tab:orange"}


def _errorbar(ax, x, ratios, color, label, marker="o"):
    med = [r["median"] for r in ratios]
    lo = [r["median"] - r["min"] for r in ratios]
    hi = [r["max"] - r["median"] for r in ratios]
    iq_lo = [r["median"] - r["q1"] for r in ratios]
    iq_hi = [r["q3"] - r["median"] for r in ratios]
    ax.errorbar(x, med, yerr=[lo, hi], fmt="none", ecolor=color, elinewidth=1, capsize=4, alpha=0.6)
    ax.errorbar(x, med, yerr=[iq_lo, iq_hi], fmt=marker + "-", color=color, elinewidth=4, capsize=0, label=label,
                markersize=6)


def plot_forward_ratio(forward: dict, path: Path) -> Path:
    """Left: DreamZero denoising forward, paged/dense vs window fill. Right: HunyuanImage-3 prefill and step."""
    rows = forward["rows"]
    inner = forward["settings"]["inner_compiler"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    configs = sorted({r["config"] for r in rows}, key=lambda c: list(COLORS).index(c) if c in COLORS else 9)
    for cfg in configs:
        dz = sorted((r for r in rows if r["family"] == "dreamzero" and r["config"] == cfg
                     and r["forward"] == "denoise"), key=lambda r: r["fill_fraction"])
        if dz:
            _errorbar(ax1, [r["fill_fraction"] * 100 for r in dz], [r["ratio"] for r in dz],
                      COLORS.get(cfg, "gray"), f"{cfg}")
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xlabel("window fill: video keys attended / window (%)")
    ax1.set_ylabel("forward time, paged / dense")
    ax1.set_title("DreamZero denoising forward")
    ax1.set_xlim(0, 105)
    ax1.legend(title="config", loc="best")
    ax1.grid(alpha=0.3)
    labels, x = [], 0
    for cfg in configs:
        hy = [r for r in rows if r["family"] == "hunyuan_image3" and r["config"] == cfg]
        for r in hy:
            _errorbar(ax2, [x], [r["ratio"]], COLORS.get(cfg, "gray"), None, marker="s")
            labels.append(f"{cfg}\n{r['forward']}")
            x += 1
    ax2.axhline(1.0, color="black", lw=0.8, ls="--")
    ax2.set_xticks(range(len(labels)), labels)
    ax2.set_xlim(-0.5, len(labels) - 0.5)
    ax2.set_title("HunyuanImage-3 forward")
    ax2.grid(alpha=0.3, axis="y")
    # Axes follow the interquartile ranges; min/max whiskers of a noisy repeat may run off the plot.
    lo = min([r["ratio"]["q1"] for r in rows] + [0.95])
    hi = max([r["ratio"]["q3"] for r in rows] + [1.05])
    pad = 0.15 * (hi - lo)
    for ax in (ax1, ax2):
        ax.set_ylim(max(0.0, lo - pad), hi + pad)
    fig.suptitle(f"Paged / dense forward time on CPU (regional compile, inner compiler {inner}, reference kernel)\n"
                 "markers: median, bars: interquartile range, whiskers: min-max of per-repeat ratios "
                 "(clipped to the axes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_capacity(memory: dict, path: Path) -> Path:
    """Sessions (DreamZero-14B) and requests (HunyuanImage-3) whose KV fits a budget, dense vs paged."""
    real = memory["real"]
    sweep = real["sweep"]
    b = sweep["budget_gib"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.step(b, sweep["dreamzero_paged"], where="post", color="tab:green", lw=6, alpha=0.45,
             label="paged (scheduler, measured)")
    ax1.step(b, sweep["dreamzero_dense_held"], where="post", color="tab:red", ls="--", lw=1.5,
             label="dense, caches held between forwards")
    ax1.step(b, sweep["dreamzero_dense_peak"], where="post", color="tab:red", lw=2,
             label="dense, with a forward's new cache")
    if sweep["dreamzero_paged"] == sweep["dreamzero_dense_held"]:
        ax1.text(0.97, 0.04, "paged = dense held: the loop resets the\nwindow (frame 20) before it fills (21)",
                 transform=ax1.transAxes, ha="right", va="bottom", fontsize=8)
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title("DreamZero-14B sessions (2 CFG rows, bf16)")
    ax1.set_ylabel("concurrent sessions that fit")
    ax2.step(b, sweep["hunyuan_paged"], where="post", color="tab:green", lw=2, label="paged (scheduler, measured)")
    ax2.step(b, sweep["hunyuan_dense"], where="post", color="tab:red", lw=2, label="dense (prefix padded to 1024)")
    ax2.set_title("HunyuanImage-3 requests (prompts 1000 + 300, bf16)")
    ax2.set_ylabel("concurrent requests that fit")
    for ax in (ax1, ax2):
        ax.set_xlabel("KV budget (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_xlim(0, max(b) + 4)
        ax.set_ylim(bottom=0)
    fig.suptitle("KV capacity at the real sizes: what fits a KV budget (weights and activations not included)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if "forward_time" in results:
        written.append(plot_forward_ratio(results["forward_time"], out_dir / FORWARD_PNG))
    if "memory" in results:
        written.append(plot_capacity(results["memory"], out_dir / CAPACITY_PNG))
    return written


def regenerate(argv: list[str] | None = None) -> int:
    """Command line: figures from saved results (not a benchmark, so `paged-kv bench` does not list it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="JSON written by `python -m benchmarks.run_all --json-out`")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    args = parser.parse_args(argv)
    for p in write_all(json.loads(Path(args.results).read_text()), Path(args.out)):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(regenerate())
