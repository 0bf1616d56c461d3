"""`python -m minisgl serve`: the flags, and the process that runs the HTTP side.

Exit codes: 0 drained (every request in flight finished), 1 the engine failed (the scheduler
process died or its engine raised: the server tells the clients in flight and exits, for a
supervisor to restart it), 2 bad input, 3 the drain timed out and what was running was aborted,
128 + N a second signal N (130: Ctrl-C) forced the exit (shutdown.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ..checks import MAX_RUNNING_REQUESTS
from ..frontend.options import Number, add_engine_args, count, engine_kwargs, model_dir
from .grammar_queue import DEFAULT_TIMEOUT_S as DEFAULT_GRAMMAR_TIMEOUT_S
from .grammar_queue import DEFAULT_WORKERS as DEFAULT_GRAMMAR_WORKERS

DEFAULT_MAX_INFLIGHT = 4096  # generations queued or running; more get 503 + Retry-After
SIGNAL_POLL_S = 0.05
FORCED_STOP_S = 0.5  # after a second signal: how long the scheduler process gets before it is killed
SCHEDULER_EXIT_S = 60.0  # after the drain: checking the pools, freeing the engine, the interpreter's exit


def default_max_connections() -> int:
    """Half this process's open-file limit (the other half: model files, the scheduler's sockets,
    logs), at most 1,024: more connections than files would stop the server accepting anyone."""
    try:
        import resource
    except ImportError:  # Windows
        return 1024
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 2))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--port", type=count(65535), default=30000, help="the port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model directory's name; 'demo' for the demo model)")
    p.add_argument("--max-inflight", type=count(MAX_RUNNING_REQUESTS), default=DEFAULT_MAX_INFLIGHT,
                   help="generations queued or running at most; beyond it a request gets 503 with Retry-After "
                   "(default: %(default)s)")
    p.add_argument("--grammar-timeout", type=Number(float, 0.001, 86400.0), default=DEFAULT_GRAMMAR_TIMEOUT_S,
                   help="seconds a request's grammar (response_format, regex, ebnf) may take to parse, and again to "
                   "compile; beyond them the request is refused (default: %(default)g)")
    p.add_argument("--grammar-workers", type=count(32), default=DEFAULT_GRAMMAR_WORKERS,
                   help="grammars parsed at once (each in a child process, killed past --grammar-timeout) and "
                   "compiled at once (each on a thread of the scheduler process); the others wait their turn "
                   "(default: %(default)s)")
    p.add_argument("--request-timeout", type=Number(float, 0.1, 86400.0), default=30.0,
                   help="seconds a client has to send a whole request (headers and body) once its connection is "
                   "open or its last response ended; then the connection is closed (default: %(default)g)")
    p.add_argument("--max-connections", type=count(1 << 20), default=default_max_connections(),
                   help="open connections at most; one beyond them is closed as it is made (default: half the "
                   "open-file limit, at most 1,024: here %(default)s)")
    p.add_argument("--write-timeout", type=Number(float, 0.1, 86400.0), default=60.0,
                   help="seconds a streaming client may read nothing before its stream ends and its request is "
                   "aborted (default: %(default)g)")
    p.add_argument("--heartbeat-timeout", type=Number(float, 1.0, 86400.0), default=30.0,
                   help="/health says 503 once the scheduler's loop has sent nothing for this many seconds (it sends "
                   "every second; a step that long, or longer, is a wedged engine; default: %(default)g)")
    p.add_argument("--drain-timeout", type=Number(float, 0.0, 86400.0), default=30.0,
                   help="on SIGTERM or Ctrl-C: seconds the requests in flight get to finish before they are aborted "
                   "(a second signal exits at once; default: %(default)g)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: %(default)s)")


def cmd_serve(args: argparse.Namespace) -> int:
    code = asyncio.run(serve(args))
    if code > 128:  # a second signal: at once, without the interpreter's clean-up (seconds with torch loaded)
        sys.stderr.flush()
        os._exit(code)
    return code


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import ServerState, build_app
    from .connections import bounded_protocol
    from .engine_client import EngineClient
    from .grammar_checker import GrammarChecker
    from .metrics import Metrics
    from .shutdown import Server
    from ..frontend.tokenizer import load_tokenizer

    model = model_dir(args)
    if not model.is_dir():
        raise ValueError(f"model directory {str(model)!r} does not exist")
    name = args.served_model_name or ("demo" if args.model is None else model.resolve().name)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: the server needs one to turn text into tokens")
    metrics = Metrics(name)
    client = EngineClient(model, engine_kwargs(args), metrics, args.max_inflight, args.grammar_timeout,
                          args.grammar_workers)
    info = await client.start()  # ValueError (exit 2) when the engine cannot be built
    state = ServerState(client, tokenizer, name, metrics, args.write_timeout, args.heartbeat_timeout,
                        GrammarChecker(args.grammar_workers))
    # uvicorn's own drain of open responses is the backstop: the drain below ends them first.
    config = uvicorn.Config(build_app(state), host=args.host, http=bounded_protocol(args.request_timeout,
                                                                                   args.max_connections),
                            port=args.port, log_level=args.log_level, lifespan="off",
                            timeout_graceful_shutdown=args.drain_timeout + FORCED_STOP_S)
    server = Server(config)
    serving = asyncio.create_task(server.serve())
    print(f"minisgl serve: {name} ({info.loop} loop, {info.device}, {info.kv_tokens} KV slots) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    print(f"minisgl serve: HTTP process pid {os.getpid()}, scheduler process pid {client.process.pid}",
          file=sys.stderr, flush=True)
    drained = False
    try:
        while not (server.should_exit or serving.done() or client.failure is not None):
            await asyncio.sleep(SIGNAL_POLL_S)
        server.should_exit = True  # on a failure: its clients are told already; they get their answer, then exit
        state.grammar_checker.close()  # a grammar still being checked is refused (503), not left to the drain's end
        drain = asyncio.create_task(client.drain(args.drain_timeout))
        while not (drain.done() or server.forced):
            await asyncio.sleep(SIGNAL_POLL_S)
        drained = drain.done() and drain.result()
        if not drained:
            drain.cancel()
            if not server.forced and client.failure is None:  # else a forced exit or the failure says why
                print(f"minisgl serve: the drain timed out after {args.drain_timeout:g} s: aborting "
                      f"{client.in_flight} generations in flight (exit code 3)", file=sys.stderr, flush=True)
            client.abort_all()  # each stream still open ends with finish_reason "abort"
        await serving
    finally:
        state.grammar_checker.close()
        code = await client.stop(FORCED_STOP_S if server.forced else SCHEDULER_EXIT_S)
    if not server.started:
        raise ValueError(f"cannot listen on {args.host}:{args.port}")
    if client.failure is not None:  # for whoever restarts it: why it stopped serving
        print(f"minisgl serve: exiting: {client.failure}", file=sys.stderr, flush=True)
    return server.exit_code(drained, code, client.failure is not None)
