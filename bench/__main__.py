"""``python -m bench NAME`` (``sluice bench NAME`` from a checkout runs this): one benchmark scenario; each prints its
figures and writes ``bench/results/<scenario>.md`` (and a ``.png`` where it plots)."""

from __future__ import annotations

import argparse
import sys

import yaml


def _admission_settings(parser: argparse.ArgumentParser, items: list[str] | None) -> dict[str, object]:
    """``--admission KEY=VALUE`` options as a config section (each value read as YAML: true, 1000, ...)."""
    settings: dict[str, object] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--admission takes KEY=VALUE, got {item!r}")
        settings[key] = yaml.safe_load(value)
    return settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sluice bench", description=__doc__)
    p.add_argument("scenario", choices=["observe", "cag4", "t10", "overhead", "steady", "fleet", "scale", "chaos",
                                        "replicas", "ratelimit", "prefix", "estimates", "fairness", "lora", "shapes"])
    p.add_argument("--engines", metavar="N|FILE",
                   help="observe: how many simulated engines to poll (default 1000); overhead, steady: a YAML file listing the "
                        "engines to front instead of a simulator (e.g. real llama.cpp servers, see rig/llama.py)")
    p.add_argument("--cycles", type=int, default=10, help="observe: poll cycles to measure")
    p.add_argument("--sizes", help="scale: engine counts to run, comma-separated, the 2-engine run the baseline; "
                   "1000p1: 1000 engines polled every second, probe budget lifted (default 2,200,1000,1000p1)")
    p.add_argument("--seconds", type=float, help="scale: seconds of traffic per size (default 40)")
    p.add_argument("--rounds", type=int, help="scale: interleaved segments per size, the seconds split among them "
                   "(default 3); steady, prefix: rounds per cell, every arm once a round in an order rotated each "
                   "round, figures pooled over the rounds (default 2)")
    p.add_argument("--quick", action="store_true", help="steady: one fleet (thor+spark), one mix (open), five arms "
                   "(sluice, LR+scan+cap, RR+w+cap, EPP; the clairvoyant arm at 80%% and 95%%), 6 s windows (14 s "
                   "above 100%%) per round: about 10 minutes with 2 rounds; replicas: a "
                   "400-request burst through 1 and 2 replicas, shorter windows (about a minute and a half); ratelimit: "
                   "shorter windows and a tenth of the limiter's charges; prefix: the system workload at 90%%, shorter "
                   "windows, no two-replica arm; lora: loads 60%% and 95%%, one round, shorter windows; "
                   "shapes: fewer levels, shorter windows")
    p.add_argument("--fleet", action="append", help="steady: only this fleet (thor+spark, mixed6); repeatable (a run "
                   "narrowed by --fleet, --mix, --level or --admission reports to steady-partial.md)")
    p.add_argument("--stream", action="store_true", help="overhead: streamed 32-token answers instead of one-token "
                   "ones (what the response path costs per chunk; report overhead-stream.md)")
    p.add_argument("--mix", action="append", help="steady: only this client mix (open, capped, deadline); repeatable")
    p.add_argument("--level", action="append", type=float, help="steady, prefix: only this load level (e.g. 1.1); "
                   "repeatable")
    p.add_argument("--workload", action="append", help="prefix: only this workload (system, chat, control; "
                   "repeatable), or kv-pressure alone (engines whose KV holds two or three of eight system prompts: "
                   "bench/results/prefix-kv-pressure.md)")
    p.add_argument("--shape", action="append", help="shapes: only this shape (sharegpt, tenants, fanout); repeatable")
    p.add_argument("--report", metavar="NAME", help="steady: write bench/results/NAME.md (and NAME.png) instead of "
                   "the name the chosen cells imply")
    p.add_argument("--admission", action="append", metavar="KEY=YAML",
                   help="steady, prefix: an admission setting for the sluice arms instead of its default (e.g. backfill=true); "
                        "repeatable; the report names it")
    parser = p
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds: must be at least 1")
    if args.scenario == "replicas":
        from bench.replicas import run_replicas_bench

        return run_replicas_bench(args.quick)
    if args.scenario == "estimates":
        from bench.estimates import run_estimates_bench

        return run_estimates_bench()
    if args.scenario == "chaos":
        from bench.chaos import run_chaos_bench

        return run_chaos_bench()
    if args.scenario == "lora":
        from bench.lora import run_lora_bench

        return run_lora_bench(args.quick)
    if args.scenario == "shapes":
        from bench.shapes import SHAPES, run_shapes_bench

        if args.shape and not set(args.shape) <= set(SHAPES):
            parser.error(f"shapes: --shape is one of {', '.join(SHAPES)}")
        return run_shapes_bench(args.quick, args.shape)
    if args.scenario == "fairness":
        from bench.fairness import run_fairness_bench

        return run_fairness_bench()
    if args.scenario == "ratelimit":
        from bench.ratelimit import run_ratelimit_bench

        return run_ratelimit_bench(args.quick)
    if args.scenario == "cag4":
        from bench.cag4 import run_cag4_bench

        return run_cag4_bench()
    if args.scenario == "fleet":
        from bench.fleet import run_fleet_bench

        return run_fleet_bench()
    if args.scenario == "scale":
        from bench import scale

        try:
            sizes = scale.parse_sizes(args.sizes) if args.sizes else scale.SIZES
        except ValueError as exc:
            parser.error(str(exc))
        if args.seconds is not None and args.seconds <= 0:
            parser.error("--seconds: must be positive")
        return scale.run_scale_bench(sizes, args.seconds or scale.SECONDS, args.rounds or scale.ROUNDS)
    if args.scenario == "steady":
        from bench import steady
        from bench.steady import run_steady_bench

        if args.engines is not None and args.engines.isdigit():
            parser.error("steady: --engines is a YAML file of real llama.cpp engines")
        return run_steady_bench(args.quick, args.fleet, args.mix, args.level, args.engines,
                                _admission_settings(parser, args.admission), args.report,
                                args.rounds or steady.ROUNDS)
    if args.scenario == "overhead":
        from bench.overhead import run_overhead_bench

        return run_overhead_bench(args.engines, stream=args.stream)
    if args.scenario == "t10":
        from bench.t10 import run_t10_bench

        return run_t10_bench()
    if args.scenario == "prefix":
        from bench.prefix import KV_WORKLOAD, ROUNDS, WORKLOADS, run_prefix_bench

        if args.workload and not set(args.workload) <= {*WORKLOADS, KV_WORKLOAD}:
            parser.error(f"prefix: --workload is one of {', '.join(WORKLOADS)}, {KV_WORKLOAD}")
        if args.workload and KV_WORKLOAD in args.workload and args.workload != [KV_WORKLOAD]:
            parser.error(f"prefix: --workload {KV_WORKLOAD} runs on engines of its own: name it alone")
        return run_prefix_bench(args.quick, args.workload, args.level, _admission_settings(parser, args.admission),
                                args.rounds or ROUNDS)
    from bench.observe import run_observe_bench

    if args.engines is not None and not args.engines.isdigit():
        parser.error("observe: --engines is a number of simulated engines")
    return run_observe_bench(int(args.engines or 1000), args.cycles)


if __name__ == "__main__":
    sys.exit(main())
