"""External environments over loopback: the cost of the protocol against what it carries.

1. ``round_trip``: one simulator asks for actions in a loop (one agent per request). Ours: the latency of an
   ``act`` -> ``actions`` exchange through :class:`orchestration.external_server.ExternalServer` (parsing,
   checking against the tree, one inference-service forward, recording the step). Reference, in the same run:
   a bare ``websockets`` echo server sent the same ``act`` frame and echoing it back. Small observations (the
   example simulator's 4 floats) and image-sized ones (84x84x3 uint8, a flattening policy). p50 and p99 over
   interleaved rounds. Target (issue 13): p50 within 2x of the echo. Also timed in the same run: the served
   policy's bare forward for one request (its ``act_step`` on one row: ``*_forward_p50_us``), and
   ``*_floor_vs_echo`` = (echo + bare forward) / echo: what a server costing nothing but the forward would
   reach, the bound on ``*_p50_vs_echo`` with this policy on this transport and machine. And ``*_bare_p50_us``:
   the same client against a bare protocol server in the same rounds, interleaved (a ``websockets`` handler that decodes
   the ``act``, parses it against the tree, runs the policy's ``act_step`` and answers: no inference service,
   no recording, no counters, no checks of episode state): what the protocol in Python costs before anything
   Shoal's server adds; ``*_bare_vs_echo`` is its ratio to the echo. The simulator side (one client each for
   ours, the bare server and the echo) runs in a process of its own, as a simulator does (``--client thread``:
   in a thread of the servers' process, sharing their interpreter's lock; it measures slower).
2. ``simulators``: 16 copies of the example simulator (``examples/external_sim.py``'s episode loop) as threads,
   through the server on loopback, against the same 16 loops in this process asking the same inference
   service directly (no sockets, no protocol, no recording): env steps per second, and their ratio.

    python benchmarks/external_round_trip.py [--requests 300] [--rounds 3] [--simulators 16] [--seconds 3] \\
        [--client process|thread]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import queue as queues
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from websockets.sync.client import connect
from websockets.sync.server import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from adapters.external.client import SimulatorClient  # noqa: E402
from adapters.external.codec import TreeCodec, action_maps  # noqa: E402
from adapters.external.messages import decode, encode  # noqa: E402
from core.policies import PolicyConfig, make_policies  # noqa: E402
from core.specs import from_json  # noqa: E402
from orchestration.assignment import assign  # noqa: E402
from orchestration.config import ExternalConfig  # noqa: E402
from orchestration.external_episodes import Lanes  # noqa: E402
from orchestration.external_server import ExternalServer  # noqa: E402
from orchestration.inference import InferenceConfig, InferenceService  # noqa: E402

import external_sim  # noqa: E402


def image_tree() -> dict:
    return {"format": "shoal.tree/1", "tree": {"array": {
        "template": {"observation": {"leaf": "box", "shape": [84, 84, 3], "dtype": "uint8", "low": 0, "high": 255},
                     "action": {"leaf": "discrete", "shape": [], "dtype": "int64", "n": 6, "start": 0}},
        "capacity": 1, "payoff": "cooperative", "shared_observation": None}}}


def start_server(tree_doc: dict, max_bytes: int):
    tree = from_json(json.dumps(tree_doc))
    policy = make_policies(tree, PolicyConfig(image_encoder="flatten"))["agents"]
    service = InferenceService({"agents": policy}, InferenceConfig(max_wait_s=0.0)).start()
    lanes = Lanes(TreeCodec(tree), assign(tree, {}), 64, lambda *item: None)
    server = ExternalServer(ExternalConfig(token="bench", max_message_bytes=max_bytes, max_episodes=1024), tree,
                            log=io.StringIO()).start()
    server.attach(service, lanes)
    return server, service, policy


def echo_server():
    def handler(ws):
        for frame in ws:
            ws.send(frame)

    server = serve(handler, "127.0.0.1", 0, compression=None, max_size=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def bare_server(tree_doc: dict, policy, device: torch.device):
    """A bare protocol server (module docstring): parse, one ``act_step``, answer; nothing else."""
    codec = TreeCodec(from_json(json.dumps(tree_doc)))
    generator = torch.Generator(device=device).manual_seed(0)

    def handler(ws):
        for frame in ws:
            message = decode(frame, max_bytes=1 << 22)
            if message["type"] == "hello":
                ws.send(encode({"type": "welcome", "protocol": 1, "session": "bare", "max_message_bytes": 1 << 22}))
            elif message["type"] == "act":
                request = codec.parse_act(message, "act")
                inputs = {"observation": request.observation["agents"].to(device),
                          "mask": request.mask["agents"].to(device)}
                with torch.inference_mode():
                    out = policy.act_step(inputs, None, generator, False, with_value=False, with_log_prob=True)
                actions = action_maps({"agents": out["action"].cpu()}, request.agents)
                ws.send(encode({"type": "actions", "id": message["id"], "episode": message["episode"],
                                "actions": actions, "version": 0}))

    server = serve(handler, "127.0.0.1", 0, compression=None, max_size=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def time_ours(client: SimulatorClient, obs: np.ndarray, n: int, episode: str) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        client.act(episode, {"agents_0": obs})
        out.append(time.perf_counter() - t)
    return out


def time_echo(ws, frame: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ws.send(frame)
        ws.recv()
        out.append(time.perf_counter() - t)
    return out


def time_forward(policy, device: torch.device, tree_doc: dict, obs: np.ndarray, n: int) -> list[float]:
    """The served policy's bare ``act_step`` on one row of ``obs`` (with the present-agent mask the server passes),
    on the service's ``device``, inputs from and outputs back to the CPU as the service does."""
    capacity = tree_doc["tree"]["array"]["capacity"]
    x = torch.zeros(1, capacity, *obs.shape, dtype=torch.from_numpy(obs).dtype)
    x[0, 0] = torch.from_numpy(obs)
    inputs = {"observation": x, "mask": torch.arange(capacity).eq(0)[None]}
    generator, out, accelerator = torch.Generator(device=device).manual_seed(0), [], device.type != "cpu"
    with torch.inference_mode():
        for _ in range(n):
            t = time.perf_counter()
            got = policy.act_step({k: v.to(device) for k, v in inputs.items()} if accelerator else inputs, None,
                                  generator, False, with_value=False, with_log_prob=True)
            if accelerator:  # the copy back to the CPU waits for the device, as the service's does
                got["action"].cpu(), got["log_prob"].cpu()
            out.append(time.perf_counter() - t)
    return out


