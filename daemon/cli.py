"""``ringstream`` command line: serve, generate, status, admin, demo."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec
import zmq

from ringstream import __version__
from ringstream.daemon.common.config import API_KEY_ENV
from ringstream.ipc.address import SOCKET_ENV, SYSTEMD_SOCKET, check_address
from ringstream.ipc.client import DEFAULT_TIMEOUT_S, GENERATE_DEFAULTS
from ringstream.ipc.protocol import to_dict

STDIN_PROMPT = "-"
"""The PROMPT argument that means: read the prompt from standard input."""
STATUS_TIMEOUT_S = 5.0
"""Silence after which ``status`` and ``admin`` give up, seconds."""
MS_PER_S = 1000


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", help=f"daemon address, ipc://PATH or tcp://HOST:PORT (default: ${SOCKET_ENV}, "
                        f"else the systemd service's {SYSTEMD_SOCKET} if present, else the per-user socket of "
                        "instance default)")
    parser.add_argument("--instance", help="daemon instance name: use its per-user socket")
    parser.add_argument("--curve-server-cert", metavar="FILE",
                        help="CURVE: the daemon's public certificate (zmq.auth format); needs --curve-cert")
    parser.add_argument("--curve-cert", metavar="FILE",
                        help="CURVE: this client's secret certificate, whose public key the daemon lists")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in its help, unless there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringstream", description="Host-local LLM inference daemon.")
    parser.add_argument("--version", action="version", version=f"ringstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = _DefaultsHelp

    serve = sub.add_parser("serve", formatter_class=defaults, help="run the daemon in the foreground")
    serve.add_argument("--config", help="TOML config file")
    serve.add_argument("--socket", help="client address: ipc://PATH or tcp://127.0.0.1:PORT")
    serve.add_argument("--instance", help="instance name (scopes socket and ring names)")
    serve.add_argument("--model", help="a Hugging Face causal-LM directory, or a model id org/name[@revision] "
                       "found in the local Hugging Face cache (downloaded there when online; default: the "
                       "built-in model)")
    serve.add_argument("--devices", help="auto | cpu | cpu,cpu | cuda:0,cuda:1")
    serve.add_argument("--engine", choices=["hf", "synthetic"],
                       help="hf (default) or synthetic (no model compute, to measure the serving layer)")
    serve.add_argument("--synthetic-step-ms", type=float, help="step time of the synthetic engine (default 1 ms)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus exporter port on 127.0.0.1 (default: off)")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API there "
                       "(a child process; a host that is not loopback needs --api-key-file or --api-key)")
    serve.add_argument("--port", type=int, metavar="PORT", help="shorthand for --http 127.0.0.1:PORT")
    serve.add_argument("--http-unix", metavar="PATH", help="serve the HTTP API on this unix socket (mode 0600)")
    serve.add_argument("--api-key-file", metavar="FILE", help="bearer token HTTP clients must send")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"the bearer token itself (default: ${API_KEY_ENV}, unless an api_key_file is set); "
                            "other users may read a command line: --api-key-file is safer")
    serve.add_argument("--served-model-name", help="the model's name in the HTTP API (default: its hub id org/name, or its "
                       "directory's name)")
    serve.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "none"],
                       help="the call format the HTTP API's tool_choice auto reads (default auto: from the chat "
                            "template)")
    serve.add_argument("--http-unknown-fields", choices=["error", "warn"],
                       help="an unknown HTTP request field: error (400 naming it, default) or warn (logged, served)")
    serve.add_argument("--http-access-log", action="store_true", default=None,
                       help="log one line per HTTP request (client, request line, status, response bytes with "
                            "headers, seconds, user agent)")
    serve.add_argument("--kv-events", dest="kv_events_endpoint", metavar="ENDPOINT",
                       help="publish KV-cache events in vLLM's format on a ZeroMQ PUB socket bound here "
                            "(tcp://HOST:PORT, worker i on PORT+i), for KV-aware routers")
    serve.add_argument("--kv-events-replay", dest="kv_events_replay_endpoint", metavar="ENDPOINT",
                       help="and a ZeroMQ ROUTER here that resends missed event batches")
    serve.add_argument("--kv-events-topic", dest="kv_events_topic", metavar="TOPIC",
                       help="the topic frame of the KV events messages (default empty)")
    serve.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weights and activations dtype (default auto: float32 on CPU, bfloat16 on CUDA)")
    serve.add_argument("--max-num-seqs", type=int, help="most requests a worker runs at once, its batch rows "
                       "(default 64)")
    serve.add_argument("--memory-utilization", type=float, help="fraction of the memory left after the weights "
                       "that a worker's KV pool may take (default 0.85)")
    serve.add_argument("--max-concurrency", type=int, help="running requests per worker (default 64, at most "
                       "--max-num-seqs)")
    serve.add_argument("--max-model-len", type=int, help="most prompt + output tokens per request "
                       "(default: the model's context)")
    serve.add_argument("--block-size", type=int, help="token positions per KV-cache block (default 16)")
    serve.add_argument("--kv-cache-bytes", type=int, help="KV pool size per worker, bytes "
                       "(default: from memory_utilization)")
    serve.add_argument("--max-num-batched-tokens", type=int, help="new tokens per engine step (default 2048)")
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                       help="do not reuse the KV blocks of common prompt prefixes")
    serve.add_argument("--queue-size", type=int, help="waiting requests at most (default 10000)")
    serve.add_argument("--log-level", type=str.lower, choices=["debug", "info", "warning", "error"],
                       help="the daemon's log level (default info)")

    gen = sub.add_parser("generate", formatter_class=defaults, help="stream one generation to stdout")
    _add_address(gen)
    gen.add_argument("prompt", nargs="?", help=f"the prompt text; {STDIN_PROMPT} reads it from standard input "
                     "(one trailing newline removed)")
    gen.add_argument("--chat", metavar="TEXT", help="instead of a prompt: a user message, rendered by the daemon "
                     f"with the model's chat template ({STDIN_PROMPT}: standard input)")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    gen.add_argument("--max-tokens", type=int, default=GENERATE_DEFAULTS["max_tokens"],
                     help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=GENERATE_DEFAULTS["temperature"], help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=GENERATE_DEFAULTS["top_p"],
                     help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=GENERATE_DEFAULTS["top_k"],
                     help="sample among the k likeliest (0 = off)")
    gen.add_argument("--seed", type=int, help="reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--priority", type=int, default=GENERATE_DEFAULTS["priority"], help="lower is served first")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument("--timeout", type=float, help="whole-request deadline, seconds (shortens the daemon's)")
    gen.add_argument("--queue-timeout", type=float, help="deadline to start, seconds")
    gen.add_argument("--json", action="store_true", help="print each chunk as a JSON line")

    status = sub.add_parser("status", formatter_class=defaults, help="live figures of a running daemon")
    _add_address(status)
    status.add_argument("--json", action="store_true")

    admin = sub.add_parser("admin", help="change live settings of a running daemon")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    admin_set = admin_sub.add_parser("set", help="KEY=VALUE ... (e.g. max_concurrency=8 preemption=false)")
    _add_address(admin_set)
    admin_set.add_argument("settings", nargs="+", metavar="KEY=VALUE")

    sub.add_parser("config", help="print an example configuration file: every setting with its default and meaning "
                   "(ringstream config > /etc/ringstream/ringstream.toml)")

    demo = sub.add_parser("demo", formatter_class=defaults, help="start a daemon on the built-in model, stream a batch, summarise, stop")
    demo.add_argument("--model", help="model directory (default: built-in model)")
    demo.add_argument("--devices", default="cpu")
    demo.add_argument("--requests", type=int, default=16)
    demo.add_argument("--max-tokens", type=int, default=48)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The (sub)commands of ``parser`` by name; empty for a parser without any."""
    return next((dict(action.choices) for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


def _takes_value(parsers: list[argparse.ArgumentParser], option: str) -> bool:
    """Whether ``option`` (``--name`` or a prefix of it, never ``--name=value``) takes a value in any of
    ``parsers``: an option unknown to all of them is taken to be a flag (argparse names it when it parses)."""
    for parser in parsers:
        action = parser._option_string_actions.get(option)
        if action is not None:
            return action.nargs != 0
    # argparse takes an unambiguous prefix for an option (--inst for --instance): so does this
    prefixed = {action.nargs != 0 for parser in parsers for name, action in parser._option_string_actions.items()
                if option.startswith("--") and name.startswith(option)}
    return prefixed == {True}


def _command_at(argv: list[str], parser: argparse.ArgumentParser) -> int | None:
    """Index in ``argv`` of the first (sub)command of ``parser`` given after options only, skipping each option's
    value (so ``--instance serve status`` finds ``status``: ``serve`` is a value); None when a positional that is
    no command comes first, or none comes. A ``--`` before it ends the options: the next word must be the
    command."""
    commands = _subparsers(parser)
    parsers = [parser, *commands.values()]
    for sub in commands.values():
        parsers += _subparsers(sub).values()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return i + 1 if i + 1 < len(argv) and argv[i + 1] in commands else None
        if not arg.startswith("-") or arg == "-":
            return i if arg in commands else None
        i += 2 if "=" not in arg and arg.startswith("--") and _takes_value(parsers, arg) else 1
    return None


def reorder_options(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``argv`` with options given before a (sub)command moved after it, where the parser expects them:
    ``ringstream --max-tokens 5 generate x`` is ``ringstream generate --max-tokens 5 x``, ``ringstream admin
    --instance x set k=v`` is ``ringstream admin set --instance x k=v``. An option's value is never taken for
    the command (``--instance serve status`` is the status of instance ``serve``); ``ringstream -- serve`` is
    ``ringstream serve``. ``--help`` and ``--version`` first stay where they are; what cannot be read so is left
    for the parser to refuse."""
    parser = parser or build_parser()
    argv = list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        at = _command_at(argv, parser)
        if at is not None:
            before = argv[:at]
            argv = [argv[at], *(before[:-1] if before[-1:] == ["--"] else before), *argv[at + 1:]]
    nested = _subparsers(_subparsers(parser).get(argv[0], parser)) if argv else {}
    if nested and len(argv) > 1 and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        at = _command_at(argv[1:], _subparsers(parser)[argv[0]])
        if at is not None:
            at += 1
            argv = [argv[0], argv[at], *argv[1:at], *argv[at + 1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(reorder_options(sys.argv[1:] if argv is None else argv, parser))
    try:
        return _run(args)
    except BrokenPipeError:
        # stdout closed early (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the client has cancelled its requests on the way out
        print(file=sys.stderr)
        return 130


def _client(args: argparse.Namespace, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A ``Client`` for the address and CURVE certificates of ``args``.

    The address: ``--socket``, else ``--instance``'s socket, else the
    library's default (``$RINGSTREAM_SOCKET``, the systemd service's socket, the
    per-user one). A missing, stale or forbidden ipc socket makes the first
    request fail at once with ``DaemonUnavailable``. Raises ValueError for an
    address that is neither ``ipc://`` nor ``tcp://`` and for a missing or bad key.
    """
    from ringstream.ipc.client import Client

    keys = {}
    if (args.curve_server_cert is None) != (args.curve_cert is None):
        raise ValueError("--curve-server-cert and --curve-cert: give both or neither")
    if args.curve_cert is not None:
        import zmq.auth

        try:
            server_public, _ = zmq.auth.load_certificate(args.curve_server_cert)
            public, secret = zmq.auth.load_certificate(args.curve_cert)
        except (OSError, ValueError) as exc:
            raise ValueError(f"CURVE certificate: {exc}") from exc
        if secret is None:
            raise ValueError(f"{args.curve_cert}: holds no secret key (give the client's .key_secret file)")
        keys = dict(curve_server_key=server_public, curve_public_key=public, curve_secret_key=secret)
    address = check_address(args.socket, "--socket") if args.socket else None
    return Client(address, instance=args.instance, timeout_s=timeout_s, **keys)


def _read_prompt(prompt: str) -> str:
    """``prompt``, or standard input's text (one trailing newline removed) for ``-``."""
    if prompt != STDIN_PROMPT:
        return prompt
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text


def _run(args: argparse.Namespace) -> int:
    match args.command:
        case "serve":
            return _serve(args)
        case "generate":
            return _generate(args)
        case "status":
            return _status(args)
        case "admin":
            return _admin(args)
        case "config":
            from ringstream.daemon.common.config_example import example_config

            sys.stdout.write(example_config())
            return 0
        case "demo":
            from ringstream.daemon.demo import run_demo

            return run_demo(args.model, args.devices, args.requests, args.max_tokens)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from ringstream.daemon.common.config import load_serve_config
    from ringstream.daemon.front.shell import serve
    from ringstream.daemon.common.proctitle import front_title, set_process_title

    overrides = dict(
        socket=args.socket, instance=args.instance, model=args.model, devices=args.devices, engine=args.engine,
        synthetic_step_ms=args.synthetic_step_ms, metrics_port=args.metrics_port,
        max_concurrency=args.max_concurrency, queue_size=args.queue_size, log_level=args.log_level,
        max_model_len=args.max_model_len, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        http=args.http, http_unix=args.http_unix, api_key_file=args.api_key_file, api_key=args.api_key,
        served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
        http_unknown_fields=args.http_unknown_fields, http_access_log=args.http_access_log,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint, kv_events_topic=args.kv_events_topic,
    )
    overrides |= dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, memory_utilization=args.memory_utilization)
    if args.port is not None:
        if args.http is not None:
            print("ringstream: give --http HOST:PORT or --port PORT, not both", file=sys.stderr)
            return 2
        overrides["http"] = f"127.0.0.1:{args.port}"
    if args.port is not None and not 0 <= args.port <= 65535:
        print(f"ringstream: --port {args.port}: a TCP port is 0 to 65535 (0: any free one)", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        config = load_serve_config(args.config, overrides)
    except ValueError as exc:
        print(f"ringstream: {exc}", file=sys.stderr)
        return 2
    set_process_title(front_title(config.instance))
    return serve(config, args.config, overrides)


def _generate(args: argparse.Namespace) -> int:
    from ringstream.ipc.client import RingstreamError

    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, priority=args.priority, stop_token_ids=args.stop_token_id,
                  ignore_eos=args.ignore_eos, timeout_s=args.timeout, queue_timeout_s=args.queue_timeout)
    wrote = False
    try:
        prompt = None
        if (args.prompt is None) == (args.chat is None):
            raise ValueError("give a prompt or --chat TEXT (one of them)")
        if args.system is not None and args.chat is None:
            raise ValueError("--system needs --chat")
        if args.chat is not None:
            params["messages"] = [*([{"role": "system", "content": args.system}] if args.system is not None else []),
                                  {"role": "user", "content": _read_prompt(args.chat)}]
        else:
            prompt = _read_prompt(args.prompt)
        with _client(args) as client:
            for chunk in client.generate(prompt, **params):
                if args.json:
                    sys.stdout.write(msgspec.json.encode(to_dict(chunk)).decode() + "\n")
                else:
                    sys.stdout.write(chunk.text)
                    wrote = wrote or bool(chunk.text)
                sys.stdout.flush()
                last = chunk
    except (RingstreamError, msgspec.ValidationError, ValueError, OverflowError, zmq.ZMQError) as exc:
        print(f"{chr(10) if wrote else ''}ringstream: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"\n[{last.finish_reason}; {last.usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


def parse_setting(item: str) -> tuple[str, object]:
    """``"max_concurrency=8"`` -> ``("max_concurrency", 8)``; values are JSON (numbers, true/false, null) or text."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{item!r}: use KEY=VALUE")
    try:
        return key, msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return key, raw


def _admin(args: argparse.Namespace) -> int:
    from ringstream.ipc.client import RingstreamError

    try:
        settings = dict(parse_setting(item) for item in args.settings)
        with _client(args, timeout_s=STATUS_TIMEOUT_S) as client:
            reply = client.admin(**settings)
    except (ValueError, RingstreamError, zmq.ZMQError) as exc:
        print(f"ringstream: {exc}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v}" for k, v in reply.settings.items()))
    for note in reply.notes:
        print(f"ringstream: note: {note}", file=sys.stderr)
    return 0


def _latency(seconds: float | None) -> str:
    """A latency for people: ``12.3 ms``, ``1.50 s``; ``-`` when there is none yet."""
    if seconds is None:
        return "-"
    return f"{seconds * MS_PER_S:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _status(args: argparse.Namespace) -> int:
    from ringstream.ipc.client import RingstreamError

    try:
        with _client(args, timeout_s=STATUS_TIMEOUT_S) as client:
            reply = client.status()
    except (RingstreamError, ValueError, zmq.ZMQError) as exc:
        print(f"ringstream: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(to_dict(reply)), indent=2).decode())
        return 0
    print(f"ringstream {reply.version}: {reply.state}, up {reply.uptime_s:.0f} s; "
          f"{reply.running} running, {reply.waiting} waiting (queue {reply.queue_size}); "
          f"{reply.requests_total} requests, {reply.tokens_generated_total} tokens")
    if reply.model:
        from ringstream.daemon.common.model_dir import model_name

        hub = model_name(reply.model)  # a hub cache snapshot: its id first, as the user named it
        print(f"  model {hub} ({reply.model})" if hub != os.path.basename(reply.model) else f"  model {reply.model}")
    else:
        print("  model unknown")
    print(f"  throughput {reply.tokens_per_s:.1f} tokens/s (last {reply.tokens_per_s_window_s:.0f} s); "
          f"TTFT p50 {_latency(reply.ttft_p50_s)}, p99 {_latency(reply.ttft_p99_s)}; "
          f"ITL p50 {_latency(reply.itl_p50_s)}, p99 {_latency(reply.itl_p99_s)}")
    for w in reply.workers:
        if w.phase not in ("", "ready"):  # starting, or down: its figures are zeros until it is ready
            print(f"  worker {w.index} {w.device} pid {w.pid} {'alive' if w.alive else 'DEAD'}: "
                  f"{w.phase} for {w.phase_s:.0f} s, served {w.requests_served}")
            continue
        print(f"  worker {w.index} {w.device} pid {w.pid} {'alive' if w.alive else 'DEAD'}: "
              f"{w.running}/{min(w.max_num_seqs, reply.max_concurrency)} running, {w.waiting} waiting, "
              f"{w.tokens_per_s:.1f} tokens/s, KV cache {w.kv_cache_usage:.0%} "
              f"({w.kv_blocks_total - w.kv_blocks_free}/{w.kv_blocks_total} blocks of {w.block_size}), "
              f"prefix hits {w.prefix_cache_hits}/{w.prefix_cache_queries} tokens, "
              f"preemptions {w.preemptions_kv_cache} KV / {w.preemptions_priority} priority, ring {w.ring_fill:.0%}, served {w.requests_served}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
