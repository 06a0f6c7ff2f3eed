"""An example external simulator for Shoal (docs/external-protocol.md), in plain Python + numpy.

"Beacons": up to four agents share an arena; each sees a one-hot beacon colour (3 colours) plus noise and
earns +1 for choosing the action of its colour, 0 otherwise. Agents join and leave at random moments of an
episode (they request decisions only while present), so the server sees agents come and go; an episode lasts
20 steps (truncated) unless every agent has left (terminated). A random policy scores about 1/3 per decision.

Run it against a server (``shoal train --env external --external.command "python examples/external_sim.py
--port {port} --seed {seed} --sim-id {sim_id}"`` launches it for you; the token comes in ``SHOAL_TOKEN``)::

    python examples/external_sim.py --host 127.0.0.1 --port 8765 --token TOKEN --episodes 100
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from adapters.external.client import ExternalError, SimulatorClient  # noqa: E402

AGENTS = 4
COLOURS = 3
EPISODE_STEPS = 20
TREE = {"format": "shoal.tree/1", "tree": {"array": {
    "template": {"observation": {"leaf": "box", "shape": [COLOURS + 1], "dtype": "float32", "low": "-inf", "high": "inf"},
                 "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": COLOURS, "start": 0}},
    "capacity": AGENTS, "payoff": "cooperative", "shared_observation": None}}}


def run_episode(client, episode: str, rng: np.random.Generator) -> float:
    """Plays one episode through ``client`` (a SimulatorClient, or a LocalPolicy); returns the summed reward."""
    present = {f"agents_{i}": bool(rng.random() < 0.7) for i in range(AGENTS)}
    present["agents_0"] = True
    colour = {name: int(rng.integers(COLOURS)) for name in present}
    gone: set[str] = set()
    rewards: dict[str, float] = {}
    leaving: dict[str, str] = {}
    total = 0.0

    def observe() -> dict[str, np.ndarray]:
        out = {}
        for name, here in present.items():
            if here:
                obs = np.zeros(COLOURS + 1, dtype=np.float32)
                obs[colour[name]] = 1.0
                obs[COLOURS] = rng.normal()  # a distractor
                out[name] = obs
        return out

    for _ in range(EPISODE_STEPS):
        answer = client.act(episode, observe(), rewards=rewards, left=leaving)
        rewards, leaving = {}, {}
        for name, action in answer.actions.items():
            rewards[name] = 1.0 if int(action) == colour[name] else 0.0
            total += rewards[name]
            colour[name] = int(rng.integers(COLOURS))
        # agents come and go: a present agent leaves for good with 5% (reported with the next request or the
        # end), an agent that never joined joins with 20%
        for name in present:
            if present[name] and rng.random() < 0.05:
                present[name] = False
                gone.add(name)
                leaving[name] = "terminated"
            elif not present[name] and name not in gone and rng.random() < 0.2:
                present[name] = True
        if not any(present.values()):  # everyone left: the episode is over for good
            client.end(episode, "terminated", rewards=rewards)
            return total
    # truncated by the time limit: the final observations let the server bootstrap the agents' values
    client.end(episode, "truncated", rewards=rewards, observations=observe())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default=os.environ.get("SHOAL_TOKEN", ""))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-id", default="sim-0")
    parser.add_argument("--episodes", type=int, default=0, help="episodes to play (0: until the server closes)")
    parser.add_argument("--tls", action="store_true", help="connect with wss:// (the server's certificate must verify)")
    parser.add_argument("--local-policy", type=int, default=0, metavar="N",
                        help="act with a local copy of the policy (needs torch), fetching newer weights every N "
                             "episodes, and upload the steps (0: ask the server for every action)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    scheme = "wss" if args.tls else "ws"
    try:
        client = SimulatorClient(f"{scheme}://{args.host}:{args.port}", args.token, TREE, args.sim_id)
    except (OSError, ExternalError) as error:
        said = error if isinstance(error, ExternalError) else f"cannot connect: {error}"  # it says "cannot connect"
        print(f"external_sim {args.sim_id}: {said}", file=sys.stderr)
        return 1
    played = 0
    actor: object = client
    try:
        if args.local_policy:
            from adapters.external.local_policy import LocalPolicy

            actor = LocalPolicy(client, TREE, seed=args.seed)
        while args.episodes == 0 or played < args.episodes:
            if args.local_policy and played and played % args.local_policy == 0:
                actor.refresh()
            try:
                run_episode(actor, f"{args.sim_id}-{played}", rng)
            except ExternalError as error:
                if error.fatal:
                    raise
                # a refused request ends that episode on the server's side: go on with a new episode id
                print(f"external_sim {args.sim_id}: episode {played} refused: {error}", file=sys.stderr)
            for error in client.refused:  # an end the server refused (no answer comes for an end)
                print(f"external_sim {args.sim_id}: the end of {error.episode} refused: {error}", file=sys.stderr)
            client.refused.clear()
            played += 1
    except (ExternalError, OSError) as error:  # the server went away (training is over), or refused us
        print(f"external_sim {args.sim_id}: stopped after {played} episodes: {error}", file=sys.stderr)
        if isinstance(error, ExternalError) and error.code not in ("closed", "timeout"):
            return 1  # refused (too large, a spec mismatch, ...): this simulator's fault, not the run's end
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