def client_rounds(urls: dict[str, str], tree_doc: dict, obs: np.ndarray, requests: int, rounds: int,
                  out=None) -> tuple[list, list, list]:
    """The simulator's side: ``requests`` act exchanges with our server, the bare protocol server and the echo,
    interleaved over ``rounds``; the latencies ``(ours, bare, echo)``, also put on ``out`` (a process's queue)."""
    client = SimulatorClient(urls["ours"], "bench", tree_doc, "bench")
    bare_client = SimulatorClient(urls["bare"], "bench", tree_doc, "bare")
    ws = connect(urls["echo"], compression=None, max_size=None, proxy=None, legacy=True)
    frame = encode({"type": "act", "id": 0, "episode": "e", "agents": {"agents_0": {"observation": obs}}})
    ours, bare, ref = [], [], []
    time_ours(client, obs, 20, "warm")
    time_ours(bare_client, obs, 20, "warm")
    time_echo(ws, frame, 20)
    for r in range(rounds):
        ours += time_ours(client, obs, requests, f"e{r}")
        bare += time_ours(bare_client, obs, requests, f"e{r}")
        ref += time_echo(ws, frame, requests)
    client.close()
    bare_client.close()
    ws.close()
    if out is not None:
        out.put((ours, bare, ref))
    return ours, bare, ref


