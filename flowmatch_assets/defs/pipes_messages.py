"""Reading the training process's Pipes messages whole.

Dagster's file message reader (1.13: ``PipesFileMessageReader``, under the default
``PipesTempFileMessageReader``) tails the messages file with ``readline()`` and parses whatever
it returns. A message the training process is still writing (a large one: the loss curve's
picture, ~100 KB of base64) comes back half-written; ``json.loads`` raises, the reader thread
dies and every later message is lost, so a run that trained to the end read as "the training
process ended without reporting a TrainResult" (seen in `flowmatch demo`: step 2,000 done, the
exported pipeline written, the run FAILED). :class:`WholeLinesMessageReader` speaks the same
protocol (the writer is dagster_pipes' default: one JSON message a line, appended to the file)
and hands a line over only once its newline is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter


class WholeLinesMessageReader(dg.PipesMessageReader):
    """Messages through a temporary file, as Dagster's default reader, each parsed once whole.
    A message that is not JSON (a writer killed mid-line) is reported as Pipes' framework
    error, and reading goes on."""

    def __init__(self, poll_s: float = 0.01):
        self.poll_s = poll_s

    @contextlib.contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        with tempfile.TemporaryDirectory(prefix="flowmatch-pipes-") as tmp:
            path = os.path.join(tmp, "messages")
            open(path, "w", encoding="utf-8").close()
            closed = threading.Event()
            reader = threading.Thread(target=self._read, args=(path, handler, closed), daemon=True)
            reader.start()
            try:
                yield {
                    PipesDefaultMessageWriter.FILE_PATH_KEY: path,
                    PipesDefaultMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: False,
                }
            finally:
                closed.set()
                reader.join()

    def _read(self, path: str, handler, closed: threading.Event) -> None:
        for line in whole_lines(path, closed.is_set, self.poll_s):
            try:
                message = json.loads(line)
            except ValueError:
                handler.report_pipes_framework_exception(
                    f"{type(self).__name__}: a message that is not JSON ({len(line)} chars)",
                    sys.exc_info(),
                )
                continue
            handler.handle_message(message)

    def no_messages_debug_text(self) -> str:
        return "Attempted to read messages from a local temporary file (whole lines only)."


def whole_lines(path: str, stop: Callable[[], bool], poll_s: float = 0.01) -> Iterator[str]:
    """The lines appended to ``path``, each once its newline is written; when ``stop()`` holds
    and nothing more is there, a last line without its newline (its writer died) and the end."""
    part = ""
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.readline()
            if chunk:
                part += chunk
                if part.endswith("\n"):
                    yield part
                    part = ""
            elif stop():  # the writer is done: what it wrote after the last read, then the end
                rest = part + f.read()
                yield from (ln + "\n" for ln in rest.split("\n")[:-1])
                if not rest.endswith("\n") and rest:
                    yield rest.rsplit("\n", 1)[-1]
                return
            else:
                time.sleep(poll_s)
