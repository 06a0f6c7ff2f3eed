"""External environments' settings (``--external.*``, seed 002): the server, its security and the simulator
launcher. Kept apart from :mod:`orchestration.config`, which re-exports it, as the team critic's are."""

from __future__ import annotations

from dataclasses import dataclass

from orchestration.config_kinds import check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class ExternalConfig:
    """External environments (``--env external``): simulators and robots that connect to this run's server over
    the protocol of docs/external-protocol.md."""

    host: str = "127.0.0.1"
    """Address the server binds to; anything but loopback needs ``tls_cert`` and ``tls_key`` (or ``insecure``)."""
    port: int = 0
    """TCP port; 0 picks a free one (printed, and handed to launched simulators as ``{port}``)."""
    token: str = ""
    """Secret every simulator presents in its ``hello``; empty: the one in ``run_dir/external_token`` when there
    is one (a resumed run keeps its token), else a fresh random one (printed and written there, mode 0600)."""
    command: str = ""
    """Simulator command template (``{host}``, ``{port}``, ``{seed}``, ``{sim_id}``, ``{token}``), split like a
    POSIX shell (no shell runs it); empty: nothing is launched and environments connect by themselves."""
    instances: int = 1
    """Simulators launched from ``command``."""
    start_timeout_s: float = 60.0
    """A launched simulator that has not connected this long after its start is killed and started again; also
    the longest wait for the first simulator's tree when none is given (``tree``; twice this with a launcher, so
    that a failed first start is restarted once), whatever ``wait_s`` says."""
    max_restarts: int = 20
    """Restarts of launched simulators allowed over the run; one more stops the run with an error."""
    restart_backoff_s: float = 1.0
    """Pause before restarting a launched simulator that had connected, doubled for each such restart of it in a
    row (at most 60 s; a start connected for a minute resets it). One that never connected restarts at once,
    so a wrong ``command`` fails within seconds."""
    tree: str = ""
    """Path of a tree document file (JSON, docs/external-protocol.md) the simulators must match; empty: the first
    simulator's tree is the run's."""
    heartbeat_s: float = 10.0
    """WebSocket ping interval and timeout: a connection that does not answer in time is closed."""
    idle_timeout_s: float = 120.0
    """A connection that sends nothing for this long is closed (its open episodes end truncated)."""
    max_message_bytes: int = 1 << 20
    """Largest frame accepted from a simulator."""
    max_episodes: int = 64
    """Open episodes per connection."""
    max_simulators: int = 256
    """Connections served at once."""
    wait_s: float = 300.0
    """Longest a training iteration waits with no data from any simulator before it fails (0: forever; SIGINT or
    SIGTERM still stops such a wait, with a checkpoint)."""
    tls_cert: str = ""
    """PEM certificate for ``wss://`` (with ``tls_key``)."""
    tls_key: str = ""
    """PEM private key for ``wss://``."""
    insecure: bool = False
    """Allow a non-loopback address without TLS (the server prints a warning)."""
    inference_batch_rows: int = 1024
    """Most requests one inference batch answers."""
    inference_wait_s: float = 0.001
    """Longest a nearly empty inference batch waits for more requests."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("instances", "max_message_bytes", "max_episodes", "max_simulators", "inference_batch_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"--external.{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("start_timeout_s", "heartbeat_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--external.{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--external.port must be 0-65535 (0: any free port), got {self.port}")
        for name in ("max_restarts", "restart_backoff_s", "wait_s", "inference_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--external.{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--external.tls-cert and --external.tls-key go together (wss needs both)")
        if self.command:  # a bad template is told before the server starts waiting
            from adapters.external.command import render

            render(self.command, host=self.host, port=self.port, seed=0, sim_id="sim-0", token="token")


#: The external fleet's counters (``env/external_<name>``) that count normal traffic, not faults: the progress
#: line's ``env_faults`` leaves them out (refusals, protocol errors, idle closes, cut episodes, lost steps and
#: simulator restarts are faults).
ACTIVITY_COUNTERS = frozenset(f"env/external_{name}" for name in (
    "connections", "requests", "disconnects", "uploaded_steps", "episodes_started", "episodes_completed",
    "steps_recorded", "approx_bootstraps", "simulators_started", "simulators_connected", "inference_batches",
    "inference_mean_requests"))

__all__ = ["ACTIVITY_COUNTERS", "ExternalConfig"]
