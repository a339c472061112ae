"""Peer bench ratios in alternated pairs: how far one run's ratio can be trusted.

The peer bench (``../shared/bench``) measures each peer in its own window of a few
seconds, and the CPU a window costs moves with whatever else the machine does: the same
server, measured twice in one run, has differed by a third. This script runs the bench's
``fanout`` scenario ``--runs`` times for ``py-prebuilt-calib`` and ``gateway`` only,
swapping their order every run, and prints, for every rate, the gateway's server CPU
divided by calib's in each run and the median of those ratios, with calib's own spread
across runs next to it: a ratio inside that spread says nothing either way. It also
prints the gateway's extra CPU per event (its CPU minus calib's, over the rate): with one
subscriber (``--subscribers 1``) that is the cost of the durable publish path alone.

With ``--storm`` it runs the ``idle`` scenario instead, for ``ws-floor`` and ``gateway``:
the time each takes to connect 5000 clients (the connection storm), their ratio, its median,
and how busy the gateway's run kept the server's core and the generator's (where the bench's
clients and the gateway's Redis run).

    .venv/bin/python bench/peer_pairs.py                       # 3 runs, --quick
    .venv/bin/python bench/peer_pairs.py --runs 5 --full       # the bench's full windows
    .venv/bin/python bench/peer_pairs.py --subscribers 1 --rates 20,100,400
    .venv/bin/python bench/peer_pairs.py --gateway-dir ../other-checkout   # A/B a change
    .venv/bin/python bench/peer_pairs.py --storm --runs 4                  # connection storm
    .venv/bin/python bench/peer_pairs.py --bench ~/src/shared/bench

Run it from the repository root (the bench installs the checkout it is started from), on a
machine with nothing else running: about 2 minutes per run with ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("py-prebuilt-calib", "gateway")
STORM_PEERS = ("ws-floor", "gateway")
RESULTS = re.compile(r"^results: (\S+\.json)$", re.MULTILINE)


def bench_run(bench: Path, order: tuple[str, ...], scenario: str, options: list[str]
              ) -> tuple[str, dict[str, Any]]:
    """One bench run of ``scenario``: its results file, and each peer's results of it."""
    cmd = [str(bench / "run"), "--peers", ",".join(order), "--scenarios", scenario, *options]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    found = RESULTS.search(done.stderr)
    if done.returncode != 0 or found is None:
        sys.exit(f"bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    results = json.loads(Path(found.group(1)).read_text())
    scenarios = {}
    for peer in order:
        result = results["peers"].get(peer, {}).get("scenarios", {}).get(scenario)
        if not result or result.get("status") != "ok":
            sys.exit(f"{peer} has no {scenario} results in {found.group(1)}: {result!r:.500}")
        scenarios[peer] = result
    return found.group(1), scenarios


def one_run(bench: Path, order: tuple[str, ...], options: list[str]
            ) -> dict[str, dict[int, float]]:
    """One fanout run: peer -> rate -> server CPU %, for the rates that passed."""
    path, fanouts = bench_run(bench, order, "fanout", options)
    cpu = {peer: {int(r["rate"]): float(r["cpu_pct"]["server"])
                  for r in fanout["runs"] if r["ok"]} for peer, fanout in fanouts.items()}
    print(f"  run {path}: " + "; ".join(
        f"{peer} {' '.join(f'{rate}:{pct:g}' for rate, pct in cpu[peer].items())}"
        for peer in order), flush=True)
    return cpu


def storm(bench: Path, runs: int, options: list[str]) -> None:
    """The idle scenario's connection storm, ``runs`` times: ws-floor against the gateway."""
    print("| run | ws-floor s | gateway s | gateway ÷ ws-floor | gateway's run: server core, "
          "generator core busy % |")
    print("|---|---|---|---|---|")
    ratios = []
    for i in range(runs):
        order = STORM_PEERS if i % 2 == 0 else STORM_PEERS[::-1]
        path, idle = bench_run(bench, order, "idle", options)
        floor, gateway = idle["ws-floor"]["connect_s"], idle["gateway"]["connect_s"]
        ratios.append(gateway / floor)
        cores = idle["gateway"].get("connect_cores", {})
        busy = ", ".join(f"{cores[cpu]['busy']:g}" for cpu in sorted(cores))
        print(f"| {Path(path).stem} | {floor:g} | {gateway:g} | {ratios[-1]:.2f} | {busy} |",
              flush=True)
    print(f"\nmedian gateway ÷ ws-floor: {statistics.median(ratios):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="the bench's full windows, not --quick")
    ap.add_argument("--subscribers", type=int, help="subscribers in the room (the bench's --n)")
    ap.add_argument("--rates", help="publish rates, msg/s, comma-separated (the bench's)")
    ap.add_argument("--gateway-dir", type=Path, help="the checkout to bench (default: this one)")
    ap.add_argument("--bench", type=Path, default=ROOT.parent / "shared" / "bench")
    ap.add_argument("--storm", action="store_true",
                    help="the idle scenario's connection storm, against ws-floor")
    args = ap.parse_args()
    options = [] if args.full else ["--quick"]
    if args.subscribers is not None:
        options += ["--n", str(args.subscribers)]
    if args.rates:
        options += ["--rates", args.rates]
    if args.gateway_dir:
        options += ["--gateway-dir", str(args.gateway_dir.resolve())]
    if args.storm:
        storm(args.bench, args.runs, options)
        return

    runs = []
    for i in range(args.runs):
        order = PEERS if i % 2 == 0 else PEERS[::-1]
        print(f"run {i + 1}/{args.runs}: {', '.join(order)}", flush=True)
        runs.append(one_run(args.bench, order, options))

    rates = sorted({rate for run in runs for rate in run["gateway"]} |
                   {rate for run in runs for rate in run["py-prebuilt-calib"]})
    print("\n| rate msg/s | gateway ÷ calib, each run | median | calib max ÷ min "
          "| gateway's extra ms per event, median |")
    print("|---|---|---|---|---|")
    for rate in rates:
        both = [(run["gateway"][rate], run["py-prebuilt-calib"][rate]) for run in runs
                if rate in run["gateway"] and rate in run["py-prebuilt-calib"]]
        calib = [run["py-prebuilt-calib"][rate] for run in runs if rate in run["py-prebuilt-calib"]]
        if not both:
            print(f"| {rate} | one peer did not pass | | | |")
            continue
        # Calib can read 0.0 % at one subscriber and a low rate: no ratio from that run.
        pairs = [gateway / cal for gateway, cal in both if cal]
        # 1 % of a core is 10 ms of CPU a second, spread over `rate` events.
        extra = [(gateway - cal) * 10 / rate for gateway, cal in both]
        spread = f"{max(calib) / min(calib):.2f}" if len(calib) > 1 and min(calib) else ""
        median = f"{statistics.median(pairs):.2f}" if pairs else ""
        print(f"| {rate} | {' '.join(f'{r:.2f}' for r in pairs)} | {median} | {spread} | "
              f"{statistics.median(extra):.3f} |")


if __name__ == "__main__":
    main()
