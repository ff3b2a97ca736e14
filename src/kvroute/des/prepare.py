"""A request's prompt, turned ahead of time into what the simulator needs of it.

What the simulator derives from a prompt depends on the prompt alone: its token ids (the
engine runs them), their block hashes at the engines' block size (the engines' keys,
exact mode's and the ceilings'), and the text keys approximate mode routes on. On a long
trace that is a third of a run: the whole Mooncake conversation trace makes 145M token
ids and keys 1.2 GB of text. None of it depends on routing, so ``PreparedSessions`` makes
it in a child process on another core while the simulation runs, up to a pipe's buffer
of requests ahead, and hands each request's ``Prepared`` over when the request is sent.
The child runs the same ``Preparer`` the inline path runs (one core, no ``fork``, or
``parallel=False``), so a run's results are the same bytes either way
(tests/des/test_prepare.py).

The child sends each spec without its text (the simulator needs only its ``Prepared``),
and of the ids only what the engines read once given the hashes (all of them, as 8-byte
integers, where the engines publish KV events), so a request crosses the pipe as its keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import sys
import traceback
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvroute.bench.spec import RequestSpec, Session
from kvroute.common.hashing import ROOT_SEED, token_block_hashes
from kvroute.core.keys import text_route_keys
from kvroute.des.prompts import PromptEncoder
from kvroute.engine.request import HashedPrompt

try:
    import fcntl
except ImportError:  # not on a Unix: the pipe keeps its size
    fcntl = None  # type: ignore[assignment]
# resizing a pipe is Linux's (Python 3.10+); elsewhere the pipe keeps its size
_SET_PIPE_SIZE: int | None = getattr(fcntl, "F_SETPIPE_SZ", None)

SessionsOf = Callable[[], Iterable[Session]]  # a workload's ``sessions``
# a message from the child: this many requests, or fewer holding this many prompt tokens
BATCH_REQUESTS = 64
BATCH_TOKENS = 1 << 15  # 256 KB of ids where all are sent, ~32 KB of keys where not
PIPE_BYTES = 1 << 20  # the pipe's buffer where Linux allows: the child runs batches ahead


@dataclass(frozen=True, slots=True)
class Prepared:
    """One request's prompt as the simulator uses it."""

    # 64-bit ids in an array where they fit (no int objects), or only the ids past the
    # last full block (``HashedPrompt``) where the engines need no more
    token_ids: array[int] | list[int] | HashedPrompt
    token_hashes: list[int]  # chained keys of the full blocks at the engines' block size
    text_keys: list[int]  # approximate mode's keys of the text, at ``key_block_size``
    text_bytes: int  # UTF-8 length of the text (approximate mode's length estimate)
    key_block_size: int  # tokens a block of ``text_keys`` stands for


class Preparer:
    """``Prepared`` of a spec: token ids (the workload's, else the built-in tokenizer's
    through a chunk cache), their keys, and the text's keys, all for ``block_size``;
    ``keep_ids`` False: only the ids the engines read of a hashed prompt (engines that
    publish no KV events, whose BlockStored carry every id)."""

    def __init__(
        self, block_size: int, encoder: PromptEncoder | None = None, *, keep_ids: bool = True
    ) -> None:
        self.block_size = block_size
        self.encoder = encoder or PromptEncoder()
        self.keep_ids = keep_ids

    def __call__(self, spec: RequestSpec) -> Prepared:
        text = spec.prompt_text()
        given = spec.prompt_token_ids  # the workload's, when it made them with the text
        ids: array[int] | list[int] = given if given is not None else self.encoder.encode(text)
        try:
            ids = array("Q", ids)
        except (OverflowError, TypeError):
            ids = list(ids)  # ids past 64 bits: kept as ints, hashed as the engine does
        hashes = token_block_hashes(ids, self.block_size, ROOT_SEED)
        keys, text_bytes = text_route_keys(text, self.block_size, ROOT_SEED)
        kept = ids if self.keep_ids else HashedPrompt.of(ids, self.block_size)
        return Prepared(kept, hashes, keys, text_bytes, self.block_size)


