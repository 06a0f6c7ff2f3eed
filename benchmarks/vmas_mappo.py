"""MAPPO on VMAS navigation: Shoal's central and joint critics against TorchRL's MAPPO, same settings, same run.

Settings of ``../shared/notes/marl-learning-anchors.md`` section 2 (TorchRL's multi-agent PPO tutorial, 10 epochs):
``vmas:navigation`` with 3 agents, continuous actions, 100-step episodes, 600 envs x 10 steps = 6,000 frames per
iteration ("frame" = one env step, all 3 agents act), 10 epochs of minibatches of 400 frames (1,200 agent rows),
Adam lr 3e-4, clip 0.2, gamma 0.99, GAE lambda 0.9, entropy 1e-4, grad-norm 1.0, 2 x 256 tanh actor and critic
whose parameters all agents share, a tanh-squashed Gaussian policy. torch uses ``--threads`` threads.

- ``shoal_central``: ``PolicyConfig(critic="central")``: the critic reads [own observation, every agent's]: its
  trunk runs once per agent (1,200 rows per minibatch).
- ``shoal_joint``: ``PolicyConfig(critic="joint")``: the critic reads every agent's observation and gives one
  value per agent slot: its trunk runs once per env (400 rows per minibatch), as TorchRL's centralised
  ``MultiAgentMLP`` with shared parameters does (which gives one value for all agents of an env).
- ``torchrl``: ``VmasEnv`` + ``RewardSum``, ``MultiAgentMLP`` actor (decentralised) and critic (centralised),
  ``ProbabilisticActor(TanhNormal)``, ``ClipPPOLoss`` with GAE and normalised advantages, ``Collector``, a
  ``ReplayBuffer`` sampled without replacement: the tutorial's loop. What differs by construction: TorchRL's value
  loss is smooth L1 (Shoal's squared error), its Adam is not fused, its ``TanhNormal`` entropy is a one-sample
  estimate (no matmuls), and its policy's scale comes from the network (Shoal's log-std is a parameter).

Each setup is built once and warmed up with one iteration; rounds then alternate the setups (``--iterations``
iterations each per round), so slow phases of a shared machine hit all alike. Reported: frames/s per setup
(median over rounds) and the ratios; and the update's achieved FLOP/s: the matmul FLOPs of its SGD steps (forward,
weight and input gradients of every linear layer, counted from the layer shapes, ``SHAPES``) over the time of
its learning phase (Shoal's ``time_learn``, which also holds the GAE value passes; TorchRL's epochs loop),
against a bare chain of the same matmuls (``torch.mm``, no activation, no optimiser) timed in each round: the
limit. Both sides do the same matmuls per step except ``shoal_central``, whose critic runs once per agent. The learning check (return >= 3.0 per agent within 1M frames) is a separate,
long run: ``--frames 1000000 --setups shoal_joint`` reports the mean episode return per agent at the end.

    python benchmarks/vmas_mappo.py [--rounds 3] [--iterations 3] [--threads 1]
    python benchmarks/vmas_mappo.py --setups shoal_joint --frames 1000000     # learning run (~10-15 min here)
    python benchmarks/vmas_mappo.py --compute-dtype bfloat16   # every side's update in mixed precision (autocast)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

ENVS, STEPS, EPOCHS, MINIBATCH, HIDDEN = 600, 10, 10, 400, 256
LR, CLIP, GAMMA, LAMBDA, ENTROPY, GRAD_NORM = 3e-4, 0.2, 0.99, 0.9, 1e-4, 1.0
VMAS = {"n_agents": 3, "continuous_actions": True, "max_steps": 100}


def shoal(critic: str, seed: int, dtype: str = "float32"):
    """A Shoal trainer; returns ``(run(iterations) -> frames, return per agent of the latest episodes)``."""
    from core.losses import PPOConfig
    from core.policies import PolicyConfig
    from orchestration.builder import build_trainer
    from orchestration.config import RolloutConfig, TrainConfig

    config = TrainConfig(
        env="vmas:navigation", env_kwargs=tuple((k, repr(v)) for k, v in VMAS.items()), seed=seed,
        iterations=10**6, lr=LR, anneal_lr=False, eval_every=0,
        rollout=RolloutConfig(num_envs=ENVS, fragment_length=STEPS),
        ppo=PPOConfig(num_epochs=EPOCHS, minibatch_size=MINIBATCH, clip_eps=CLIP, gamma=GAMMA, gae_lambda=LAMBDA,
                      entropy_coef=ENTROPY, max_grad_norm=GRAD_NORM, value_coef=1.0, compute_dtype=dtype),
        policy=PolicyConfig(hidden_sizes=(HIDDEN, HIDDEN), critic=critic))
    trainer = build_trainer(config)
    last = {}

    def run(iterations: int) -> int:
        for _ in range(iterations):
            metrics = trainer.train()
            last["learn_s"] = last.get("learn_s", 0.0) + metrics["time_learn"]
            if "episode_return_mean" in metrics:
                last["return_per_agent"] = metrics["episode_return_mean"] / VMAS["n_agents"]
        return iterations * ENVS * STEPS
    return run, last


def torchrl_mappo(seed: int, dtype: str = "float32"):
    """TorchRL's MAPPO loop (module docstring); returns ``(run(iterations) -> frames, latest returns)``."""
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.collectors import Collector
    from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.envs import RewardSum, TransformedEnv
    from torchrl.envs.libs.vmas import VmasEnv
    from torchrl.modules import MultiAgentMLP, ProbabilisticActor, TanhNormal
    from torchrl.objectives import ClipPPOLoss, ValueEstimators

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines go to stdout, where the JSON goes
    torch.manual_seed(seed)
    base = VmasEnv("navigation", num_envs=ENVS, device="cpu", seed=seed, **VMAS)
    env = TransformedEnv(base, RewardSum(in_keys=[base.reward_key], out_keys=[("agents", "episode_reward")]))
    obs_dim = env.observation_spec["agents", "observation"].shape[-1]
    action_spec = env.full_action_spec_unbatched[env.action_key]
    n, act_dim = VMAS["n_agents"], action_spec.shape[-1]
    actor_net = nn.Sequential(
        MultiAgentMLP(n_agent_inputs=obs_dim, n_agent_outputs=2 * act_dim, n_agents=n, centralized=False,
                      share_params=True, depth=2, num_cells=HIDDEN, activation_class=nn.Tanh),
        NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=[("agents", "observation")], out_keys=[("agents", "loc"), ("agents", "scale")]),
        spec=action_spec, in_keys=[("agents", "loc"), ("agents", "scale")], out_keys=[env.action_key],
        distribution_class=TanhNormal, distribution_kwargs={"low": action_spec.space.low, "high": action_spec.space.high},
        return_log_prob=True)
    critic = TensorDictModule(
        MultiAgentMLP(n_agent_inputs=obs_dim, n_agent_outputs=1, n_agents=n, centralized=True, share_params=True,
                      depth=2, num_cells=HIDDEN, activation_class=nn.Tanh),
        in_keys=[("agents", "observation")], out_keys=[("agents", "state_value")])
    collector = Collector(env, actor, frames_per_batch=ENVS * STEPS, total_frames=-1, device="cpu")
    buffer = ReplayBuffer(storage=LazyTensorStorage(ENVS * STEPS), sampler=SamplerWithoutReplacement(),
                          batch_size=MINIBATCH)
    loss = ClipPPOLoss(actor_network=actor, critic_network=critic, clip_epsilon=CLIP, entropy_coeff=ENTROPY,
                       normalize_advantage=True)  # as Shoal's PPOConfig and the anchor's MAPPOLoss
    loss.set_keys(reward=env.reward_key, action=env.action_key, value=("agents", "state_value"),
                  sample_log_prob=("agents", "action_log_prob"),
                  done=("agents", "done"), terminated=("agents", "terminated"))
    loss.make_value_estimator(ValueEstimators.GAE, gamma=GAMMA, lmbda=LAMBDA)
    optimizer = torch.optim.Adam(loss.parameters(), LR)
    batches = iter(collector)
    last = {}

    def run(iterations: int) -> int:
        for _ in range(iterations):
            data = next(batches)
            shape = data.get_item_shape(("next", env.reward_key))
            for key in ("done", "terminated"):
                data.set(("next", "agents", key), data.get(("next", key)).unsqueeze(-1).expand(shape))
            with torch.no_grad():
                loss.value_estimator(data, params=loss.critic_network_params,
                                     target_params=loss.target_critic_network_params)
            buffer.extend(data.reshape(-1))
            start = time.perf_counter()
            for _ in range(EPOCHS):
                for _ in range(ENVS * STEPS // MINIBATCH):
                    with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):
                        terms = loss(buffer.sample())
                    total = terms["loss_objective"] + terms["loss_critic"] + terms["loss_entropy"]
                    total.backward()
                    torch.nn.utils.clip_grad_norm_(loss.parameters(), GRAD_NORM)
                    optimizer.step()
                    optimizer.zero_grad()
            last["learn_s"] = last.get("learn_s", 0.0) + time.perf_counter() - start
            collector.update_policy_weights_()
            ended = data.get(("next", "agents", "done"))
            if ended.any():
                last["return_per_agent"] = float(data.get(("next", "agents", "episode_reward"))[ended].mean())
        return iterations * ENVS * STEPS
    return run, last


