"""Tool calling in the Qwen2.5 / Hermes format: ``<tool_call>{json}</tool_call>`` in an
assistant turn, answered by ``tool`` messages; and :class:`ToolEnv`, the environment that
serves Python callables as tools.

A call is ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (whitespace around
the JSON allowed; several calls per turn). Each runs as ``tools[NAME](**arguments)`` in a
worker thread with a timeout; its result is the ``str`` of the return value, and every
failure (malformed JSON, unknown tool, bad arguments, an exception, a timeout) is answered
with an ``error: ...`` message instead, so the policy sees it and the episode goes on. A
thread cannot be killed: a tool that ignores its timeout keeps its worker busy in the
background (the episode has moved on); give tools that may hang their own limits (e.g. a
subprocess), as ``rewards.code`` does.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxrl_llm.envs.base import Episode, Message, StepResult
from jaxrl_llm.rewards.base import RewardInput

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tool")


class ToolCall(NamedTuple):
    """One parsed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any]


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The Hermes text of a call, compact JSON: ``<tool_call>{"name":...}</tool_call>``."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The calls in an assistant turn, in order; a malformed one is an ``error: ...`` string.

    ``"<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>"`` →
    ``[ToolCall("calc", {"expr": "2*3"})]``; a turn without ``<tool_call>`` gives ``[]``.
    """
    calls: list[ToolCall | str] = []
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"error: the tool call is not valid JSON ({err.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append('error: a tool call needs {"name": ..., "arguments": {...}}')
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some templates serialise the arguments twice
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"error: the arguments of {obj['name']!r} must be a JSON object")
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls


def run_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall | str, *, timeout_s: float
) -> str:
    """The text answering one call: the tool's result, or ``error: ...`` (see module)."""
    if isinstance(call, str):
        return call
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r} (available: {sorted(tools)})"
    future = _EXECUTOR.submit(fn, **call.arguments)
    try:
        return str(future.result(timeout=timeout_s))
    except concurrent.futures.TimeoutError:
        future.cancel()
        return f"error: tool {call.name!r} timed out after {timeout_s:g}s"
    except TypeError as err:
        return f"error: bad arguments for {call.name!r}: {err}"
    except Exception as err:  # noqa: BLE001  (the policy sees every failure as text)
        return f"error: {call.name!r} failed: {type(err).__name__}: {err}"


class ToolEnv:
    """A question answered with the help of tools, scored on the final answer.

    ``reset`` asks the example's prompt (after an optional system prompt). Each assistant turn
    holding tool calls is answered with one ``tool`` message per call (at most
    ``max_calls_per_turn``; turns with more are answered with an error) and reward 0; the
    first turn without a tool call is the final answer: the episode ends with
    ``reward_fn(RewardInput(prompt, answer, example))``. The loop ends episodes that run out
    of turns or tokens (their reward is what the turns so far earned: 0).

    Args:
      tools: ``{name: callable}``; called with the call's arguments as keywords.
      reward_fn: scores the final answer (e.g. the configured ``rewards``).
      system_prompt: an optional system message (e.g. the tools' descriptions).
      timeout_s: each call's time limit.
      max_calls_per_turn: calls answered per assistant turn.
      demonstrate: ``fn(example) -> [messages]``: a good episode after ``reset``'s messages,
        for the SFT warm-up; None = this environment has no demonstrations.
    """

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Any]],
        reward_fn: Callable[[RewardInput], float],
        *,
        system_prompt: str | None = None,
        timeout_s: float = 5.0,
        max_calls_per_turn: int = 4,
        demonstrate: Callable[[Any], list[Message]] | None = None,
    ):
        if not tools or not all(callable(fn) for fn in tools.values()):
            raise ValueError(f"tools must map names to callables, got {tools!r}")
        if not timeout_s > 0 or max_calls_per_turn < 1:
            raise ValueError(
                f"need timeout_s > 0 and max_calls_per_turn >= 1, got {timeout_s}, "
                f"{max_calls_per_turn}"
            )
        self.tools = dict(tools)
        self.reward_fn = reward_fn
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self._demonstrate = demonstrate

    def reset(self, example: Any) -> list[Message]:
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return [*system, {"role": "user", "content": example.prompt}]

    def step(self, episode: Episode, completion: str) -> StepResult:
        calls = parse_tool_calls(completion)
        if not calls:
            prompt = next(m["content"] for m in reversed(episode.messages) if m["role"] == "user")
            reward = float(self.reward_fn(RewardInput(prompt, completion, episode.example)))
            return StepResult(None, reward, True, {"tool_calls": 0})
        if len(calls) > self.max_calls_per_turn:
            text = f"error: at most {self.max_calls_per_turn} tool calls a turn, got {len(calls)}"
            return StepResult([{"role": "tool", "content": text}], 0.0, False, {"tool_calls": 0})
        results = [run_tool(self.tools, call, timeout_s=self.timeout_s) for call in calls]
        errors = sum(r.startswith("error:") for r in results)
        messages = [{"role": "tool", "content": r} for r in results]
        info = {"tool_calls": len(calls), "tool_errors": errors}
        return StepResult(messages, 0.0, False, info)

    def demonstration(self, example: Any) -> list[Message]:
        if self._demonstrate is None:
            raise NotImplementedError("this ToolEnv was built without demonstrations")
        return self._demonstrate(example)
