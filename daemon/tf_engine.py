"""The transformers engine: a causal LM computed straight from the weight store, one fenced step at a time.

Every forward pass runs under the store's version fence (``FenceReader.consistent``): a step
during which the daemon wrote (``changed``) is thrown away, the KV cache cropped back to where
it was, and the step run again once the fence is stable, so no token ever comes from a
half-written version.  Each step reports the version it ran on; a response's versions are those
of its first and last steps.  A fence that stays odd (a daemon killed mid-write) makes requests
wait ``fence_wait_s`` and then fail (``FenceUnavailable``, HTTP 503), never read torn weights.

Requests are served one step at a time under one lock (no batching).  A small LRU prefix cache
keeps the KV state of recent prompts keyed by (version, prompt tokens): an entry of another
version is never used, and ``commit(v, flush_cache=True)`` drops them.  ``pause``/``resume``
hold requests between steps (the daemon's in-place activations), for at most ``pause_limit_s`` from
when the pause began.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch

from patchswarm.daemon.engine import Observed
from patchswarm.daemon.tf_model import build_model, config_dtype, load_config, load_tokenizer

T = TypeVar("T")
DEFAULT_MAX_TOKENS_LIMIT = 1024
MAX_PROMPT_TOKENS = 8192
DEFAULT_FENCE_WAIT_S = 10.0
DEFAULT_PAUSE_LIMIT_S = 60.0


class FenceUnavailable(Exception):
    """No stable version to compute with (a write that never ended, or no version yet): HTTP 503."""


class VersionMismatch(Exception):
    """The store does not hold the version asked for."""

    def __init__(self, wanted: int, held: int | None) -> None:
        super().__init__(f"the store holds version {held}, not {wanted}")
        self.wanted, self.held = wanted, held


class Fence(Protocol):
    def consistent(self, fn: Callable[[], T], *, timeout: float | None = None) -> Observed[T]: ...


class WeightsView(Protocol):
    """What the engine needs of ``daemon.engine.EngineView`` (or of ``StaticWeights``)."""

    @property
    def fence(self) -> Fence: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def read_version(self) -> tuple[int, bytes] | None: ...


class _StaticFence:
    def consistent(self, fn: Callable[[], T], *, timeout: float | None = None) -> Observed[T]:
        return Observed(fn(), 0, None, False)


class StaticWeights:
    """Weights from DIR's safetensors, version 0 for ever (standalone serving, for comparison)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._fence = _StaticFence()

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, device: str = "cpu") -> StaticWeights:
        from patchswarm.daemon.checkpoint import read_checkpoint

        dtype = config_dtype(load_config(checkpoint))
        tensors = read_checkpoint(checkpoint).tensors
        out = {n: (t.to(dtype) if t.is_floating_point() else t).to(device).contiguous() for n, t in tensors.items()}
        return cls(out)

    @property
    def fence(self) -> Fence:
        return self._fence

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def read_version(self) -> tuple[int, bytes] | None:
        return 0, b""


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token and the version of the weights whose logits chose it."""

    index: int
    token: int
    version: int


@dataclass
class _Entry:
    cache: Any  # a transformers DynamicCache holding the prompt's KV
    logits: torch.Tensor  # of the prompt's last position


class PrefixCache:
    """LRU of prompt KV states keyed by (version, tokens); ``capacity`` 0 keeps nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, version: int, ids: Sequence[int]) -> tuple[int, _Entry] | None:
        """The entry of ``version`` whose tokens are the longest prefix of ``ids`` (its length too)."""
        best: tuple[int, tuple[int, ...]] | None = None
        for key in self._entries:
            v, toks = key
            longer = best is None or len(toks) > len(best[1])
            if v == version and len(toks) <= len(ids) and longer and tuple(ids[: len(toks)]) == toks:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return len(best[1]), self._entries[best]

    def put(self, version: int, ids: Sequence[int], entry: _Entry) -> None:
        if self.capacity <= 0:
            return
        self._entries[(version, tuple(ids))] = entry
        self._entries.move_to_end((version, tuple(ids)))
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def keep_only(self, version: int) -> int:
        """Drop every entry of another version; how many went."""
        gone = [k for k in self._entries if k[0] != version]
        for k in gone:
            del self._entries[k]
        return len(gone)


@dataclass
class _Seq:
    """One request's state: its tokens, its KV cache and the logits for the next token."""

    ids: list[int]
    cache: Any = None
    logits: torch.Tensor | None = None
    version: int = -1