OBS, ACT = 18, 2  # navigation's per-agent observation and action widths (3 agents)
#: (rows per minibatch, layer widths) of the actor and the critic of each setup: the critic's input is the agent's
#: own observation plus all three (central), or all three once per env (joint, TorchRL's centralised critic)
#: (Shoal's Gaussian has a state-independent log-std: ACT outputs; TorchRL's NormalParamExtractor takes 2 * ACT)
SHAPES = {"shoal_central": [(3 * MINIBATCH, [OBS, HIDDEN, HIDDEN, ACT]), (3 * MINIBATCH, [4 * OBS, HIDDEN, HIDDEN, 1])],
          "shoal_joint": [(3 * MINIBATCH, [OBS, HIDDEN, HIDDEN, ACT]), (MINIBATCH, [3 * OBS, HIDDEN, HIDDEN, 3])],
          "torchrl": [(3 * MINIBATCH, [OBS, HIDDEN, HIDDEN, 2 * ACT]), (MINIBATCH, [3 * OBS, HIDDEN, HIDDEN, 1])]}


def matmul_flops(shapes) -> int:
    """FLOPs of the matmuls of one minibatch step: forward, and backward's weight and input gradients (no input
    gradient into the first layer)."""
    total = 0
    for rows, widths in shapes:
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            total += 2 * rows * a * b * (2 if i == 0 else 3)
    return total


