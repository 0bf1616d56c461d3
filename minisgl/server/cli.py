"""`python -m minisgl serve`: the flags, and the process that runs the HTTP side."""

from __future__ import annotations

import argparse
import asyncio
import sys

from ..checks import MAX_RUNNING_REQUESTS
from ..frontend.options import add_engine_args, count, engine_kwargs, model_dir

DEFAULT_MAX_INFLIGHT = 4096  # generations queued or running; more get 503 + Retry-After


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=count(65535), default=30000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model directory's name; 'demo' for the demo model)")
    p.add_argument("--max-inflight", type=count(MAX_RUNNING_REQUESTS), default=DEFAULT_MAX_INFLIGHT,
                   help="generations queued or running at most; beyond it a request gets 503 with Retry-After")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def cmd_serve(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import ServerState, build_app
    from .engine_client import EngineClient
    from .metrics import Metrics
    from ..frontend.tokenizer import load_tokenizer

    model = model_dir(args)
    if not model.is_dir():
        raise ValueError(f"model directory {str(model)!r} does not exist")
    name = args.served_model_name or ("demo" if args.model is None else model.resolve().name)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: the server needs one to turn text into tokens")
    metrics = Metrics(name)
    client = EngineClient(model, engine_kwargs(args), metrics, args.max_inflight)
    info = await client.start()  # ValueError (exit 2) when the engine cannot be built
    try:
        config = uvicorn.Config(build_app(ServerState(client, tokenizer, name, metrics)), host=args.host,
                                port=args.port, log_level=args.log_level, lifespan="off")
        server = uvicorn.Server(config)
        print(f"minisgl serve: {name} ({info.loop} loop, {info.device}, {info.kv_tokens} KV slots) on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        await server.serve()
    finally:
        await client.stop(drain=False)
    return 0 if server.started else 2
