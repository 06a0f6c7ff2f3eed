"""The conformance kit of the external-environment protocol (docs/external-protocol.md, last section).

:func:`run_conformance` starts a checking server on 127.0.0.1, launches a simulator from a command template
(the one ``shoal train --external.command`` takes) and drives it the way a Shoal server would, checking every
message against the protocol page:

1. **Main launch.** The handshake (``hello`` first and once, protocol version, token, ``sim_id``, a tree that
   the server serves and its ``spec_hash``); every ``act`` (request ids, episode ids, one outstanding request
   per episode, agent names, observations against the tree's leaves by the server's own codec, action masks,
   rewards, agents leaving and never coming back); every ``end``; ``ping`` messages and WebSocket ping frames.
   Acts are answered with random legal actions drawn from the tree's action spaces (respecting masks), in
   shuffled order when several are pending. Once, mid-episode, the kit answers an ``act`` with a *non-fatal*
   ``spec_violation`` error and checks that the simulator carries on with a new episode id. An ``act`` or
   ``end`` that breaks the protocol gets the error a server would send.
2. **Wrong token.** A second launch gets a wrong token; the kit answers its ``hello`` with a fatal
   ``bad_token`` error and checks that the simulator exits (no hang, no reconnect loop).

Every finding names the message that showed it (its number on the connection, type, ``id`` and episode).
Repeated findings of one kind are reported once with a count. Coverage gaps (no agent ever left, no action
mask sent, ...) are warnings, not failures.

The kit's modules: this driver; :mod:`~adapters.external.conformance_launch` (the two launches, processes and
the checking server); :mod:`~adapters.external.conformance_session` (one checked connection);
:mod:`~adapters.external.conformance_checks` (each message's checks); :mod:`~adapters.external.conformance_actions`
(random legal actions); :mod:`~adapters.external.conformance_report` (the report and its findings).

Usage::

    report = run_conformance("./sim --port {port} --token {token} --seed {seed} --id {sim_id}")
    print(report.format())
    assert report.ok
"""

from __future__ import annotations

import argparse
import secrets
import sys

from adapters.external.command import render
from adapters.external.conformance_launch import main_launch, token_launch
from adapters.external.conformance_report import Findings, Report
from adapters.external.conformance_session import SessionOptions


def run_conformance(command: str, *, episodes: int = 5, timeout_s: float = 30.0, seed: int = 0,
                    max_acts: int = 20_000, check_token: bool = True) -> Report:
    """Launches the simulator of ``command`` against a checking server and reports every deviation (module doc).

    Args:
        command: command template, split like a POSIX shell (no shell runs it); ``{host}``, ``{port}``,
            ``{seed}``, ``{sim_id}`` and ``{token}`` are replaced, and ``SHOAL_TOKEN`` holds the token.
        episodes: episodes to see ended before the kit closes the connection.
        timeout_s: longest wait for a connection, for any message, and for the exit after a refused token;
            also the ``heartbeat_s`` and ``idle_timeout_s`` told in ``welcome``.
        seed: ``{seed}`` of the main launch (the wrong-token launch gets ``seed + 1``) and the actions' seed.
        max_acts: the kit stops after this many acts even if fewer episodes ended (a warning).
        check_token: run the wrong-token launch (step 2).

    Returns:
        The :class:`Report`; ``report.ok`` when nothing failed.

    Raises:
        ValueError: an empty command, unbalanced quotes, an unknown placeholder (named), or counts below 1.
    """
    # the template's faults are the user's, found before any launch (not findings about the simulator)
    render(command, flag="--command", host="127.0.0.1", port=0, seed=seed, sim_id="conformance-0", token="")
    for flag, ok, rule, value in (("--episodes", episodes >= 1, ">= 1", episodes),
                                  ("--timeout-s", timeout_s > 0, "> 0", timeout_s),
                                  ("max_acts", max_acts >= 1, ">= 1", max_acts)):  # a library argument only
        if not ok:
            raise ValueError(f"{flag} must be {rule}, got {value:g}")
    report, findings = Report(command=command), Findings()
    options = SessionOptions(token=secrets.token_hex(16), episodes=episodes, timeout_s=timeout_s, max_acts=max_acts,
                             seed=seed, sim_id="conformance-0", sim_id_given="{sim_id}" in command)
    main_launch(command, options, report, findings)
    if check_token:
        token_launch(command, options, report, findings)
    findings.fill(report)
    return report


def main(argv: list[str] | None = None) -> int:
    """``shoal conformance``: checks a simulator; exit code 0 when it conforms, 1 otherwise, 2 for a bad command
    line (an unknown placeholder, a count below 1)."""
    parser = argparse.ArgumentParser(prog="shoal conformance", description="Launch a simulator and check it "
                                     "against the external-environment protocol (docs/external-protocol.md).")
    parser.add_argument("--command", required=True, help="the simulator's command template, with {host}, {port}, "
                        "{seed}, {sim_id} and {token} placeholders (the token is also in SHOAL_TOKEN)")
    parser.add_argument("--episodes", type=int, default=5, help="episodes to see end (default 5)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="longest wait for a connection, a message "
                        "or an exit (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="{seed} of the launch and the random actions' seed")
    parser.add_argument("--no-token-check", action="store_true", help="skip the wrong-token launch")
    args = parser.parse_args(argv)
    try:
        report = run_conformance(args.command, episodes=args.episodes, timeout_s=args.timeout_s, seed=args.seed,
                                 check_token=not args.no_token_check)
    except ValueError as error:  # the command line's fault: one paragraph and exit code 2
        print(f"shoal conformance: {error}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1


__all__ = ["Report", "main", "run_conformance"]

if __name__ == "__main__":
    sys.exit(main())
