"""What the conformance kit (:mod:`adapters.external.conformance`) reports: the :class:`Report` a run returns,
and the :class:`Findings` it collects on the way (keyed by kind, so a fault repeated a thousand times is reported
once, with its count).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Report:
    """What :func:`adapters.external.conformance.run_conformance` saw."""

    command: str = ""
    """The command template that was checked."""
    failures: list[str] = field(default_factory=list)
    """Deviations from the protocol, each naming the message that showed it."""
    warnings: list[str] = field(default_factory=list)
    """Coverage gaps and doubtful behaviour that the protocol allows."""
    notes: list[str] = field(default_factory=list)
    """Facts about the run (exit codes, stderr tails)."""
    episodes: int = 0
    """Episodes ended (by an ``end``, or by an error the kit sent)."""
    acts: int = 0
    """``act`` messages received."""
    uploaded: int = 0
    """Steps of ``trajectory`` uploads accepted (local-policy mode)."""
    joined: int = 0
    """Agents that joined an episode after its first ``act``."""
    left: int = 0
    """Agents that left an episode through ``left``."""

    @property
    def ok(self) -> bool:
        """True when there was no failure (warnings allowed)."""
        return not self.failures

    def format(self) -> str:
        """The report as readable text."""
        verdict = "PASSED" if self.ok else "FAILED"
        lines = [f"shoal conformance: {verdict} ({len(self.failures)} failures, {len(self.warnings)} warnings)",
                 f"  command: {self.command}",
                 f"  {count(self.episodes, 'episode')} ended, {count(self.acts, 'act')}, "
                 f"{count(self.joined, 'agent')} joined mid-episode, {self.left} left"
                 + (f", {count(self.uploaded, 'uploaded step')}" if self.uploaded else "")]
        for title, items in (("Failures", self.failures), ("Warnings", self.warnings), ("Notes", self.notes)):
            if items:
                lines.append(f"{title}:")
                lines.extend("  - " + item.replace("\n", "\n    ") for item in items)
        return "\n".join(lines)


class Findings:
    """Failures and warnings keyed by kind: the first occurrence is kept, repeats are counted (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, list] = {}
        self._warnings: dict[str, list] = {}
        self.failure_events = 0
        """Failures seen, repeats included."""

    def fail(self, key: str, text: str) -> None:
        """Records a deviation of kind ``key``."""
        with self._lock:
            self.failure_events += 1
            self._failures.setdefault(key, [text, 0])[1] += 1

    def warn(self, key: str, text: str) -> None:
        """Records a warning of kind ``key``."""
        with self._lock:
            self._warnings.setdefault(key, [text, 0])[1] += 1

    def fill(self, report: Report) -> None:
        """Appends the findings to ``report`` (a repeated one with its count)."""
        for items, out in ((self._failures, report.failures), (self._warnings, report.warnings)):
            out.extend(text if n == 1 else f"{text} ({n} times in all)" for text, n in items.values())


def describe(index: int, message: dict[str, Any]) -> str:
    """``message #index (type id=... episode=...)``: how a finding names the message that showed it."""
    parts = [f"message #{index} ({message['type']}"]
    if "id" in message:
        parts.append(f" id={short(message['id'])}")
    if "episode" in message:
        parts.append(f" episode={short(message['episode'])}")
    return "".join(parts) + ")"


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def coverage_warnings(covered: set[str], report: Report, *, discrete_actions: bool) -> list[tuple[str, str]]:
    """``(key, text)`` of what the launch never exercised; ``covered`` names what it did (``error``, ``masks``,
    ``rewards``, ``pings``, ``terminated``, ``truncated``, ``final_observations``, ``pipelined``)."""
    if report.acts == 0 and report.uploaded:
        return [("cover.local_policy", "the simulator only uploaded trajectories (local-policy mode): its uploads "
                                       "were checked; act requests, the non-fatal error and pipelining untested")]
    if report.acts == 0:
        return [("cover.acts", "no act was sent: nothing was checked beyond the handshake")]
    c = covered
    seen = [("error" in c, "cover.error", "no episode reached a second act: the non-fatal error was not tested"),
            (report.joined > 0, "cover.join", "no agent joined an episode after its first act: joining untested"),
            (report.left > 0, "cover.left", "no agent ever left an episode: leaving untested"),
            ("masks" in c or not discrete_actions, "cover.masks", "no action_mask sent: masks untested"),
            ("rewards" in c, "cover.rewards", "no reward was ever reported"),
            ("pings" in c, "cover.pings", "no ping message sent: the keep-alive untested"),
            ("terminated" in c, "cover.terminated", "no episode ended 'terminated'"),
            ("truncated" in c, "cover.truncated", "no episode ended 'truncated'"),
            ("truncated" not in c or "final_observations" in c, "cover.final",
             "no truncated end carried final 'observations': bootstrapping untested"),
            ("pipelined" in c, "cover.pipelining", "never more than one unanswered act at a time: pipelining untested")]
    return [(key, text) for done, key, text in seen if not done]


def count(n: int, noun: str) -> str:
    """``1 episode``, ``2 episodes``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


__all__ = ["Findings", "Report", "count", "coverage_warnings", "describe", "short"]
