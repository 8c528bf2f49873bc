"""Programs opened when a step first needs them, once per process for each distinct graph file.

Opening a program is the costly part of loading artifacts (deserializing a `.pt2`, loading an
AOTInductor package, compiling an HLO module on XLA:CPU: ~2 s each for the tiny presets on two
cores), and a run uses few of its buckets: a one-prompt run of the quick start's 8 programs steps
through 2. The manifest has verified every file's hash before anything loads, and each loader
still checks what it can refuse cheaply (an archive's entries, a program's signature) up front;
only the opening waits for the first step.

A program is a pure function of its file's bytes (weights and the KV pool are call arguments), so
engines of one process share it by the file's sha256: the tests' and a server's engines over the
same artifacts open each program once.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

Program = TypeVar("Program")

_OPENED: dict[Hashable, object] = {}
_OPENING = threading.Lock()


def opened_once(key: Hashable, open_program: Callable[[], Program]) -> Callable[[], Program]:
    """A getter of the program `open_program` opens, called the first time any getter of `key`
    (a file's sha256 with whatever else the opened object depends on) is called in this process."""

    def program() -> Program:
        opened = _OPENED.get(key)
        if opened is None:
            with _OPENING:  # one opening per key, even from the server's and a test's threads at once
                opened = _OPENED.get(key)
                if opened is None:
                    opened = _OPENED[key] = open_program()
        return opened

    return program
