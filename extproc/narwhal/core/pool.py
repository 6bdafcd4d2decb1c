"""The engine pool and placement (v1: least in-flight among healthy engines)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig

TOKEN_ID_DIALECTS = frozenset({"vllm"})


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    healthy: bool = False
    checked: bool = False
    in_flight: int = 0
    completed: int = 0
    output_tokens: int = 0
    measurement_failures: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def endpoint(self) -> str:
        return self.config.endpoint

    @property
    def token_ids(self) -> bool:
        return self.config.dialect in TOKEN_ID_DIALECTS

    @property
    def token_accounting(self) -> str:
        return "token_ids" if self.token_ids else "unavailable"


class Pool:
    def __init__(self, engines: tuple[EngineConfig, ...]) -> None:
        self.engines = [EngineState(e) for e in engines]
        self._turn = 0

    def place(self) -> EngineState | None:
        """Least in-flight healthy engine; ties rotate so equal engines share load."""
        best: EngineState | None = None
        n = len(self.engines)
        for k in range(n):
            eng = self.engines[(self._turn + k) % n]
            if eng.healthy and (best is None or eng.in_flight < best.in_flight):
                best = eng
        if best is not None:
            self._turn = (self._turn + 1) % n
            best.in_flight += 1
        return best

    def release(self, engine: EngineState) -> None:
        engine.in_flight -= 1

    @property
    def checked(self) -> bool:
        return all(e.checked for e in self.engines)
