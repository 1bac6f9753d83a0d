"""The ``tools`` episode environment: `ToolEnv` answers a policy turn's ``<tool_call>`` with the
recipe's tools (``vlm/tools.py``), and `tool_env` registers it as the default
``rollout.episode.env`` in ``perceptrl.registry.EPISODE_ENVS``; the tools of a recipe and of a
sample (`resolve_tools`, `allowed_tools`, `check_sample_tools`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..registry import EPISODE_ENVS
from ..trainer.config import ConfigError
from .prompts import load_images
from .tools import Observation, Tool, ToolContext, resolve_tools, run_call, tool_name


class ToolEnv:
    """`EpisodeEnv` of tool use: a turn with a ``<tool_call>`` gets the tool's observation, a turn
    without one ends the episode. A sample may list the tools it allows (``sample["tools"]``),
    a subset of ``tools``; other calls get an error observation.

    Args:
        tools: name -> tool the policy may call.
        options: tool name -> options (e.g. ``{"zoom": {"size": 224}}``).
        timeout_s: time limit of one tool call (None: no limit).
    """

    def __init__(
        self, tools: dict[str, Tool], options: dict | None = None, timeout_s: float | None = 5.0
    ):
        self.tools, self.options, self.timeout_s = tools, dict(options or {}), timeout_s
        self._rows: list[tuple[ToolContext, dict[str, Tool]]] = []

    def reset(self, samples: list[dict]) -> None:
        contexts: dict[int, tuple[ToolContext, dict[str, Tool]]] = {}
        self._rows = []
        for s in samples:
            if id(s) not in contexts:  # the G rows of a prompt share one sample object
                ctx = ToolContext(s, load_images(s), self.options)
                contexts[id(s)] = (ctx, allowed_tools(s, self.tools))
            self._rows.append(contexts[id(s)])

    def respond(self, row: int, text: str) -> Observation | None:
        ctx, tools = self._rows[row]
        return run_call(text, tools, ctx, self.timeout_s)

    def fork(self, src: int, dst: int) -> None:
        """Episode ``dst`` continues ``src``'s (tools are stateless: they share its context)."""
        self._rows.extend([self._rows[src]] * (dst + 1 - len(self._rows)))
        self._rows[dst] = self._rows[src]


@EPISODE_ENVS.register("tools")
def tool_env(cfg) -> Callable[[], ToolEnv]:
    """The default environment of ``rollout.episode.env``: a `ToolEnv` of the recipe's tools
    (``rollout.episode.tools``, ``tool_options``, ``tool_timeout_s``). Other environments are
    entries of ``perceptrl.registry.EPISODE_ENVS`` too (``vla/plan_env.py``: ``plan``), each a
    ``build(cfg) -> factory`` declaring its ``eval_reward``."""
    e = cfg.rollout.episode
    try:
        tools = resolve_tools(e.tools)
    except ValueError as err:
        raise ConfigError(f"rollout.episode.tools: {err}") from err
    return functools.partial(ToolEnv, tools, e.tool_options, e.tool_timeout_s or None)


def allowed_tools(sample: dict, tools: dict[str, Tool]) -> dict[str, Tool]:
    """The tools a sample allows: its ``tools`` list (names or specs) if it has one, else all."""
    names = sample.get("tools")
    if names is None:
        return tools
    short = [tool_name(str(n)) for n in names]
    return {n: tools[n] for n in short if n in tools}


def check_sample_tools(samples: list[dict], tools: dict[str, Tool], where: str) -> None:
    """Every tool a sample lists must be enabled in the recipe; ValueError names the first."""
    for i, s in enumerate(samples):
        names = s.get("tools")
        if names is None:
            continue
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"sample {s.get('id')!r} of {where}: 'tools' must be a list of names")
        bad = [n for n in names if tool_name(n) not in tools]
        if bad:
            raise ValueError(
                f"sample {s.get('id')!r} (index {i}) of {where} allows tools {bad} that the "
                f"recipe does not enable; rollout.episode.tools is {sorted(tools) or 'empty'}"
            )
