"""The load test's numbers and pictures: request records, metrics, the terminal table, plots.

The metric definitions are in `loadtest.client`'s docstring.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------- what one request saw, and metrics


@dataclass
class RequestRecord:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    end: float | None = None  # arrival of the final event (None: never finished)
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed token
    ok: bool = False
    error: str | None = None
    error_type: str | None = None
    status: int | None = None
    finish_reason: str | None = None
    server_generated_tokens: int | None = None  # details.generated_tokens, when sent
    prompt_tokens: int | None = None  # details.input_length, when sent
    cached_tokens: int | None = None  # details.cached_tokens (prompt tokens from the prefix cache), when sent
    draft_tokens: int | None = None  # details.draft_tokens (speculative draft tokens verified), when sent
    accepted_draft_tokens: int | None = None  # details.accepted_draft_tokens (of those, accepted), when sent

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.end is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: list[float], q: float) -> float:
    """q in [0, 100], linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "count": len(values),
    }


def itl_by_token_index(records: list[RequestRecord]) -> list[float]:
    """Entry i: the mean gap between output tokens i and i+1 over the requests that have token i+1."""
    sums: list[float] = []
    counts: list[int] = []
    for record in records:
        for i, gap in enumerate(record.itls()):
            if i == len(sums):
                sums.append(0.0)
                counts.append(0)
            sums[i] += gap
            counts[i] += 1
    return [s / c for s, c in zip(sums, counts)]


def speculation(ok: list[RequestRecord]) -> dict:
    """Speculative decoding as the server reported it: the acceptance rate of its draft tokens, and the
    tokens a request gained per step it took (1 without speculation: each accepted draft token came
    without a step of its own)."""
    generated = sum(r.server_generated_tokens or 0 for r in ok)
    drafted = sum(r.draft_tokens or 0 for r in ok)
    accepted = sum(r.accepted_draft_tokens or 0 for r in ok)
    return {
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": generated / (generated - accepted) if generated > accepted else None,
    }


def summarize(records: list[RequestRecord], wall_s: float, **labels) -> dict:
    """One run's metrics (seconds throughout); `labels` (concurrency, cache_mode, ...) are copied in."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    rate = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    return {
        **labels,
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "errors": dict(Counter(r.error_type for r in records if not r.ok)),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": rate(tokens),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,  # served from the server's prefix cache
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
        **speculation(ok),
        "requests_per_s": rate(len(ok)),
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itls()]),
        "e2e_s": distribution([r.e2e for r in ok]),
        "itl_by_token_index_s": itl_by_token_index(ok),
        "requests": [
            {
                "ok": r.ok,
                "ttft_s": r.ttft,
                "e2e_s": r.e2e,
                "output_tokens": r.output_tokens,
                "server_generated_tokens": r.server_generated_tokens,
                "cached_tokens": r.cached_tokens,
                "finish_reason": r.finish_reason,
                "error_type": r.error_type,
                "error": r.error,
            }
            for r in records
        ],
    }


RATIO_KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_s", "tpot_s", "itl_s", "e2e_s")


def cache_ratio(cache_on: dict, cache_off: dict) -> dict:
    """One run over another (a cache mode over a slower one) for every throughput number and latency
    statistic: above 1 is a gain for throughputs, below 1 for latencies."""

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = {}
    for key in RATIO_KEYS:
        on, off = cache_on[key], cache_off[key]
        if isinstance(on, dict):
            out[key] = {stat: ratio(on[stat], off[stat]) for stat in ("mean", "p50", "p90", "p99")}
        else:
            out[key] = ratio(on, off)
    return out


# ---------------------------------------------------------------- terminal

LATENCIES = (
    ("TTFT", "ttft_s", "ms", 1e3),
    ("TPOT", "tpot_s", "ms", 1e3),
    ("ITL", "itl_s", "ms", 1e3),
    ("E2E", "e2e_s", "s", 1.0),
)
# (row name, summary key, statistic or None, display scale)
TABLE_ROWS = (
    [
        ("requests ok", "requests_ok", None, 1),
        ("requests failed", "requests_failed", None, 1),
        ("output tokens", "output_tokens", None, 1),
        ("wall time (s)", "wall_s", None, 1),
        ("output tokens/s", "output_tokens_per_s", None, 1),
        ("requests/s", "requests_per_s", None, 1),
        ("prefix-cache hit rate", "prefix_cache_hit_rate", None, 1),
        ("draft acceptance rate", "draft_acceptance_rate", None, 1),
        ("tokens per step", "tokens_per_step", None, 1),
    ]
    + [
        (f"{name} {stat} ({unit})", key, stat, scale)
        for name, key, unit, scale in LATENCIES
        for stat in ("mean", "p50", "p90", "p99")
    ]
    + [
        # beside the ITL: the server's step budget in force during the run and what its steps were ('-': not said)
        ("step target (ms; - = off)", "server_steps", "target_step_ms", 1),
        ("step token cap", "server_steps", "max_batched_tokens", 1),
        ("server step mean (ms)", "server_steps", "mean_step_ms", 1),
        ("decode tokens / step", "server_steps", "decode_tokens_per_step", 1),
        ("prompt tokens / step", "server_steps", "prompt_tokens_per_step", 1),
    ]
)


def _cell(summary: dict, key: str, stat: str | None, scale: float) -> float | None:
    value = summary.get(key)
    value = value.get(stat) if isinstance(value, dict) and stat else value
    return None if value is None else value * scale


def _format(value: float | None, ratio: bool = False) -> str:
    if value is None:
        return "-"
    if ratio:
        return f"{value:.2f}x"
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


MODE_NAMES = {"off": "no cache", "kv": "KV cache", "prefix": "KV + prefix cache"}


def render_tables(report: dict) -> list:
    """One table per level: a column per cache mode, then a ratio column per comparison."""
    from rich.table import Table

    def table(title: str, columns: list[tuple[str, dict, bool]]):
        t = Table(title=title, title_justify="left")
        t.add_column("metric")
        for header, _, _ in columns:
            t.add_column(header, justify="right")
        for name, key, stat, scale in TABLE_ROWS:
            t.add_row(
                name,
                *(
                    _format(_cell(values, key, stat, 1 if is_ratio else scale), is_ratio)
                    for _, values, is_ratio in columns
                ),
            )
        return t

    tables, levels = [], []
    for run in report["runs"]:
        if (run["concurrency"], run["request_rate"]) not in levels:
            levels.append((run["concurrency"], run["request_rate"]))
    for level in levels:
        runs = [r for r in report["runs"] if (r["concurrency"], r["request_rate"]) == level]
        ratios = [c for c in report["cache_ratios"] if (c["concurrency"], c["request_rate"]) == level]
        columns = [(MODE_NAMES.get(r["cache_mode"], r["cache_mode"]), r, False) for r in runs]
        columns += [(f"{c['numerator']}/{c['denominator']}", c["ratio"], True) for c in ratios]
        tables.append(table(runs[0]["label"].rsplit(" ", 1)[0], columns))
    return tables


@contextmanager
def progress_bar(console, disabled: bool = False):
    """Yields (on_run_start(label, total), on_done(record)) hooks that drive a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=disabled,
    )
    current = []

    def on_run_start(label: str, total: int) -> None:
        current.append(progress.add_task(label, total=total))

    def on_done(record: RequestRecord) -> None:
        progress.advance(current[-1])

    with progress:
        yield on_run_start, on_done