class PreparedSessions:
    """The sessions of ``sessions_of()``, each request's ``Prepared`` made ahead: in a
    child process when ``parallel`` (None: when ``fork`` and a second core are there),
    else inline. Iterate for the sessions; ``take(spec)`` gives a spec's ``Prepared``
    once, when it is sent; ``close()`` stops the child (a run may end before the
    workload does)."""

    def __init__(
        self,
        sessions_of: SessionsOf,
        prepare: Preparer,
        *,
        parallel: bool | None = None,
    ) -> None:
        if parallel is None:
            parallel = _spare_core()
        self._prepared: dict[str, Prepared] = {}
        self._child: _Child | None = None
        if parallel:
            self._child = _Child(sessions_of, prepare)
            self._source: Iterator[tuple[Session, list[Prepared]]] = iter(self._child)
        else:
            self._source = ((s, [prepare(spec) for spec in s]) for s in sessions_of())

    def __iter__(self) -> PreparedSessions:
        return self

    def __next__(self) -> Session:
        session, prepared = next(self._source)
        for spec, p in zip(session, prepared, strict=True):
            self._prepared[spec.request_id] = p
        return session

    def take(self, spec: RequestSpec) -> Prepared:
        return self._prepared.pop(spec.request_id)

    def close(self) -> None:
        if self._child is not None:
            self._child.close()


def _spare_core() -> bool:
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores >= 2


def _textless(spec: RequestSpec) -> RequestSpec:
    """``spec`` without its prompt's text and ids (what the parent keeps of it)."""
    if spec.messages is not None:
        return dataclasses.replace(spec, messages=())
    return dataclasses.replace(spec, prompt="", prompt_token_ids=None)


class _Child:
    """A forked process that walks the sessions and sends them prepared, a batch at a
    time; the pipe's back-pressure keeps it at most its buffer ahead (memory bounded)."""

    def __init__(self, sessions_of: SessionsOf, prepare: Preparer) -> None:
        ctx = multiprocessing.get_context("fork")  # the workload as it is, not pickled
        self._conn, send = ctx.Pipe(duplex=False)
        if _SET_PIPE_SIZE is not None:
            with contextlib.suppress(OSError):  # above the system's limit: keep its size
                fcntl.fcntl(send.fileno(), _SET_PIPE_SIZE, PIPE_BYTES)
        self._proc = ctx.Process(
            target=_produce,
            args=(self._conn, send, sessions_of, prepare),
            name="kvroute-prepare",
            daemon=True,
        )
        for stream in (sys.stdout, sys.stderr):  # else the child flushes their copies too
            stream.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns on forking a process with threads (a progress bar's): a
            # lock another thread held stays held in the child. This child only runs the
            # workload's pure generator and the Preparer and writes to its pipe; it takes
            # none of the locks those threads use (stdout, logging).
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            self._proc.start()
        send.close()  # the child's end: EOF here when the child goes

    def __iter__(self) -> Iterator[tuple[Session, list[Prepared]]]:
        while True:
            try:
                batch = self._conn.recv()
            except EOFError:
                raise RuntimeError("the simulator's prompt process died") from None
            if batch is None:
                return
            if isinstance(batch, str):
                raise RuntimeError(f"preparing the workload's prompts failed:\n{batch}")
            yield from batch

    def close(self) -> None:
        self._conn.close()  # a child blocked on sending gets a broken pipe and ends
        self._proc.join(timeout=5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _produce(
    parents: Connection, conn: Connection, sessions_of: SessionsOf, prepare: Preparer
) -> None:
    parents.close()  # the fork's copy of the parent's end: else the pipe never breaks
    batch: list[tuple[Session, list[Prepared]]] = []
    try:
        try:
            requests = tokens = 0
            for session in sessions_of():
                prepared = [prepare(s) for s in session]
                batch.append((tuple(map(_textless, session)), prepared))
                requests += len(session)
                tokens += sum(len(p.token_ids) for p in prepared)
                if requests >= BATCH_REQUESTS or tokens >= BATCH_TOKENS:
                    conn.send(batch)
                    batch, requests, tokens = [], 0, 0
        except Exception:
            conn.send(batch)  # the sessions before the failure, then why
            conn.send(traceback.format_exc())
            return
        conn.send(batch)
        conn.send(None)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent stopped reading: its run is over
    finally:
        conn.close()
