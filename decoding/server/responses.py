"""Run a Job on the async engine and shape what comes back as OpenAI responses or SSE chunks.

A job's choices run as separate engine requests whose outputs are merged into
one stream of (choice index, RequestOutput); choice index = prompt * n + j,
as OpenAI numbers them. Whoever stops reading that stream (a client that
disconnected, a server shutting down) closes it, which cancels the per-choice
consumers and so aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterable

from starlette.requests import Request

from medusa.decoding import byte_level
from medusa.decoding.async_engine import AsyncLLMEngine
from medusa.decoding.outputs import RequestOutput, TokenLogprob
from medusa.decoding.server import protocol as p
from medusa.decoding.server.errors import APIError
from medusa.decoding.server.jobs import Job
from medusa.decoding.server.metrics import RequestTracker
from medusa.decoding.server.tool_parsers import ToolCallParser, make_parser

log = logging.getLogger("medusa.server")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down")


async def engine_outputs(engine: AsyncLLMEngine, job: Job, live: set[asyncio.Queue]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge the job's engine streams, one per choice. `live` holds the queue while it runs, so the
    server can push a shutdown notice (choice None) into it.

    Each choice is its own n=1 engine request (seeded `SamplingParams.seed_for(j)`, as the engine seeds its n
    sequences): AsyncLLMEngine.generate ends at the first finished output, so one request with
    n > 1 would lose its other sequences' endings. Prefix caching still shares the prompt's KV.
    """
    queue: asyncio.Queue = asyncio.Queue()
    n = job.params.n

    async def pump(choice: int, ids: list[int]) -> None:
        try:  # anything that goes wrong, building the params included, must reach the reader, or it waits forever
            # choice j samples as the engine's sequence j of n would (seed -1 arrives as 2**63 - 1 and wraps)
            params = replace(job.params, n=1, seed=job.params.seed_for(choice % n))
            async for out in engine.generate(ids, params, request_id=f"{job.request_id}-{choice}"):
                queue.put_nowait((choice, out))
        except Exception as err:  # reaches the reader, which turns it into an error object
            queue.put_nowait((choice, err))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(i * n + j, ids)) for i, ids in enumerate(job.prompts) for j in range(n)]
    live.add(queue)
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if choice is None:  # ServerState.begin_shutdown
                raise shutting_down()
            if item is None:
                running -= 1
            elif isinstance(item, ValueError):  # the engine refused the request (add_request's checks)
                raise APIError(400, str(item)) from item
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        live.discard(queue)
        for task in tasks:  # cancelling a pump closes its engine stream, which aborts the request
            task.cancel()


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    parser: ToolCallParser | None = None  # a chat job with a tool plan: finds the calls in the text
    content: str = ""  # the text less the tool calls the parser took out of it
    new_content: str = ""  # the last output's share of `content`
    new_calls: list[dict[str, Any]] = field(default_factory=list)  # and its tool-call deltas
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters already streamed (completions' logprobs.text_offset)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: the prompt's


class Formatter:
    """Builds one job's response objects; tokens are decoded once for logprobs."""

    def __init__(self, job: Job, model_name: str, tokenizer: Any) -> None:
        self.job, self.model_name, self.tokenizer = job, model_name, tokenizer
        self.created = int(time.time())
        tools = job.tools
        self.choices = [_Choice(parser=make_parser(tools.mode, tools.function) if tools else None)
                        for _ in range(job.num_choices)]
        self._token_text: dict[int, str] = {}

    # ---- accumulation ------------------------------------------------------

    def add(self, choice: int, out: RequestOutput) -> None:
        acc = self.choices[choice]
        acc.text += out.new_text
        acc.num_tokens += len(out.new_token_ids)
        acc.logprobs += out.new_logprobs or []
        acc.prompt_logprobs = out.prompt_logprobs
        acc.new_content, acc.new_calls = out.new_text, []
        if acc.parser is not None:
            acc.new_content, acc.new_calls = acc.parser.feed(out.new_text)
            if out.finished:
                content, calls = acc.parser.finish()
                acc.new_content, acc.new_calls = acc.new_content + content, acc.new_calls + calls
        acc.content += acc.new_content
        if out.finished:
            acc.finish_reason, acc.stop_reason = out.finish_reason, out.stop_reason
            if out.finish_reason == "stop" and self._auto_called(acc):
                acc.finish_reason = "tool_calls"  # as vLLM: the model chose to call (named and required stay "stop")

    def _auto_called(self, acc: _Choice) -> bool:
        return acc.parser is not None and bool(acc.parser.calls) and self.job.tools.schema is None

    def usage(self) -> p.Usage:
        prompt = sum(len(ids) for ids in self.job.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _echo(self, choice: int) -> str:
        return self.job.echo[choice // self.job.params.n] if self.job.echo else ""

    # ---- full responses ----------------------------------------------------

    def response(self) -> p.ChatCompletionResponse | p.CompletionResponse:
        common = dict(id=self.job.request_id, created=self.created, model=self.model_name, usage=self.usage())
        if self.job.kind == "chat":
            choices = [p.ChatChoice(index=i, message=self._message(c),
                                    logprobs=self._chat_logprobs(c.logprobs), finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason) for i, c in enumerate(self.choices)]
            return p.ChatCompletionResponse(choices=choices, prompt_logprobs=self._prompt_logprobs(0), **common)
        choices = [p.CompletionChoice(index=i, text=self._echo(i) + c.text, logprobs=self._echoed_logprobs(i, c),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      prompt_logprobs=self._prompt_logprobs(i)) for i, c in enumerate(self.choices)]
        return p.CompletionResponse(choices=choices, **common)

    @staticmethod
    def _message(acc: _Choice) -> p.AssistantMessage:
        if acc.parser is None:
            return p.AssistantMessage(content=acc.text)
        calls = [p.ToolCall(id=c["id"], function=p.FunctionCall(name=c["name"], arguments=c["arguments"]))
                 for c in acc.parser.calls]
        # content None where the answer is only calls (OpenAI's); text beside calls is kept
        content = None if calls and not acc.content.strip() else acc.content
        return p.AssistantMessage(content=content, tool_calls=calls)

    # ---- streaming ---------------------------------------------------------

    def opening_chunks(self) -> list[p.BaseModel]:
        """Chat: each choice's first delta carries the role. Completions: the echoed prompts."""
        if self.job.kind == "chat":
            return [self._chunk(p.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}))
                    for i in range(self.job.num_choices)]
        return [self._chunk(p.CompletionChoice(index=i, text=self._echo(i))) for i in range(self.job.num_choices)
                if self._echo(i)]

    def chunk(self, choice: int, out: RequestOutput) -> p.BaseModel | None:
        """The chunk for one engine output (None when it carries nothing yet: text held back by the detokenizer)."""
        acc = self.choices[choice]
        new_logprobs = out.new_logprobs or []
        if self.job.kind == "chat":
            delta: dict[str, Any] = {"content": acc.new_content} if acc.new_content else {}
            if acc.new_calls:
                delta["tool_calls"] = acc.new_calls
            if not (delta or out.finished or new_logprobs):
                return None
            return self._chunk(p.ChatChunkChoice(index=choice, delta=delta, logprobs=self._chat_logprobs(new_logprobs),
                                                 finish_reason=acc.finish_reason, stop_reason=acc.stop_reason))
        if not (out.new_text or out.finished or new_logprobs):
            return None
        logprobs = self._completion_logprobs(acc, new_logprobs)
        acc.text_offset += len(out.new_text)
        return self._chunk(p.CompletionChoice(index=choice, text=out.new_text, finish_reason=acc.finish_reason,
                                              stop_reason=acc.stop_reason, logprobs=logprobs))

    def usage_chunk(self) -> p.BaseModel:
        return self._chunk(None, usage=self.usage())

    def _chunk(self, choice: Any, usage: p.Usage | None = None) -> p.BaseModel:
        cls = p.ChatCompletionChunk if self.job.kind == "chat" else p.CompletionResponse
        if usage is None and self.job.continuous_usage:
            usage = self.usage()  # the tokens so far, this chunk's included
        return cls(id=self.job.request_id, created=self.created, model=self.model_name,
                   choices=[choice] if choice is not None else [], usage=usage)

    # ---- logprobs ----------------------------------------------------------

    def _text(self, token_id: int) -> str:
        """The token as logprobs name it: its text, or "token_id:<id>" where the request asked (vLLM's
        return_tokens_as_token_ids, for tokens whose text alone is not unique, or not UTF-8)."""
        if self.job.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._decoded(token_id)

    def _decoded(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`: joined, a choice's tokens give its text back, a character split
        over several tokens included, whose text alone is U+FFFD); its text's UTF-8 where the tokenizer is not
        byte-level."""
        table = _byte_table(self.tokenizer)
        if table is not None and 0 <= token_id < len(table):
            return list(table[token_id])
        return list(self._decoded(token_id).encode())

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if self.job.params.logprobs is None:
            return None
        content = []
        for e in entries:
            top = [p.TopLogprob(token=self._text(t), logprob=_finite(lp), bytes=self._bytes(t)) for t, lp in e.top]
            content.append(p.ChatTokenLogprob(token=self._text(e.token_id), logprob=_finite(e.logprob),
                                              bytes=self._bytes(e.token_id), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _prompt_logprobs(self, choice: int) -> p.PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first) a dict by token id of its own entry
        and its `prompt_logprobs` most likely alternatives, each with its rank."""
        k, entries = self.job.prompt_logprobs, self.choices[choice].prompt_logprobs
        if k is None or entries is None:
            return None
        rows: p.PromptLogprobs = [None]
        for token, entry in zip(self.job.prompts[choice // self.job.params.n][1:], entries[1:]):
            row = {str(token): _prompt_entry(entry.rank, entry.logprob, self._text(token))}
            for rank, (t, lp) in enumerate(entry.top[:k], start=1):
                row.setdefault(str(t), _prompt_entry(rank, lp, self._text(t)))
            rows.append(row)
        return rows

    def _echoed_logprobs(self, choice: int, acc: _Choice) -> p.CompletionLogprobs | None:
        """A full completion's logprobs: with echo, the prompt's first (its first token has none), then the
        output's, whose text offsets start after the echoed text."""
        if not self.job.echo or self.job.params.logprobs is None:  # prompt_logprobs alone: their own field
            return self._completion_logprobs(acc, acc.logprobs)
        out = p.CompletionLogprobs()
        prompt = self.job.prompts[choice // self.job.params.n]
        self._add_logprobs(out, zip(prompt, acc.prompt_logprobs), 0)
        self._add_logprobs(out, ((e.token_id, e) for e in acc.logprobs), len(self._echo(choice)))
        return out

    def _completion_logprobs(self, acc: _Choice, entries: list[TokenLogprob]) -> p.CompletionLogprobs | None:
        if self.job.params.logprobs is None:
            return None
        out = p.CompletionLogprobs()
        self._add_logprobs(out, ((e.token_id, e) for e in entries), acc.text_offset)
        return out

    def _add_logprobs(self, out: p.CompletionLogprobs, tokens: Iterable[tuple[int, TokenLogprob | None]],
                      offset: int) -> None:
        """Append (token id, its logprob entry or None: the prompt's first token) rows, text offsets from `offset`."""
        k = self.job.params.logprobs  # the prompt's entries may hold more alternatives (prompt_logprobs)
        for token, entry in tokens:
            out.tokens.append(self._text(token))
            out.token_logprobs.append(None if entry is None else _finite(entry.logprob))
            out.top_logprobs.append(None if entry is None else self._top_row(token, entry, k))
            out.text_offset.append(offset)
            offset += len(self._decoded(token))  # offsets into the text, whatever names the tokens

    def _top_row(self, token: int, entry: TokenLogprob, k: int) -> dict[str, float]:
        """The k most likely tokens' logprobs by text, and the token written itself where it is not among them
        (so up to k + 1 entries, as OpenAI's legacy completions and vLLM give)."""
        top = entry.top[:k]
        if all(t != token for t, _ in top):
            top = [*top, (token, entry.logprob)]
        return {self._text(t): _finite(lp) for t, lp in top}


def _byte_table(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes, special tokens' text included (as `_text` decodes them), for a byte-level BPE tokenizer
    (built once per tokenizer); None for any other."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # not a fast (Rust) tokenizer: no table to build
        return None
    return byte_level.byte_table(tokenizer, skip_special=False)


def _prompt_entry(rank: int | None, logprob: float, text: str) -> p.PromptLogprob:
    return p.PromptLogprob(logprob=_finite(logprob), rank=rank, decoded_token=text)


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # OpenAI reports impossible tokens as -9999 (JSON has no -inf)


def sse(payload: p.BaseModel | dict | str) -> str:
    if isinstance(payload, p.BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


async def stream_events(job: Job, outputs: AsyncIterator, fmt: Formatter, tracker: RequestTracker
                        ) -> AsyncIterator[str]:
    """SSE events of one job, ending with `data: [DONE]`; an error mid-stream becomes an error event."""
    complete = False
    try:
        for chunk in fmt.opening_chunks():
            yield sse(chunk)
        async for choice, out in outputs:
            fmt.add(choice, out)
            tracker.output(choice, out)
            chunk = fmt.chunk(choice, out)
            if chunk is not None:
                yield sse(chunk)
        if job.include_usage:
            yield sse(fmt.usage_chunk())
        complete = True
    except APIError as err:
        yield sse(err.body())
    except Exception:
        log.exception("request %s failed mid-stream", job.request_id)
        yield sse(APIError(500, "internal error while generating").body())
    finally:
        await outputs.aclose()  # a client that left: abort now, not when the generator is collected
        if not complete:
            tracker.aborted(job.num_choices)
    yield "data: [DONE]\n\n"


async def full_response(request: Request, job: Job, outputs: AsyncIterator, fmt: Formatter,
                        tracker: RequestTracker) -> p.BaseModel | None:
    """Run the job to the end; None if the client disconnected first (its requests are aborted)."""

    async def drain() -> None:
        try:
            async for choice, out in outputs:
                fmt.add(choice, out)
                tracker.output(choice, out)
        finally:
            await outputs.aclose()

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server shutdown)
        work.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if work not in done:  # the client left: cancelling the drain aborts the engine requests
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        tracker.aborted(job.num_choices)
        return None
    try:
        work.result()
    except BaseException:
        tracker.aborted(job.num_choices)
        raise
    return fmt.response()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
