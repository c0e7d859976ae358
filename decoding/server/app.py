"""The OpenAI-compatible FastAPI app: a drop-in for a vLLM endpoint.

    app = build_app(MedusaModel.from_pretrained(), "SmolLM2-135M-Instruct")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Each app owns its engines (one per decoding mode, built from the model's
weights, which they share): `speculative=false` requests run on a plain engine,
because an AsyncLLMEngine drives exactly one LLMEngine. Owning them (rather
than using `model.engine()`) keeps two apps in one process from driving the
same engine from two event loops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from itertools import groupby
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import medusa
from medusa.decoding.async_engine import AsyncLLMEngine
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.server import protocol as p
from medusa.decoding.server.errors import APIError, bad_request, from_validation
from medusa.decoding.server.jobs import Job, chat_job, completion_job, context_limit
from medusa.decoding.server.metrics import CONTENT_TYPE, ServerMetrics
from medusa.decoding.server.responses import Formatter, engine_outputs, full_response, shutting_down, stream_events
from medusa.decoding.server.tokenization import detokenize, tokenize, tokenize_request_type
from medusa.decoding.server.tool_parsers import TOOL_PARSERS

log = logging.getLogger("medusa.server")


class ServerState:
    def __init__(self, model: Any, served_name: str, api_key: str | None, max_waiting: int,
                 engine_config: EngineConfig, tool_parser: str | None = None) -> None:
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {TOOL_PARSERS} or None, got {tool_parser!r}")
        self.model, self.served_name, self.api_key = model, served_name, api_key
        self.tool_parser = tool_parser  # finds tool calls in free text (tool_choice "auto"); None: "auto" refused
        self.max_waiting, self.engine_config = max_waiting, engine_config
        self.max_model_len = context_limit(model, engine_config)
        self.engines: dict[bool, AsyncLLMEngine] = {}
        self.live: set[asyncio.Queue] = set()  # output queues of requests in flight
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, for signal handlers
        # requests are parsed and tokenized (chat templates included) off the event loop, one at a time: a
        # prompt of 400k words took the loop 4.7 s on a CPU, and every stream in flight stalled meanwhile
        self._preparing = ThreadPoolExecutor(1, thread_name_prefix="medusa-prepare")
        self.metrics = ServerMetrics(self._engine_list, self._pending)
        self.engine(True)  # build the default engine now, not on the first request

    def engine(self, speculative: bool) -> AsyncLLMEngine:
        key = speculative and self.model.heads is not None
        if key not in self.engines:
            m = self.model
            # Medusa gets the trees searched for its heads' accuracies; the server's config the rest
            config = dataclasses.replace(self.engine_config, trees=m.engine_config().trees) if key \
                else self.engine_config
            llm = LLMEngine(m.base, m.heads if key else None, config, m.tokenizer, sorted(m.eos_token_ids))
            # sampled steps' graphs too: an OpenAI request without a temperature samples at 1
            trees = llm.warmup(sampling=True)
            log.info("engine (speculative=%s): tree per batch size %s", key, bucket_runs(trees) or "by token budget")
            self.engines[key] = AsyncLLMEngine(llm)
        return self.engines[key]

    async def prepare(self, build: Callable[[], Any]) -> Any:
        """`build()` (a request's parse and tokenization) in the preparing thread; its errors are raised here."""
        if self.closing:  # the thread may be gone
            raise shutting_down()
        return await asyncio.get_running_loop().run_in_executor(self._preparing, build)

    def _engine_list(self) -> list[tuple[LLMEngine, bool]]:
        return [(e.engine, key) for key, e in list(self.engines.items())]

    def _pending(self) -> int:
        return sum(e.num_pending for e in list(self.engines.values()))

    def admit(self, job: Job) -> None:
        """503 while shutting down or when the waiting queue is full; 400 for a job that could never fit."""
        if self.closing:
            raise shutting_down()
        waiting = sum(e.engine.stats().num_waiting for e in self.engines.values()) + self._pending()
        if waiting >= self.max_waiting:
            raise APIError(503, f"the server is overloaded ({waiting} requests waiting); retry later",
                           code="server_overloaded")
        if job.num_choices > self.max_waiting:
            raise bad_request(f"{job.num_choices} completions (prompts x n) in one request is more than this "
                              f"server queues ({self.max_waiting})", "n")

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.served_name}'",
                           "model", "model_not_found")

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every request in flight (their engine requests are aborted)."""
        self.closing = True
        for queue in list(self.live):
            queue.put_nowait((None, None))

    async def shutdown(self) -> None:
        self.begin_shutdown()
        for _ in range(100):  # let the loop apply the aborts, so every KV block is returned
            if not any(e.engine.has_unfinished() for e in self.engines.values()):
                break
            await asyncio.sleep(0.02)
        for engine in self.engines.values():
            await engine.shutdown()
        self._preparing.shutdown(wait=False)


def bucket_runs(trees: dict[int, str]) -> str:
    """{bucket: tree} as runs of buckets with one tree, e.g. "1: searched-12+lookup4, 2-64: single" (a CPU
    engine has a bucket per batch size)."""
    runs = []
    for tree, run in groupby(sorted(trees.items()), key=lambda item: item[1]):
        buckets = [bucket for bucket, _ in run]
        span = str(buckets[0]) if len(buckets) == 1 else f"{buckets[0]}-{buckets[-1]}"
        runs.append(f"{span}: {tree}")
    return ", ".join(runs)


def build_app(model: Any, served_name: str, api_key: str | None = None, max_waiting: int = 256,
              engine_config: EngineConfig | None = None, tool_parser: str | None = None) -> FastAPI:
    """The app serving `model` as `served_name`; with api_key, /v1 routes need `Authorization: Bearer`;
    with tool_parser ("hermes"), tool_choice "auto" is served (the calls found in the answer's text)."""
    state = ServerState(model, served_name, api_key, max_waiting, engine_config or EngineConfig(), tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        yield
        await state.shutdown()  # uvicorn got SIGTERM: abort what runs, free the KV, stop the engine loops

    app = FastAPI(title="medusa", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.closing else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.authorize(request)
        card = p.ModelCard(id=state.served_name, max_model_len=state.max_model_len)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    # the OpenAI SDK's models.retrieve(); `path`: a served name may hold slashes ("org/model")
    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        state.authorize(request)
        state.check_model(model_id)
        return JSONResponse(p.ModelCard(id=state.served_name, max_model_len=state.max_model_len).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _authorized_body(request, state)
        job = await state.prepare(lambda: chat_job(_validated(body, p.ChatCompletionRequest, state), state.model,
                                                   state.max_model_len, state.tool_parser))
        return await _serve(request, state, job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _authorized_body(request, state)
        job = await state.prepare(lambda: completion_job(_validated(body, p.CompletionRequest, state), state.model,
                                                         state.max_model_len))
        return await _serve(request, state, job)

    # vLLM's extra routes, outside /v1 (so, as there, no API key): no engine step runs for them
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        body = await request.body()
        answer = await state.prepare(lambda: tokenize(_validated(body, tokenize_request_type(_json_or_none(body)),
                                                                 state), state.model, state.max_model_len))
        return JSONResponse(answer.model_dump())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        body = await request.body()
        answer = await state.prepare(lambda: detokenize(_validated(body, p.DetokenizeRequest, state), state.model))
        return JSONResponse(answer.model_dump())

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(p.VersionResponse(version=medusa.__version__).model_dump())


async def _authorized_body(request: Request, state: ServerState) -> bytes:
    state.authorize(request)
    return await request.body()


def _validated(body: bytes, cls: type[p.BaseModel], state: ServerState) -> Any:
    """The body as a `cls` request for the served model; a 400 (or 404 for another model) otherwise."""
    try:
        req = cls.model_validate_json(body)
    except ValidationError as err:
        raise from_validation(err) from None
    state.check_model(req.model)
    return req


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # the request model's own parse reports it
        return None


async def _serve(request: Request, state: ServerState, job: Job) -> Response:
    state.admit(job)
    tracker = state.metrics.track(sum(len(ids) for ids in job.prompts))
    fmt = Formatter(job, state.served_name, state.model.tokenizer)
    outputs = engine_outputs(state.engine(job.speculative), job, state.live)
    if job.stream:
        events = stream_events(job, outputs, fmt, tracker)
        return _ClosingStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    response = await full_response(request, job, outputs, fmt, tracker)
    if response is None:  # the client is gone: nobody reads this
        return Response(status_code=499)
    return JSONResponse(response.model_dump())


class _ClosingStream(StreamingResponse):
    """Closes the event generator however the response ends.

    Starlette cancels the streaming task when the client disconnects but leaves
    the generator to the garbage collector; closing it here aborts the engine
    request at once, so its KV blocks are freed at the next step.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _add_error_handlers(app: FastAPI) -> None:
    def error(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return error(bad_request("invalid request: " + "; ".join(str(e.get("msg")) for e in err.errors()[:3])))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)  # the trace goes to the log, never the client
        return error(APIError(500, "internal server error"))