# ---------------------------------------------------------------- plots


def write_plots(report: dict, plot_dir: str | Path) -> list[Path]:
    """throughput_latency.png (against concurrency or rate) and itl_by_token_index.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    x_key = "request_rate" if any(r["request_rate"] for r in runs) else "concurrency"
    x_label = "request rate (requests/s)" if x_key == "request_rate" else "concurrent clients"
    modes = [m for m in MODE_NAMES if any(r["cache_mode"] == m for r in runs)]
    style = {
        mode: dict(color=color, label=MODE_NAMES[mode])
        for mode, color in (("prefix", "tab:green"), ("kv", "tab:blue"), ("off", "tab:red"))
    }

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        ("output_tokens_per_s", None, "output tokens/s"),
        ("requests_per_s", None, "requests/s"),
        ("ttft_s", "p50", "TTFT (ms), p50 solid, p90 dashed"),
        ("tpot_s", "p50", "TPOT (ms), p50 solid, p90 dashed"),
    ]
    for ax, (key, stat, title) in zip(axes.flat, panels):
        for mode in modes:
            mode_runs = sorted((r for r in runs if r["cache_mode"] == mode), key=lambda r: r[x_key])
            xs = [r[x_key] for r in mode_runs]
            scale = 1e3 if stat else 1.0
            ax.plot(xs, [_cell(r, key, stat, scale) for r in mode_runs], marker="o", **style[mode])
            if stat:
                ax.plot(
                    xs, [_cell(r, key, "p90", scale) for r in mode_runs], linestyle="--", color=style[mode]["color"]
                )
        if x_key == "concurrency" and len({r[x_key] for r in runs}) > 2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r[x_key] for r in runs}), [f"{x:g}" for x in sorted({r[x_key] for r in runs})])
        ax.set(title=title, xlabel=x_label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths = [plot_dir / "throughput_latency.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    levels = sorted({r[x_key] for r in runs})
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 3.8), squeeze=False)
    for ax, level in zip(axes[0], levels):
        for run in (r for r in runs if r[x_key] == level):
            gaps = run["itl_by_token_index_s"]
            ax.plot(range(1, len(gaps) + 1), [g * 1e3 for g in gaps], **style[run["cache_mode"]])
        ax.set(title=f"{x_key.replace('_', ' ')} {level:g}", xlabel="output token index", ylabel="mean ITL (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Latency of each new token against its position in the sequence")
    fig.tight_layout()
    paths.append(plot_dir / "itl_by_token_index.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
