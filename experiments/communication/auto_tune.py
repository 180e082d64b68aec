"""algo.auto against Streaming DiLoCo's fixed defaults, over a slow link and a fast one.

Two replica groups of one CPU process train the tiny model with Streaming DiLoCo, H=100,
P=2 fragments, the preset's τ=1 and fp4 outer gradients (``conf/experiment/auto_tune.yaml``).
The link between groups is limited in the lane transport (``--link bucket``, the default:
``cluster.lane_bandwidth_mbps``, a token bucket on each worker's outer traffic), or by the
kernel (``--link netns``: each group's workers in a network namespace of their own behind a
veth with a ``tc`` tbf at the rate, ``netns_link.py``; needs root, else skipped with the
reason), or both (``--link both``: one table). For each bandwidth the job runs twice, the same
number of inner steps:

- fixed: the preset's τ and format, whatever the link;
- ``algo.auto=true``: after every round the groups re-pick τ and the format from what they
  measured (inner step time, the link's seconds per byte), so each fragment's all-reduce
  hides behind its overlap (``diloco/outer/overlap_plan.py``); the first round runs the preset's.

Reported from each run directory: training seconds, final eval loss of the global model, the
plan of the last round (from the commit logs), the median time a round held training up, and
the link's seconds per byte as algo.auto measured it against ``perf_model``'s 8/bandwidth.

    python -m experiments.communication.auto_tune              # 4 runs, about 3 minutes in all
    python -m experiments.communication.auto_tune --link both  # the same over the kernel-shaped link too (root)
    python -m experiments.communication.auto_tune --quick      # H=40 and 120 steps each: a smoke test

Prints a markdown table and writes it to experiments/results/auto_tune.md (numbers also to
auto_tune.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.outer.perf_model import Link, allreduce_seconds, ring_factor
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import (
    add_output_arguments,
    compose_job,
    markdown_table,
    run_job,
    runs_root,
    stop_on_sigterm,
    write_result,
)
from experiments.communication.netns_link import NetnsLink, unavailable
from experiments.fault_tolerance.kill_every import digests_equal

EXPERIMENT = "auto_tune"
LINKS_MBPS = (1.0, 0.0)  # a slow link, and an unlimited one (0)
PLANS = {"fixed": ["algo.auto=false"], "auto": ["algo.auto=true"]}
LINK_KINDS = {"bucket": ("bucket",), "netns": ("netns",), "both": ("bucket", "netns")}


def link_name(mbps: float) -> str:
    return f"{mbps:g} Mbit/s" if mbps else "unlimited"


def numbers(run_dir: Path) -> dict[str, Any]:
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    committed = [r for r in read_jsonl(paths.commits(0)) if r["committed"]]
    last = committed[-1] if committed else {}
    return {
        "ok": summary["ok"],
        "train_s": summary["train_seconds"],  # the slowest group's
        "final_eval_loss": summary["final_eval_loss"],
        "rounds": len(committed),
        "round_ms": statistics.median(r["sync_ms"] for r in committed) if committed else float("nan"),
        "plan": f"τ={last['delay']}, {last['quantize']}" if "delay" in last else None,
        "digests_agree": digests_equal(summary)[0],
        # What algo.auto measured (median over the rounds; None without algo.auto).
        "link_s_per_byte": _median_or_none([r.get("link_s_per_byte") for r in committed]),
    }


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def model_seconds_per_byte(mbps: float, groups: int) -> float | None:
    """perf_model's seconds per byte a group sends: an all-reduce's time over the bytes each
    group sends in it (None for an unlimited link)."""
    if not mbps:
        return None
    payload = 1e6
    return allreduce_seconds(payload, groups, Link(mbps * 1e6)) / (ring_factor(groups) * payload)


def _us(seconds_per_byte: float | None) -> str:
    return "—" if seconds_per_byte is None else f"{seconds_per_byte * 1e6:.3g}"


Figures = dict[str, dict[str, dict[str, dict[str, Any]]]]  # link kind -> bandwidth -> plan -> numbers


def table(figures: Figures, preset: str) -> str:
    rows = []
    for kind, links in figures.items():
        for link, runs in links.items():
            fixed = runs["fixed"]
            for name, n in runs.items():
                rows.append(
                    [
                        link,
                        kind,
                        name,
                        n["plan"] or preset,
                        _us(n["link_s_per_byte"]),
                        _us(n.get("model_s_per_byte")),
                        f"{n['train_s']:.1f}",
                        f"{n['train_s'] / fixed['train_s']:.2f}x",
                        f"{n['round_ms']:.0f}",
                        f"{n['final_eval_loss']:.4f}",
                        f"{n['final_eval_loss'] / fixed['final_eval_loss'] - 1:+.2%}",
                    ]
                )
    headers = [
        "bandwidth",
        "link",
        "plan",
        "τ, format (last round)",
        "µs/B measured",
        "µs/B model",
        "train s",
        "vs fixed",
        "round ms",
        "final eval loss",
        "vs fixed",
    ]
    return markdown_table(headers, rows)


@contextlib.contextmanager
def shaped(kind: str, mbps: float, groups: int) -> Iterator[tuple[list[str], dict[int, list[str]] | None]]:
    """The job overrides and per-group worker prefix that put a ``mbps`` link between the groups:
    the in-process token bucket, or the kernel's (each group in its own network namespace)."""
    if kind == "bucket":
        yield [f"cluster.lane_bandwidth_mbps={mbps}"], None
        return
    with NetnsLink(groups, mbps) as link:
        overrides = ["cluster.lane_bandwidth_mbps=0", "cluster.spawn=exec", f"cluster.lighthouse.host={link.host}"]
        yield overrides, link.worker_prefix()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=40 and 120 inner steps per run: a smoke test")
    parser.add_argument("--steps", type=int, help="inner steps per run, a multiple of H (default 1000; --quick 120)")
    parser.add_argument(
        "--links", type=float, nargs="+", default=LINKS_MBPS, help="lane bandwidths in Mbit/s (0: unlimited)"
    )
    parser.add_argument(
        "--link",
        choices=sorted(LINK_KINDS),
        default="bucket",
        help="what limits the link: the in-process token bucket, a tc tbf between network namespaces (root), or both",
    )
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    began = time.monotonic()
    steps = args.steps or (120 if args.quick else 1000)
    quick = ["algo.sync_every=40"] if args.quick else []  # H/P = 20: rounds often enough to re-plan
    job = compose_job([*quick, f"trainer.max_steps={steps}"], EXPERIMENT)
    preset = f"τ={job.algo.delay}, {job.algo.quantize}"
    kinds = link_kinds(args.link)
    figures: Figures = {}
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        for kind in kinds:
            figures[kind] = {}
            for mbps in args.links:
                link = link_name(mbps)
                figures[kind][link] = {}
                with shaped(kind, mbps, job.cluster.groups) as (link_overrides, prefix):
                    for name, overrides in PLANS.items():
                        started = time.monotonic()
                        run_dir = root / f"{kind}-{mbps:g}mbps-{name}"
                        shared = [*quick, f"trainer.max_steps={steps}", *link_overrides]
                        run_job(compose_job(shared + overrides, EXPERIMENT), run_dir, worker_prefix=prefix)
                        model = model_seconds_per_byte(mbps, job.cluster.groups)
                        figures[kind][link][name] = numbers(run_dir) | {"mbps": mbps, "model_s_per_byte": model}
                        done = f"{link}, {kind}, {name}: done in {time.monotonic() - started:.0f}s"
                        print(done, file=sys.stderr, flush=True)
    a = job.algo
    setup = (
        f"Streaming DiLoCo H={a.sync_every}, P={a.fragments}, α={a.alpha:g}, 2 groups x 1 CPU process, tiny model, "
        f"{steps} inner steps per run; fixed: the preset's {preset}; auto: re-planned after every round from the "
        "measured step time and link (the first round runs the preset's). Round ms: median time a round held "
        "training up (the all-reduce's wait included when it is not hidden). Link: bucket, the in-process "
        "token bucket on each worker's outer traffic (cluster.lane_bandwidth_mbps); netns, each group in its own "
        "network namespace behind a veth with a tc tbf at the rate on both ends (experiments/communication/netns_link.py; all "
        "of a group's traffic, its lighthouse heartbeats too). µs/B: the link's seconds per byte sent, as "
        "algo.auto measured it (median over rounds; auto runs only) and as perf_model predicts it (8/bandwidth)."
    )
    checks = [
        f"- {link}, {kind}: auto {verdict_line(runs)}"
        for kind, links in figures.items()
        for link, runs in links.items()
        if "auto" in runs and "fixed" in runs
    ]
    text = "\n".join([setup, "", table(figures, preset), "", *checks])
    print(text)
    print(f"table written to {write_result('auto_tune.md', text, args.results)}", file=sys.stderr)
    write_result("auto_tune.json", json.dumps(figures, indent=2), args.results)
    print(f"total wall time {time.monotonic() - began:.0f}s", file=sys.stderr)


def link_kinds(choice: str) -> tuple[str, ...]:
    """The link kinds ``--link`` asks for that this machine can build; the kernel's needs root
    (said in one line when skipped). Exits with the reason if none is left."""
    kinds = LINK_KINDS[choice]
    reason = unavailable() if "netns" in kinds else None
    if reason is None:
        return kinds
    print(f"--link netns skipped: {reason}", file=sys.stderr)
    kinds = tuple(k for k in kinds if k != "netns")
    if not kinds:
        raise SystemExit(f"--link netns: {reason}")
    return kinds


def verdict_line(runs: dict[str, dict[str, Any]]) -> str:
    """How the auto run compares with the fixed one: wall time and loss, and whether both runs are sound."""
    auto, fixed = runs["auto"], runs["fixed"]
    sound = all(n["ok"] and n["digests_agree"] for n in (auto, fixed))
    return (
        f"{auto['train_s'] / fixed['train_s']:.2f}x the fixed plan's training time, final eval loss "
        f"{auto['final_eval_loss'] / fixed['final_eval_loss'] - 1:+.2%}; runs ok with equal digests: {sound}"
    )


if __name__ == "__main__":
    main()
