"""What a slot held when another prompt took it: its tokens and llama.cpp's state of them, kept in memory so that a
later prompt going on from them — an agent's earlier session, a chat left for another — is given them back rather
than evaluating them again (as llama-server's `--cache-ram`). Bounded: at most `budget` bytes, the least recently
kept or used given up first. Only the engine's thread uses it (SlotServer._admit)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from llmcli.answer.shared_prefix import shared_prefix

MIB = 2**20
KEPT_MIB = 1024  # the default budget (a SmolLM2 conversation of 4k tokens: ~90 MiB; Llama-3-8B's: ~512 MiB)


class KeptState:
    __slots__ = ("tokens", "payload")

    def __init__(self, tokens: tuple[int, ...], payload: memoryview):
        self.tokens = tokens
        self.payload = payload  # llama.cpp's state of them (KvCache.save_state's: a buffer of its own)


class KeptStates:
    def __init__(self, budget: int):
        self.budget = budget
        self._states: OrderedDict[int, KeptState] = OrderedDict()  # the least recently kept or used first
        self._next = 0
        self.held_bytes = 0
        self.kept = self.given_back = 0  # states kept, and given back to a prompt (the server's status)

    def __len__(self) -> int:
        return len(self._states)

    def keep(self, tokens: Sequence[int], payload: memoryview) -> bool:
        """Keep a slot's state (False: larger than the whole budget). A kept state these tokens go on from is given up:
        this one holds all it held."""
        if not tokens or payload.nbytes > self.budget:
            return False
        whole = tuple(tokens)
        for key, state in list(self._states.items()):
            if len(state.tokens) <= len(whole) and whole[:len(state.tokens)] == state.tokens:
                self._drop(key)
        while self.held_bytes + payload.nbytes > self.budget:
            self._drop(next(iter(self._states)))
        self._states[self._next] = KeptState(whole, payload)
        self._next += 1
        self.held_bytes += payload.nbytes
        self.kept += 1
        return True

    def best(self, prompt: Sequence[int], at_least: int) -> tuple[int, KeptState, int] | None:
        """The kept state sharing the longest prefix with `prompt`, if that is `at_least` tokens: (its key, it, how many
        it shares)."""
        found: tuple[int, KeptState, int] | None = None
        for key, state in self._states.items():
            shared = shared_prefix(state.tokens, prompt)
            if shared >= at_least and (found is None or shared > found[2]):
                found = (key, state, shared)
        return found

    def used(self, key: int, whole: bool) -> None:
        """A state was given back to a slot: `whole` (the slot holds all of it now) it is given up here, else it is kept
        as the most recently used (its tokens past what the prompt shared may serve another)."""
        self.given_back += 1
        if whole:
            self._drop(key)
        else:
            self._states.move_to_end(key)

    def refused(self, key: int) -> None:
        """llama.cpp would not take it back: given up."""
        self._drop(key)

    def _drop(self, key: int) -> None:
        state = self._states.pop(key)
        self.held_bytes -= state.payload.nbytes
