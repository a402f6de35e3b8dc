"""``baton gateway``: the OpenAI-compatible HTTP server in front of decode workers.

Imports no torch (the gateway image has none): the tokenizer comes from the model folder, the
GGUF's converted folder, or the GGUF's own metadata. ``python -m baton_gateway.cli`` runs it
without the rest of the ``baton`` command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from baton import tracing

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
DEFAULT_DECODE_ADDR = "127.0.0.1:50052"


def add_parser(subparsers: Any) -> None:
    """Register ``gateway`` on the ``baton`` command's subparsers."""
    p = subparsers.add_parser(
        "gateway",
        help="start the OpenAI-compatible HTTP gateway",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_gateway)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0: any free one)")
    p.add_argument(
        "--decode-addr",
        action="append",
        default=None,
        help=f"decode worker gRPC address (repeatable; default {DEFAULT_DECODE_ADDR})",
    )
    p.add_argument(
        "--prefill-addr",
        action="append",
        default=None,
        help="prefill worker gRPC address (repeatable; none: every prompt is prefilled locally "
        "unless the kvstore lists prefill workers)",
    )
    p.add_argument(
        "--kvstore",
        default=None,
        help="kvstore address: discover workers there and route by its prefix index",
    )
    p.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=256,
        help="prompt tokens not cached on the chosen decode worker above which a prefill "
        "worker prefills the prompt",
    )
    p.add_argument(
        "--max-remote-prefill-wait-ms",
        type=float,
        default=None,
        help="prefill a prompt on its decode worker instead when the prefill worker's queue "
        "would keep it waiting longer than this (estimated from the prefill speed seen so far) "
        "and the decode worker has less prefill queued (default: always remote)",
    )
    p.add_argument(
        "--model", default=None, help="model path the tokenizer comes from (default: SmolLM2)"
    )
    tracing.add_otlp_argument(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model id clients use (default: the worker's); with several, requests may name "
        "any, responses use the first unless the request named another",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("BATON_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $BATON_API_KEY, else "
        "vLLM's $VLLM_API_KEY)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the worker's)"
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the decode workers at startup",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no access log line per request"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a local folder (or .gguf file) whose tokenizer to use instead of the model's",
    )
    add_frontend_arguments(p)


def add_frontend_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``baton serve`` passes on to its gateway (vLLM's names): tool calling,
    reasoning, the chat template, the default sampling params, HTTP (CORS, TLS, root path),
    and vLLM's other frontend flags (``vllm_flags.FRONTEND_FLAGS``)."""
    from baton_engine.vllm_flags import FRONTEND_FLAGS, add_flags
    from baton_gateway.chat import CONTENT_FORMATS
    from baton_gateway.reasoning import REASONING_PARSERS
    from baton_gateway.tools import TOOL_PARSERS

    p.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    p.add_argument(
        "--uds",
        default=None,
        help="serve HTTP on this Unix domain socket instead of --host/--port",
    )
    p.add_argument(
        "--root-path",
        default=None,
        help="the path prefix under which a proxy that strips it serves the gateway (ASGI "
        "root_path: requests still come to /v1/...)",
    )
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", default=None, help="... and this certificate (chain)")
    p.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates"
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="whether clients need a certificate (Python's ssl.CERT_*: 0 none, 2 required)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (a template is code the gateway runs; "
        "without this flag such a request is a 400, as in vLLM)",
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streamed completions end with a usage chunk even when the request does not ask "
        "for one (stream_options.include_usage)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="the chat template's arguments for requests that do not set them, as JSON: "
        "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)",
    )

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto"; needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are found in the model's text with --enable-auto-tool-choice",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="return a thinking model's <think> text as the message's reasoning, apart from "
        "its content",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="chat template for chat requests, a file or the template itself (default: the "
        "model's)",
    )
    p.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="how a message's content reaches the chat template: string (text parts joined by "
        "newlines) | openai (a list of {type, text} parts) | auto (openai for a template that "
        "loops over a message's content, else string)",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='a request\'s tools do not reach the chat template when its tool_choice is "none"',
    )
    p.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat completions' messages when the request adds a generation prompt "
        "(otherwise the role of the request's last message)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help="CORS: the origins browsers may call from, as a JSON list",
    )
    p.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], help="CORS: allowed methods"
    )
    p.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], help="CORS: allowed headers"
    )
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="an ASGI middleware class or an async HTTP middleware function (request, "
        "call_next) to wrap the API in, by import path (module.name; vLLM's); repeat for more, "
        "the last outermost",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=256,
        help="Responses API: how many stored responses (store=true) this gateway keeps in "
        "memory for previous_response_id and GET /v1/responses/{id}, the most recent first "
        "(0: none)",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name every token 'token_id:{id}' (for tokens whose text is not valid "
        "UTF-8 on its own)",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the request's, else a new id (which the "
        "response's id then ends with)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="where requests' default sampling params come from: 'auto' (the model folder's "
        "generation_config.json), 'vllm' (none: temperature 1.0 and so on), or a folder",
    )
    p.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help="default sampling params that win over the generation config, as JSON: "
        "'{\"temperature\": 0.5}'",
    )
    add_flags(p, FRONTEND_FLAGS)


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError("not a JSON list of strings")
    return parsed


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return parsed


