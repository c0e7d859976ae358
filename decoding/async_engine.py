"""AsyncLLMEngine: the engine behind an asyncio server.

All engine mutations (add, abort, step) happen in one background task, between
steps, so the engine needs no locks; the step itself runs in a worker thread so
the event loop keeps serving requests while the model computes. A consumer that
stops iterating (a client that disconnected) aborts its request, which frees
its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator, Sequence

from medusa.decoding.engine import LLMEngine
from medusa.decoding.outputs import RequestOutput
from medusa.decoding.sampling_params import SamplingParams


_ABORTED = object()  # put on an aborted request's queue: its stream ends


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._adds: list[tuple[str, str | Sequence[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs step by step; the last one has finished=True, unless the request is
        aborted (`abort`), which ends the stream after the outputs made before it."""
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._adds.append((rid, prompt, params))
        self._start()
        finished, left = False, params.n  # n > 1: one finished output per completion
        try:
            while not finished:
                item = await queue.get()
                if item is _ABORTED:
                    finished = True  # the engine has dropped it already
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                left -= item.finished
                finished = left == 0
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:  # the consumer went away mid-stream
                self._aborts.append(rid)
                self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop the request: the engine drops it at the next step boundary and its stream ends (a consumer
        waiting on it is not left waiting). An unknown or finished id is ignored."""
        self._aborts.append(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(_ABORTED)
        self._wake.set()

    async def shutdown(self) -> None:
        """Abort everything still running and stop the background task."""
        for rid in list(self._queues):
            self._aborts.append(rid)
        self._apply_pending()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def num_pending(self) -> int:
        return len(self._adds)

    def _start(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as err:  # never leave consumers waiting forever: fail them all
                for rid, queue in list(self._queues.items()):
                    queue.put_nowait(err)
                    self.engine.abort(rid)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _apply_pending(self) -> None:
        adds, self._adds = self._adds, []
        for rid, prompt, params in adds:
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except Exception as err:  # bad input: hand the error to that request's consumer
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(err)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self.engine.abort(rid)
