"""Every benchmark, one after another, each in its own process: `python -m bench.run_all [--quick]`.

Each writes its JSON (with a machine description) into --out; run_all.json lists what ran and how
it ended. A benchmark that fails does not stop the others.
"""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import base_parser, machine_info, resolve, write_result

BENCHMARKS = ("bandwidth", "cache_speedup", "prefill", "vs_transformers", "memory", "capacity", "serving")


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.run_all", __doc__)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    shared = ["--checkpoint", args.checkpoint, "--device", args.device, "--dtype", args.dtype]
    shared += ["--quick"] if args.quick else []
    shared += ["--out", args.out] if args.out else []
    shared += ["--threads", str(args.threads)] if args.threads else []
    shared += ["--kernels", args.kernels]
    runs = []
    for name in args.only.split(","):
        command = [sys.executable, "-m", f"bench.{name}", *shared]
        print(f"== {' '.join(command)}", flush=True)
        start = time.perf_counter()
        returncode = subprocess.run(command).returncode
        runs.append({"benchmark": name, "returncode": returncode, "seconds": time.perf_counter() - start})
    write_result("run_all", {"machine": machine_info(device, dtype), "quick": args.quick, "runs": runs}, args.out)
    failed = [r["benchmark"] for r in runs if r["returncode"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
