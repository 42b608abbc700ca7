"""`specserve bench serving --plot`: the run's latency distributions and throughput as a PNG."""

from __future__ import annotations

from typing import Any

from specserve.bench.serving import RequestResult


def plot(results: list[RequestResult], summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.hist([1000 * r.ttft for r in ok], bins=30, color="tab:blue")
    ax.set_title("time to first token")
    ax.set_xlabel("ms")
    ax.set_ylabel("requests")

    ax = axes[0][1]
    itl = sorted(1000 * x for r in ok for x in r.itl)
    if itl:
        ax.plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], color="tab:orange")
    ax.set_title("inter-token latency (CDF)")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of gaps")

    ax = axes[1][0]
    ax.scatter([r.start for r in ok], [r.e2e for r in ok], s=10, color="tab:green")
    ax.set_title("end-to-end latency by arrival time")
    ax.set_xlabel("arrival (s since start)")
    ax.set_ylabel("latency (s)")

    ax = axes[1][1]
    ends = sorted((r.start + r.e2e, r.output_tokens) for r in ok)
    total, xs, ys = 0, [0.0], [0]
    for t, n in ends:
        total += n
        xs.append(t)
        ys.append(total)
    ax.step(xs, ys, where="post", color="tab:red")
    ax.set_title("output tokens completed")
    ax.set_xlabel("time (s since start)")
    ax.set_ylabel("tokens")

    def fmt(key: str, unit: str = "") -> str:
        v = summary.get(key)
        return "n/a" if v is None else f"{v:.3g}{unit}"

    fig.suptitle(
        f"{summary.get('model')} via {summary['endpoint']}: {summary['completed']} requests, "
        f"rate {summary['request_rate']}, concurrency {summary['max_concurrency']} | "
        f"{fmt('request_throughput_req_s', ' req/s')}, "
        f"{fmt('output_token_throughput_tok_s', ' tok/s')}, "
        f"accept length {fmt('spec_accept_length')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