class TfEngine:
    """Generation over a ``WeightsView`` with a transformers model whose parameters are its tensors.

    ``inside_step`` (tests) is called in every forward pass after the model ran, before the fence is
    read again: a test writes the store there to race a step.  ``threaded``: forward passes in a
    worker thread so the event loop keeps answering (pause, health) while a step runs."""

    def __init__(
        self,
        view: WeightsView,
        checkpoint: Path,
        *,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        prefix_cache_entries: int = 16,
        fence_wait_s: float = DEFAULT_FENCE_WAIT_S,
        pause_limit_s: float = DEFAULT_PAUSE_LIMIT_S,
        threaded: bool = True,
        model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view = view
        self.checkpoint = checkpoint
        self.config = load_config(checkpoint)
        self.model: Any = cast(Any, build_model(self.config, view.tensors()))
        # transformers 5.x renames the forward's ``past_key_values`` to ``cache`` (the old name warns).
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.device = next(self.model.parameters()).device
        self.tokenizer = load_tokenizer(checkpoint)
        self.eos_ids = self._eos_ids()
        embeddings: Any = self.model.get_input_embeddings()
        self.vocab = int(embeddings.weight.shape[0])
        self.max_positions = int(getattr(self.config, "max_position_embeddings", MAX_PROMPT_TOKENS) or 0)
        self.max_tokens_limit = max_tokens_limit
        self.fence_wait_s = fence_wait_s
        self.pause_limit_s = pause_limit_s
        self.commit_wait_s = 10.0  # how long a commit waits for its version in the store
        self.threaded = threaded
        self.model_name = model_name or checkpoint.resolve().name
        self.prefix = PrefixCache(prefix_cache_entries)
        self.inside_step: Callable[[], None] | None = None
        self.served: int | None = None
        self.on_served: Callable[[int], None] | None = None  # the CLI acknowledges to the daemon
        self.redone = 0  # steps thrown away because the daemon wrote during them
        self._running = asyncio.Event()
        self._running.set()
        self._clock = clock
        self._paused_at: float | None = None  # when the pause in force began
        self._lock = asyncio.Lock()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids |= {i for i in src if isinstance(i, int)}
        return ids

    # ---------------------------------------------------------------- pause, versions

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def pause(self) -> None:
        """Hold requests between steps; returns once the step in progress (if any) has finished."""
        self._paused_at = self._clock()  # (a pause again, say by a restarted daemon, starts a new limit)
        self._running.clear()
        async with self._lock:
            pass

    def resume(self) -> None:
        self._running.set()
        self._paused_at = None

    def note_served(self, version: int) -> None:
        """Record ``version`` as served (the store's fence shows it ready) and say so once."""
        if self.served is None or version > self.served:
            self.served = version
            if self.on_served is not None:
                self.on_served(version)

    async def commit(self, version: int, flush_cache: bool, timeout_s: float | None = None) -> int:
        """Wait (bounded) until the fence reads ``version`` ready; drop other versions' prefixes if asked;
        record it served.  VersionMismatch when the store holds another version after the wait."""
        deadline = time.monotonic() + (self.commit_wait_s if timeout_s is None else timeout_s)
        while True:
            got = self.view.read_version()
            held = None if got is None else got[0]
            if held == version:
                break
            if (held is not None and held > version) or time.monotonic() >= deadline:
                raise VersionMismatch(version, held)
            await asyncio.sleep(0.002)
        if flush_cache:
            async with self._lock:
                self.prefix.keep_only(version)
        self.note_served(version)
        return version

    # ---------------------------------------------------------------- fenced steps

    def _fenced(self, fn: Callable[[], T], undo: Callable[[], None]) -> tuple[T, int]:
        """Run ``fn`` under the fence until a run saw no write; ``undo`` after each discarded run."""
        deadline = time.monotonic() + self.fence_wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FenceUnavailable(f"no stable weight version for {self.fence_wait_s:g} s (daemon mid-write?)")
            try:
                seen = self.view.fence.consistent(fn, timeout=left)
            except TimeoutError:
                raise FenceUnavailable(
                    f"the weight store stayed mid-write for {self.fence_wait_s:g} s (daemon gone?)"
                ) from None
            if not seen.changed and seen.version is not None:
                return seen.value, seen.version
            undo()
            if seen.changed:
                self.redone += 1
            else:
                time.sleep(0.001)  # no version in the store (yet): wait for one

    def _forward(self, seq: _Seq, new: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        if seq.cache is None:
            seq.cache = DynamicCache(config=self.config)
        ids = torch.tensor([new], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: seq.cache})
        logits: torch.Tensor = out.logits[0, -1]
        if self.inside_step is not None:
            self.inside_step()
        return logits

    def _prefill(self, seq: _Seq) -> None:
        """The prompt's KV and last logits, from the longest cached prefix of the version being read."""
        exact = False

        def run() -> torch.Tensor:
            nonlocal exact
            got = self.view.read_version()  # inside the fence: a different version than the start reads changed
            hit = None if got is None else self.prefix.longest(got[0], seq.ids)
            seq.cache = None if hit is None else copy.deepcopy(hit[1].cache)
            exact = hit is not None and hit[0] == len(seq.ids)
            if hit is not None and exact:
                if self.inside_step is not None:
                    self.inside_step()
                return hit[1].logits
            return self._forward(seq, seq.ids[0 if hit is None else hit[0] :])

        def undo() -> None:
            seq.cache = None

        seq.logits, seq.version = self._fenced(run, undo)
        if self.prefix.capacity > 0 and not exact and seq.logits is not None:
            self.prefix.put(seq.version, seq.ids, _Entry(copy.deepcopy(seq.cache), seq.logits))

    def _decode(self, seq: _Seq, token: int) -> None:
        length = seq.cache.get_seq_length()

        def undo() -> None:
            # A negative count removes that many tokens in transformers 4.x and 5.x alike (5.x refuses
            # the absolute length 4.x also took).
            extra = seq.cache.get_seq_length() - length
            if extra > 0:
                seq.cache.crop(-extra)

        seq.logits, seq.version = self._fenced(lambda: self._forward(seq, [token]), undo)
        seq.ids.append(token)

    async def _step(self, work: Callable[[], None]) -> None:
        """Run one step under the lock, between pauses.  A pause holds requests at most ``pause_limit_s``
        from when it began: past it (a daemon that died between pause and resume) every step runs under
        the fence anyway, which still never lets it read a half-written version (it waits, then fails).
        (Counted from the pause, not from each step: else each token of each request waited the limit.)"""
        while True:
            overdue = False
            began = self._paused_at if self._paused_at is not None else self._clock()
            try:
                await asyncio.wait_for(self._running.wait(), max(began + self.pause_limit_s - self._clock(), 0.0))
            except TimeoutError:
                overdue = True
            async with self._lock:
                if not self._running.is_set() and not overdue:
                    continue  # paused while waiting for the lock
                if self.threaded:
                    await asyncio.to_thread(work)
                else:
                    work()
                return

    # ---------------------------------------------------------------- requests

    def check_prompt(self, ids: Sequence[int], max_tokens: int) -> None:
        """ValueError (a 400) for a prompt or max_tokens out of bounds."""
        if not ids:
            raise ValueError("the prompt is empty")
        limit = min(MAX_PROMPT_TOKENS, self.max_positions) if self.max_positions else MAX_PROMPT_TOKENS
        if len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than {limit}")
        for tok in ids:
            if type(tok) is not int or not 0 <= tok < self.vocab:
                raise ValueError(f"token ids must be integers in [0, {self.vocab}), got {tok!r}")
        if type(max_tokens) is not int or not 0 <= max_tokens <= self.max_tokens_limit:
            raise ValueError(f"max_tokens must be an integer in [0, {self.max_tokens_limit}]")
        if self.max_positions and len(ids) + max_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the model's {self.max_positions}"
            )

    def _choose(self, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
        # NaN (weights gone bad) ranks lowest, never first; in float64 after subtracting the maximum, a
        # temperature as small as 1e-300 divides to 0 for the best tokens and -inf for the rest (float32
        # overflowed to inf - inf = NaN there, which multinomial refuses: a 500 for a valid request).
        x = logits.detach().to("cpu", torch.float64).nan_to_num(nan=-math.inf)
        best = int(x.argmax())
        if sampling.temperature == 0 or gen is None or not math.isfinite(float(x[best])):
            return best
        probs = torch.softmax((x - x[best]) / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            p, order = probs.sort(descending=True)
            keep = (p.cumsum(0) - p) < sampling.top_p  # the smallest set reaching top_p (at least one)
            probs = torch.zeros_like(probs).scatter_(0, order[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    async def generate(
        self, ids: Sequence[int], max_tokens: int, sampling: Sampling = Sampling()
    ) -> AsyncGenerator[Step, None]:
        """Tokens one by one; the caller stops early by closing the generator (eos, stop strings)."""
        self.check_prompt(ids, max_tokens)
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else time.time_ns())
        seq = _Seq(list(ids))
        token = -1
        for index in range(max_tokens):
            if index == 0:
                await self._step(lambda: self._prefill(seq))
            else:
                await self._step(lambda t=token: self._decode(seq, t))  # type: ignore[misc]
            assert seq.logits is not None
            token = self._choose(seq.logits, sampling, gen)
            yield Step(index, token, seq.version)

    async def logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Logits of the last position of a whole-prompt forward pass (no cache), and the version:
        bitwise what ``from_pretrained`` of that version computes (the debug route)."""
        self.check_prompt(ids, 0)
        out: list[tuple[torch.Tensor, int]] = []

        def run() -> torch.Tensor:
            with torch.inference_mode():
                x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
                logits: torch.Tensor = self.model(input_ids=x).logits[0, -1].float().cpu()
            if self.inside_step is not None:
                self.inside_step()
            return logits

        await self._step(lambda: out.append(self._fenced(run, lambda: None)))
        return out[0]

    def current_version(self) -> int | None:
        got = self.view.read_version()
        return None if got is None else got[0]