def matmul_chain_flops_per_s(shapes, seconds: float = 1.0, dtype: str = "float32") -> float:
    """FLOP/s of the bare matmuls of one minibatch step (``torch.mm`` on random tensors, no activation, no
    optimiser): the limit the update's achieved FLOP/s is read against."""
    g = torch.Generator().manual_seed(0)
    mats = []
    for rows, widths in shapes:
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            x, w, grad = (torch.randn(*s, generator=g).to(getattr(torch, dtype))
                          for s in ((rows, a), (a, b), (rows, b)))
            mats.append((x, w, grad, i > 0))

    def step() -> None:
        for x, w, grad, input_grad in mats:
            torch.mm(x, w), torch.mm(x.t(), grad)
            if input_grad:
                torch.mm(grad, w.t())
    for _ in range(3):
        step()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return count * matmul_flops(shapes) / (time.perf_counter() - start)


SETUPS = {"shoal_central": lambda seed, dtype: shoal("central", seed, dtype),
          "shoal_joint": lambda seed, dtype: shoal("joint", seed, dtype), "torchrl": torchrl_mappo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3, help="iterations per setup per round")
    parser.add_argument("--frames", type=int, default=0, help="a learning run of this many frames instead")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the update's dtype on every side: Shoal's --ppo.compute-dtype, TorchRL's loss under "
                             "torch.autocast, the matmul chain's tensors")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    built = {name: SETUPS[name](args.seed, args.compute_dtype) for name in args.setups}
    result: dict = {"benchmark": "vmas_mappo", "threads": args.threads, "envs": ENVS, "steps": STEPS, "epochs": EPOCHS,
                    "minibatch_frames": MINIBATCH, "hidden": [HIDDEN, HIDDEN], "torch": torch.__version__,
                    "compute_dtype": args.compute_dtype}
    if args.frames:
        for name, (run, last) in built.items():
            start, frames = time.perf_counter(), 0
            while frames < args.frames:
                frames += run(1)
            result[name] = {"frames": frames, "seconds": round(time.perf_counter() - start, 1),
                            "return_per_agent": last.get("return_per_agent")}
        print(json.dumps(result))
        return
    for run, last in built.values():
        run(1)  # warm-up: lazy imports, allocator, first episodes
        last["learn_s"] = 0.0
    rates: dict[str, list[float]] = {name: [] for name in built}
    limits: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.rounds):
        for name, (run, _) in built.items():
            start = time.perf_counter()
            frames = run(args.iterations)
            rates[name].append(frames / (time.perf_counter() - start))
            limits[name].append(matmul_chain_flops_per_s(SHAPES[name], dtype=args.compute_dtype))
    steps = EPOCHS * (ENVS * STEPS // MINIBATCH) * args.iterations * args.rounds  # minibatch steps timed
    result["frames_per_s"] = {name: round(statistics.median(r)) for name, r in rates.items()}
    result["sgd_matmul_gflop_per_minibatch"] = {name: round(matmul_flops(SHAPES[name]) / 1e9, 3) for name in built}
    result["update_gflop_per_s"] = {name: round(matmul_flops(SHAPES[name]) * steps / built[name][1]["learn_s"] / 1e9, 2)
                                    for name in built}
    result["matmul_chain_gflop_per_s"] = {name: round(statistics.median(v) / 1e9, 2) for name, v in limits.items()}
    result["update_vs_matmul_chain"] = {name: round(result["update_gflop_per_s"][name]
                                                    / result["matmul_chain_gflop_per_s"][name], 3) for name in built}
    result["runs"] = {name: [round(x) for x in r] for name, r in rates.items()}
    if "torchrl" in rates:
        result["vs_torchrl"] = {name: round(statistics.median(a / b for a, b in zip(r, rates["torchrl"])), 3)
                                for name, r in rates.items() if name != "torchrl"}
        result["target_vs_torchrl"] = 2.0
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
