"""Routing simulator table: max/mean load imbalance of each policy over fleets of G workers and
batches of B in-flight requests, for each arrival pattern (tokenmill/router/simulate.py; no model).

    .venv/bin/python benchmarks/router_sim.py                      # the full grid, Markdown
    .venv/bin/python benchmarks/router_sim.py --workers 2 8 64 --batch-sizes 8 64 512 --trials 5

Each cell is the mean over ``--trials`` seeds of max/mean outstanding tokens after the batch is
routed (1.00 = perfect balance). ``sqrt`` is random assignment's first-order prediction
1 + sqrt(2 G ln G / B); ``hit`` is the share of prompt blocks already cached on the worker kv_aware
(and kv_affinity, its cache-first variant under the same cap) sent them to.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.router.simulate import PATTERNS, POLICIES, random_spread_prediction, simulate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--epsilon", type=float, default=0.25, help="the bounded-load slack of the kv_* policies")
    parser.add_argument("--trials", type=int, default=5, help="seeds averaged per cell")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    print(f"max/mean outstanding tokens after routing a batch (mean of {args.trials} seeds; "
          f"kv_* cap: (1 + {args.epsilon}) x mean)\n")
    for pattern in args.patterns:
        print(f"### {pattern}\n")
        print("| G | B | " + " | ".join(args.policies) + " | sqrt | hit kv_aware / kv_affinity |")
        print("|---:|---:|" + "---:|" * (len(args.policies) + 2))
        for num_workers in args.workers:
            for batch in args.batch_sizes:
                cells, hits = [], {}
                for policy in args.policies:
                    runs = [simulate(policy, pattern, num_workers, batch, seed=s, epsilon=args.epsilon)
                            for s in range(args.trials)]
                    cells.append(f"{statistics.mean(r.imbalance for r in runs):.2f}")
                    if policy in ("kv_aware", "kv_affinity"):
                        hits[policy] = f"{statistics.mean(r.hit_share for r in runs):.0%}"
                prediction = random_spread_prediction(num_workers, batch)
                print(f"| {num_workers} | {batch} | " + " | ".join(cells) + f" | {prediction:.2f} | {' / '.join(hits.values())} |")
        print()
    print(f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