def _result_of(child, results, timeout_s: float = 600.0):
    """The client process's result, failing at once if it dies first (not after the whole timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queues.Empty:
            if not child.is_alive():
                try:  # it may have put its result just before it ended
                    return results.get(timeout=1.0)
                except queues.Empty:
                    pass
                raise RuntimeError(f"the client process died (exit code {child.exitcode}) before its result") from None
    raise TimeoutError(f"the client process gave no result within {timeout_s:.0f} s")


def round_trip(name: str, tree_doc: dict, obs: np.ndarray, requests: int, rounds: int, client_process: bool) -> dict:
    server, service, policy = start_server(tree_doc, max_bytes=1 << 22)
    policy = policy.to(service.device)  # the service acts with its own copy on its device: time the same
    echo = echo_server()
    bare_protocol = bare_server(tree_doc, policy, service.device)
    urls = {"ours": server.url, "bare": f"ws://127.0.0.1:{bare_protocol.socket.getsockname()[1]}",
            "echo": f"ws://127.0.0.1:{echo.socket.getsockname()[1]}"}
    if client_process:  # a simulator is a process of its own: it does not share the server's interpreter
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=client_rounds, args=(urls, tree_doc, obs, requests, rounds, queue))
        child.start()
        ours, floor, ref = _result_of(child, queue)
        child.join(30)
    else:
        ours, floor, ref = client_rounds(urls, tree_doc, obs, requests, rounds)
    time_forward(policy, service.device, tree_doc, obs, 20)
    bare = time_forward(policy, service.device, tree_doc, obs, requests * rounds)
    frame = encode({"type": "act", "id": 0, "episode": "e", "agents": {"agents_0": {"observation": obs}}})
    bare_protocol.shutdown()
    echo.shutdown()
    server.close()
    service.close()
    q = lambda xs, p: float(np.percentile(xs, p)) * 1e6  # noqa: E731
    return {f"{name}_frame_bytes": len(frame), f"{name}_p50_us": round(q(ours, 50), 1),
            f"{name}_p99_us": round(q(ours, 99), 1), f"{name}_echo_p50_us": round(q(ref, 50), 1),
            f"{name}_echo_p99_us": round(q(ref, 99), 1), f"{name}_p50_vs_echo": round(q(ours, 50) / q(ref, 50), 2),
            f"{name}_forward_p50_us": round(q(bare, 50), 1),
            f"{name}_floor_vs_echo": round((q(ref, 50) + q(bare, 50)) / q(ref, 50), 2),
            f"{name}_bare_p50_us": round(q(floor, 50), 1), f"{name}_bare_vs_echo": round(q(floor, 50) / q(ref, 50), 2)}


class DirectClient:
    """The example simulator's client interface, answered by the inference service in this process."""

    def __init__(self, service: InferenceService, codec: TreeCodec) -> None:
        self.service, self.codec = service, codec

    def act(self, episode, agents, rewards=None, left=None):
        obs = torch.zeros(1, external_sim.AGENTS, external_sim.COLOURS + 1)
        mask = torch.zeros(1, external_sim.AGENTS, dtype=torch.bool)
        slots = {}
        for name, o in agents.items():
            slot = self.codec.index[name][1]
            obs[0, slot] = torch.from_numpy(o)
            mask[0, slot] = True
            slots[name] = slot
        result = self.service.act("agents", {"observation": obs, "mask": mask})
        return type("Answer", (), {"actions": {n: result.action[0, s].numpy() for n, s in slots.items()}})

    def end(self, *args, **kwargs):
        pass


def simulators(count: int, seconds: float) -> dict:
    tree_doc = external_sim.TREE
    out = {}
    for mode in ("in_process", "external"):
        server, service, _ = start_server(tree_doc, max_bytes=1 << 20)
        steps = [0] * count
        stop = threading.Event()

        def loop(i: int) -> None:
            rng = np.random.default_rng(i)
            if mode == "external":
                client = SimulatorClient(server.url, "bench", tree_doc, f"s{i}")
            else:
                client = DirectClient(service, TreeCodec(from_json(json.dumps(tree_doc))))
            k = 0
            while not stop.is_set():
                external_sim.run_episode(client, f"s{i}-{k}", rng)
                steps[i] += external_sim.EPISODE_STEPS
                k += 1
            if mode == "external":
                client.close()

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(count)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        begin, before = time.perf_counter(), sum(steps)
        time.sleep(seconds)
        rate = (sum(steps) - before) / (time.perf_counter() - begin)
        stop.set()
        for t in threads:
            t.join(10)
        server.close()
        service.close()
        out[f"{count}_simulators_{mode}_steps_per_s"] = round(rate, 1)
    out[f"{count}_simulators_external_vs_in_process"] = round(
        out[f"{count}_simulators_external_steps_per_s"] / out[f"{count}_simulators_in_process_steps_per_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulators", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--client", choices=("process", "thread"), default="process",
                        help="where the round trips' simulator runs: a process of its own (as a simulator does), "
                             "or a thread of this one (sharing the servers' interpreter)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    small = np.zeros(4, np.float32)
    image = np.random.default_rng(0).integers(0, 255, (84, 84, 3), dtype=np.uint8)
    small_tree = json.loads(json.dumps(external_sim.TREE))
    small_tree["tree"]["array"]["capacity"] = 1
    result = {"benchmark": "external_round_trip", "client": args.client}
    result.update(round_trip("small", small_tree, small, args.requests, args.rounds, args.client == "process"))
    result.update(round_trip("image", image_tree(), image, args.requests // 3, args.rounds, args.client == "process"))
    if args.simulators:
        result.update(simulators(args.simulators, args.seconds))
    result["target_p50_vs_echo"] = 2.0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
