"""Fan-out against the Python limit, in alternated pairs: how far one run's ratio can be trusted.

The peer bench (``../shared/bench``) measures each peer in its own window of a few
seconds, and the CPU a window costs moves with whatever else the machine does: the same
server, measured twice in one run, has differed by a third. This script runs the bench's
``fanout`` scenario ``--runs`` times for ``py-prebuilt-calib`` and ``gateway`` only,
swapping their order every run, and prints, for every rate, the gateway's server CPU
divided by calib's in each run and the median of those ratios, with calib's own spread
across runs next to it: a ratio inside that spread says nothing either way. It also
prints the gateway's extra CPU per event (its CPU minus calib's, over the rate): with one
subscriber (``--subscribers 1``) that is the cost of the durable publish path alone.

    .venv/bin/python bench/peer_pairs.py                       # 3 runs, --quick
    .venv/bin/python bench/peer_pairs.py --runs 5 --full       # the bench's full windows
    .venv/bin/python bench/peer_pairs.py --subscribers 1 --rates 20,100,400
    .venv/bin/python bench/peer_pairs.py --gateway-dir ../other-checkout   # A/B a change
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

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("py-prebuilt-calib", "gateway")
RESULTS = re.compile(r"^results: (\S+\.json)$", re.MULTILINE)


def one_run(bench: Path, order: tuple[str, ...], options: list[str]
            ) -> dict[str, dict[int, float]]:
    """One bench run: peer -> rate -> server CPU %, for the rates that passed."""
    cmd = [str(bench / "run"), "--peers", ",".join(order), "--scenarios", "fanout", *options]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    found = RESULTS.search(done.stderr)
    if done.returncode != 0 or found is None:
        sys.exit(f"bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    results = json.loads(Path(found.group(1)).read_text())
    cpu: dict[str, dict[int, float]] = {}
    for peer in order:
        fanout = results["peers"].get(peer, {}).get("scenarios", {}).get("fanout")
        if not fanout or not fanout.get("runs"):
            sys.exit(f"{peer} has no fanout results in {found.group(1)}: {fanout!r:.500}")
        runs = fanout["runs"]
        cpu[peer] = {int(r["rate"]): float(r["cpu_pct"]["server"]) for r in runs if r["ok"]}
    print(f"  run {found.group(1)}: " + "; ".join(
        f"{peer} {' '.join(f'{rate}:{pct:g}' for rate, pct in cpu[peer].items())}"
        for peer in order), flush=True)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="the bench's full windows, not --quick")
    ap.add_argument("--subscribers", type=int, help="subscribers in the room (the bench's --n)")
    ap.add_argument("--rates", help="publish rates, msg/s, comma-separated (the bench's)")
    ap.add_argument("--gateway-dir", type=Path, help="the checkout to bench (default: this one)")
    ap.add_argument("--bench", type=Path, default=ROOT.parent / "shared" / "bench")
    args = ap.parse_args()
    options = [] if args.full else ["--quick"]
    if args.subscribers is not None:
        options += ["--n", str(args.subscribers)]
    if args.rates:
        options += ["--rates", args.rates]
    if args.gateway_dir:
        options += ["--gateway-dir", str(args.gateway_dir.resolve())]

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