def generation_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Requests' default sampling params (vLLM's ``--generation-config``), checked; logged
    when there are any, as vLLM does. Raises ModelLoadError or InvalidRequestError."""
    from baton_engine import model_files
    from baton_engine.sampling_params import SamplingParams

    defaults = model_files.generation_defaults(
        args.model, args.generation_config, args.override_generation_config
    )
    SamplingParams(**defaults)  # raises InvalidRequestError for a value out of range
    if defaults:
        logger.info(
            "default sampling params from the generation config: %s (--generation-config vllm "
            "turns them off)",
            defaults,
        )
    return defaults


def check_tls(args: argparse.Namespace) -> None:
    """HTTPS needs both ``--ssl-keyfile`` and ``--ssl-certfile``, readable (checked before
    anything starts). Raises InvalidRequestError."""
    from baton_engine.errors import InvalidRequestError

    given = [f for f in ("ssl_keyfile", "ssl_certfile") if getattr(args, f)]
    if len(given) == 1:
        raise InvalidRequestError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            flag = "--" + name.replace("_", "-")
            raise InvalidRequestError(f"{flag}: no such file: {path}")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the file's text, or ``value`` itself when it looks like
    a template; checked for Jinja syntax. Raises InvalidRequestError otherwise."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from baton_engine.errors import InvalidRequestError

    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise InvalidRequestError(f"--chat-template: no such file: {value}")
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise InvalidRequestError(f"--chat-template is not a valid Jinja template: {e}") from e
    return template


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser "auto" tool choice uses, or None when it is off."""
    from baton_engine.errors import InvalidRequestError

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidRequestError("--enable-auto-tool-choice requires --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _env_flag(name: str) -> bool:
    """Whether ``BATON_<name>`` or vLLM's ``VLLM_<name>`` is set to 1 or true."""
    return any(
        os.environ.get(f"{who}_{name}", "").lower() in ("1", "true") for who in ("BATON", "VLLM")
    )


def run_gateway(args: argparse.Namespace) -> int:
    """Load the tokenizer, connect to the workers, serve until SIGINT/SIGTERM; return 0.

    Prints ``baton gateway ready on http://HOST:PORT`` (``unix:PATH`` with ``--uds``) once it
    accepts requests (launchers wait for that line). Raises ModelLoadError if the tokenizer
    cannot be loaded.
    """
    from baton_engine.errors import InvalidRequestError
    from baton_engine.model_files import load_model_tokenizer, load_named_tokenizer
    from baton_engine.vllm_flags import FRONTEND_FLAGS, check_flags
    from baton_gateway.server import CorsPolicy, GatewayConfig, create_app

    check_flags(vars(args), FRONTEND_FLAGS)
    check_tls(args)

    if args.max_model_len is not None and args.max_model_len < 1:
        raise InvalidRequestError("--max-model-len must be at least 1")
    wait_ms = args.max_remote_prefill_wait_ms
    if wait_ms is not None and not wait_ms >= 0:
        raise InvalidRequestError("--max-remote-prefill-wait-ms must be at least 0")
    parser = tool_call_parser(args)
    chat_template = load_chat_template(args.chat_template)
    if args.tokenizer is not None:
        tokenizer = load_named_tokenizer(args.tokenizer)
    else:
        tokenizer = load_model_tokenizer(args.model)
    config = GatewayConfig(
        decode_addrs=tuple(args.decode_addr or ([] if args.kvstore else [DEFAULT_DECODE_ADDR])),
        prefill_addrs=tuple(args.prefill_addr or []),
        kvstore_address=args.kvstore,
        remote_prefill_threshold=args.remote_prefill_threshold,
        max_remote_prefill_wait_ms=args.max_remote_prefill_wait_ms,
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name or ())[1:],
        api_key=args.api_key or None,
        max_model_len=args.max_model_len,
        connect_timeout_s=args.connect_timeout,
        tool_call_parser=parser,
        chat_template=chat_template,
        chat_template_kwargs=args.default_chat_template_kwargs,
        chat_template_content_format=args.chat_template_content_format,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        force_include_usage=args.enable_force_include_usage,
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        reasoning_parser=args.reasoning_parser,
        generation_defaults=generation_defaults(args),
        tokens_as_ids=args.return_tokens_as_token_ids,
        max_stored_responses=args.max_stored_responses,
        request_id_headers=args.enable_request_id_headers,
        runtime_lora_updating=_env_flag("ALLOW_RUNTIME_LORA_UPDATING"),
        dev_mode=_env_flag("SERVER_DEV_MODE"),
        middleware=tuple(args.middleware),
        cors=CorsPolicy(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
    )
    app = create_app(config, tokenizer)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        uds=args.uds,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        # Open streams get this long to finish at shutdown; then they are cut (and their gRPC
        # calls cancelled), so SIGTERM never hangs on a long generation.
        timeout_graceful_shutdown=5,
    )
    tracing.setup("baton-gateway", args.otlp_endpoint)
    server = _Server(uv_config)
    server.scheme = "https" if args.ssl_certfile else "http"
    try:
        server.run()
    finally:
        tracing.shutdown()
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn's server, printing the ready line once it listens (port 0 resolved)."""

    scheme = "http"

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started or self.should_exit:
            return
        for server in self.servers:
            for sock in server.sockets or []:
                if sock.family == socket.AF_UNIX:
                    print(f"baton gateway ready on unix:{sock.getsockname()}", flush=True)
                    return
                host, port = sock.getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                print(f"baton gateway ready on {self.scheme}://{host}:{port}", flush=True)
                return


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m baton_gateway.cli [gateway] ARGS``: the gateway alone, without ``baton``."""
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["gateway"]:
        args_list = args_list[1:]
    parser = argparse.ArgumentParser(prog="baton gateway", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(args_list)
    from baton_engine.errors import BatonError

    try:
        return run_gateway(args)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
