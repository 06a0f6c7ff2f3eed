"""Configuration records of a training run, each declared once (the CLI builds them with tyro)."""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config_kinds import check_fields, field_hints
from orchestration.external_config import ExternalConfig
from orchestration.distributed_config import RayConfig
from orchestration.team_critic_config import TeamCriticConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How experience is collected: envs per actor, fragment length, actors, checks and env processes."""

    num_envs: int = 16
    """Envs stepped together by one actor (one batched forward pass per step serves all of them)."""
    fragment_length: int = 64
    """Steps per fragment; a fragment boundary is not an episode end (it is bootstrapped)."""
    num_workers: int = 1
    """Rollout workers (actors), each with ``num_envs`` envs."""
    check: Literal["strict", "lenient"] = "strict"
    """Bad env output: raise a named error (strict) or repair or restart and count it (lenient). Lenient runs keep
    the envs in a subprocess (``env_processes``, at least one). An output the adapter can repair in place (a NaN
    reward, a value out of its space; a wrong shape in a PettingZoo env) ends that env's episode truncated
    (``env/invalid_output_truncations``). An env that raises, hangs, dies or returns what its adapter cannot
    store (a gymnasium observation of the wrong shape) is restarted: the episodes of every env of its process
    end truncated (``env/episodes_lost``); more processes lose fewer episodes per fault. Either way the cut
    episodes' partial returns stay out of the return statistics; evaluation envs count theirs as ``eval_env/*``."""
    env_processes: int = 0
    """Run each actor's envs in this many subprocesses (``adapters.env_worker.EnvWorkerPool``): slow Python envs
    use more cores, and an env that hangs, crashes or raises is restarted, its episodes truncated and counted
    (``env/env_restarts``, ``env/step_timeouts``, ``env/episodes_lost``). 0: in the actor's process."""
    env_timeout_s: float = 0.0
    """A step or reset slower than this counts as hung: the env's process is killed and restarted. Setting it
    runs the envs in subprocesses (one unless ``env_processes`` says more); 0: the pool's default (30 s)."""
    central_inference: bool = False
    """Actors hold no policy copy: every step asks one batched inference service (in this process locally, a
    Ray actor on Ray, on a GPU the learners leave when there is one and ``--device`` is not ``cpu``), which
    answers all actors' requests in shared forward passes (``orchestration.service_policy``)."""
    env_polling: bool = False
    """With ``env_processes`` >= 2: act for whichever env processes are ready instead of waiting for all of them
    (``orchestration.polling_actor``), so a slow or hung process holds back only its own envs. Each process is
    then its own fragment stream ``[num_envs / env_processes, T]`` with its own worker id. Which process is ready
    first depends on timing, so a run with polling is not reproducible from its seed (nor resumed bit for bit)."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("num_envs", "fragment_length", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("env_processes", "env_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RolloutConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.env_processes > self.num_envs:
            raise ValueError(f"RolloutConfig.env_processes ({self.env_processes}) cannot exceed num_envs "
                             f"({self.num_envs}): every process runs at least one env")
        if self.env_polling and (self.env_processes < 2 or self.num_envs % self.env_processes):
            raise ValueError(f"RolloutConfig.env_polling needs env_processes >= 2 dividing num_envs (every process a "
                             f"fragment stream of one size); got env_processes={self.env_processes}, "
                             f"num_envs={self.num_envs}")
        if self.env_polling and self.num_workers * self.env_processes > 2**16:
            raise ValueError("RolloutConfig.env_polling: num_workers * env_processes must be <= 65536 worker ids")

    @property
    def steps_per_round(self) -> int:
        """Env steps one round of fragments (one per worker) brings."""
        return self.num_envs * self.fragment_length * self.num_workers

    @property
    def fragment_steps(self) -> int:
        """Env steps in one fragment: one actor's envs, or one env process's with ``env_polling``."""
        return (self.num_envs // self.env_processes if self.env_polling else self.num_envs) * self.fragment_length


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainConfig:
    """Behaviour cloning before PPO starts (docs/datasets.md): every learning policy is cloned on a recorded
    dataset of the run's env (``orchestration.dataset_learner.pretrain_``). A resumed run skips it."""

    dataset: str = ""
    """A dataset directory (``orchestration.datasets.save_dataset``) recorded in an env of the run's tree;
    empty: no pretraining."""
    steps: int = 1000
    """Gradient steps of behaviour cloning per learning policy."""
    lr: float = 1e-3
    """Adam learning rate of behaviour cloning."""
    minibatch_size: int = 256
    """Transitions per behaviour-cloning step."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name, ok, rule in (("steps", self.steps >= 0, ">= 0"), ("minibatch_size", self.minibatch_size >= 1, ">= 1"),
                               ("lr", 0 < self.lr < math.inf, "> 0 and finite")):
            if not ok:
                raise ValueError(f"PretrainConfig.{name} must be {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CuriosityConfig:
    """A curiosity bonus by random network distillation (Burda et al. 2018, arXiv:1810.12894;
    ``orchestration.curiosity``): every learning policy adds ``coef`` times a scaled prediction error of the next
    observation to its rewards, before reward scaling and GAE. Vector (box, discrete) observations only."""

    coef: float = 0.0
    """Weight of the intrinsic reward added to the env's reward; 0: off (no RND networks are built)."""
    lr: float = 1e-3
    """Adam learning rate of the predictor network."""
    epochs: int = 1
    """Gradient steps of the predictor per training batch (each on a fresh random ``proportion`` of it)."""
    proportion: float = 0.25
    """Fraction of the batch's present samples the predictor trains on (the paper's update proportion)."""
    gamma: float = 0.99
    """Discount of the non-episodic intrinsic returns whose running std scales the bonus (the paper's 0.99)."""
    hidden_size: int = 64
    """Width of the hidden layers: two in the target network, three in the predictor (ReLU MLPs)."""
    features: int = 64
    """Width of the random features the predictor learns to match."""

    def __post_init__(self) -> None:
        check_fields(self)
        rules = {"coef": (self.coef >= 0, ">= 0"), "lr": (self.lr > 0, "> 0"), "epochs": (self.epochs >= 1, ">= 1"),
                 "proportion": (0 < self.proportion <= 1, "in (0, 1]"), "gamma": (0 <= self.gamma < 1, "in [0, 1)"),
                 "hidden_size": (self.hidden_size >= 1, ">= 1"), "features": (self.features >= 1, ">= 1")}
        for name, (ok, rule) in rules.items():  # the first field at fault, named alone
            if not ok:
                raise ValueError(f"CuriosityConfig.{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        """Whether the bonus is on (``coef > 0``)."""
        return self.coef > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PastSelvesConfig:
    """Self-play against past selves (:mod:`orchestration.past_selves`)."""

    fraction: float = 0.5
    """Fraction of the games in which a past self plays one seat (0: plain self-play). It applies to groups of
    a zero-sum population whose every seat one learning, feed-forward policy plays (connect four's players)."""
    snapshot_every: int = 5
    """Policy versions between two snapshots added to the pool (the initial weights are the first)."""
    pool_size: int = 8
    """Snapshots kept: the oldest (but the initial one) leaves when a new one comes."""

    def __post_init__(self) -> None:
        check_fields(self)
        bad = [f"--past-selves.{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}"
               for name, rule, ok in (("fraction", "in [0, 1]", 0.0 <= self.fraction <= 1.0),
                                      ("snapshot_every", ">= 1", self.snapshot_every >= 1),
                                      ("pool_size", ">= 1", self.pool_size >= 1)) if not ok]
        if bad:
            raise ValueError("; ".join(bad))


def _literal(name: str, value: Any) -> str:
    """``value`` of env keyword ``name`` as the Python literal text ``env_kwargs`` holds (a string as it is: the
    text of a literal already, or a bare word that :func:`orchestration.envs.parse_kwargs` keeps as a string)."""
    if isinstance(value, str):
        return value
    value = value.item() if hasattr(value, "item") and callable(value.item) else value  # numpy, torch scalars
    try:
        if ast.literal_eval(repr(value)) == value:
            return repr(value)
    except (ValueError, SyntaxError):
        pass
    raise TypeError(f"TrainConfig.env_kwargs {name}: {value!r} has no Python literal form (env_kwargs holds "
                    f"numbers, strings, bools, None and containers of them)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """A whole training run: environment, rollout, PPO, policy, budget, evaluation, outputs."""

    env: str = "CartPole-v1"
    """Environment: a gymnasium id (``CartPole-v1``), ``mpe2:simple_spread_v3``, ``pettingzoo:classic.connect_four_v3``,
    a VMAS scenario (``vmas:navigation``), a built-in one (``builtin:cartpole``, ``builtin:spread``), or
    ``external``: simulators that connect over the network (``external`` settings)."""
    env_kwargs: tuple[tuple[str, str], ...] = ()
    """Extra keyword arguments of the env constructor as ``(name, python literal)`` pairs (from Python, a dict
    ``{"max_cycles": 25}`` is taken too and kept as such pairs)."""
    collection: str | None = None
    """An environment collection to train on instead of ``env`` (``orchestration.env_collection``): a
    ``.json``/``.yaml`` file, or the JSON document itself (format ``shoal.envcollection/1``: envs by id plus a
    split, curriculum, adversarial set or prior). The run stores the document, so a resumed run never reads
    the file again; envs that import code (``module:factory``) are only allowed from a file."""
    seed: int = 0
    """Seed of every generator of the run (envs, sampling, minibatch order, initial weights)."""
    iterations: int = 100
    """Training iterations (each: ``train_batch_size`` env steps, then ``num_epochs`` of SGD, then sync)."""
    train_batch_size: int = 0
    """Env steps per iteration; 0 means one round of fragments (``num_envs * fragment_length * num_workers``)."""
    lr: float = 2.5e-4
    """Adam learning rate (CleanRL ``ppo.py``'s 2.5e-4; SB3's PPO uses 3e-4). Tuned values per task are in the
    presets (``shoal train --preset cartpole`` trains CartPole-v1 with 2.5e-3: ``orchestration/presets/``)."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over ``anneal_iterations`` (37 details, detail 4)."""
    anneal_iterations: int = 0
    """Horizon of the learning-rate schedule in iterations; 0 means ``iterations``. A resumed run keeps the
    horizon it started with, whatever ``--iterations`` says, so its schedule continues unchanged."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Experience collection."""
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(minibatch_size=256, entropy_coef=0.01))
    """Loss, estimator and update. Defaults of a run follow CleanRL's ``ppo.py``
    (https://github.com/vwxyzjn/cleanrl/blob/master/cleanrl/ppo.py): 4 epochs of 4 minibatches (256 of the
    1,024 steps of a round), entropy bonus 0.01, clip 0.2, gamma 0.99, GAE lambda 0.95, value weight 0.5,
    gradient norm 0.5; PPOConfig's own ``entropy_coef`` default is 0 (MAPPO/BenchMARL)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Networks built from the tree spec."""
    policy_mapping: tuple[tuple[str, str], ...] = ()
    """Overrides of the default agent -> policy mapping as ``(agent, policy id)`` pairs, e.g.
    ``(("player_1", "random"),)``; the default (from the tree) is one shared policy per group."""
    fixed_policies: tuple[str, ...] = ()
    """Policy ids that do not learn (frozen); ``random`` is always a fixed uniform-random policy."""
    eval_every: int = 0
    """Evaluate every N iterations on separate envs with deterministic actors; 0 disables."""
    eval_episodes: int = 10
    """Episodes per evaluation, each played from its first step, as many from each eval env (the first to end
    would favour short ones)."""
    checkpoint_every: int = 0
    """Write a checkpoint every N iterations (and at the end); 0: only the time-based ones and the end."""
    checkpoint_every_s: float = 600.0
    """Also write a checkpoint when this many seconds passed since the last one (0 disables). A run also
    writes one when interrupted (SIGINT, SIGTERM) or when an iteration raises."""
    keep_checkpoints: int = 3
    """Checkpoints kept under ``checkpoints/``: the newest N (an older one is removed once a newer one is complete);
    0 keeps every one (e.g. to evaluate a run's progress later). A league keeps at least 2 of each."""
    max_skipped_updates: int = 3
    """Stop with an error naming the policy and the first non-finite tensor after this many consecutive
    updates whose every step was skipped (non-finite loss or gradients); 0 never stops."""
    run_dir: str = ""
    """Directory for metrics.csv, TensorBoard files, the learning-curve PNG, checkpoints and run.json; empty:
    a fresh ``runs/<env>__<seed>__<time>`` per run (``--resume`` needs the directory named). A directory that
    holds a run's checkpoints takes only ``--resume``: a new run there would mix two runs' files. Written by
    ``shoal train`` and, from Python, :func:`orchestration.run_loop.run_training`; ``Trainer.train`` alone
    writes nothing (docs/single-agent.md, "From Python")."""
    loggers: tuple[str, ...] = ("csv", "tensorboard")
    """Where each iteration's metrics (evaluation included) go: ``csv`` (``run_dir/metrics.csv``, against env
    steps), ``tensorboard`` (``run_dir/tensorboard``), ``wandb`` (Weights & Biases; ``pip install
    'shoal[wandb]'``, offline with ``WANDB_MODE=offline``), ``mlflow`` (``pip install 'shoal[mlflow]'``). The
    trackers log against the iteration, name the run after ``run_dir`` and record this config."""
    project: str = "shoal"
    """The W&B project and the MLflow experiment that the run is logged under."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store, e.g. ``sqlite:///mlflow.db`` or ``http://host:5000``; empty: MLflow's
    default (``MLFLOW_TRACKING_URI``, else its store in the working directory)."""
    device: str = "auto"
    """Learner device: ``auto`` (CUDA when present), ``cpu[:i]``, ``cuda[:i]`` or ``mps``. An env's own device
    (built-in and VMAS envs) is its ``--env-kwargs device``; actors act where their env steps, so with both on
    CUDA, stepping, acting, fragments and training stay on the GPU (on Ray: ``--ray.worker-num-gpus``)."""
    threads: int = 1
    """torch CPU threads of the ``shoal train`` process. 1 suits small networks (matmuls this small do not split
    well, and the env steps in the same thread anyway); raise it for wide networks trained on the CPU."""
    backend: Literal["local", "ray"] = "local"
    """``local``: everything in this process; ``ray``: rollout workers and learners as Ray actors."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: collect ``train_batch_size`` env steps with the current weights, train, broadcast.
    ``async``: actors keep producing while learners train whenever a batch is ready, and pick up new weights
    at their next fragment boundary; on the local backend a deterministic serial interleaving."""
    max_staleness: int = 1
    """Asynchronous mode: fragments whose policy version lags the learner's by more than this are dropped and
    counted (``fragments_stale``), never trained on."""
    reuse_limit: int = 1
    """Times a fragment may be trained on (asynchronous mode tops a batch up with reusable data)."""
    address: str | None = None
    """Ray cluster address to join (else ``RAY_ADDRESS``; else a local Ray instance is started)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Modes, placement and bounds of the Ray backend (used with ``backend="ray"``)."""
    external: ExternalConfig = field(default_factory=ExternalConfig)
    """The server and simulator launcher of ``--env external`` (docs/external-protocol.md)."""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    """Behaviour cloning on a recorded dataset before PPO starts (``--pretrain.dataset PATH``)."""
    past_selves: PastSelvesConfig = field(default_factory=PastSelvesConfig)
    """Self-play against past selves in a fraction of the games (``--past-selves.fraction 0``: plain self-play)."""
    curiosity: CuriosityConfig = field(default_factory=CuriosityConfig)
    """A random-network-distillation curiosity bonus on every learning policy's rewards (``--curiosity.coef``)."""
    team_critic: TeamCriticConfig = field(default_factory=TeamCriticConfig)
    """One critic per team shared by its policies, trained as a learner of its own (``--team-critic.enabled``)."""

    def __post_init__(self) -> None:
        self._check_kinds()
        for name, ok, rule in (("iterations", self.iterations >= 0, ">= 0"),
                               ("train_batch_size", self.train_batch_size >= 0, ">= 0"),
                               ("lr", 0 < self.lr < math.inf, "> 0 and finite"), ("threads", self.threads >= 1, ">= 1"),
                               ("seed", 0 <= self.seed < 2 ** 62, "in [0, 2**62)"),
                               ("eval_every", self.eval_every >= 0, ">= 0"),
                               ("eval_episodes", self.eval_episodes >= 1, ">= 1"),
                               ("checkpoint_every", self.checkpoint_every >= 0, ">= 0"),
                               ("max_staleness", self.max_staleness >= 0, ">= 0"),
                               ("anneal_iterations", self.anneal_iterations >= 0, ">= 0"),
                               ("checkpoint_every_s", self.checkpoint_every_s >= 0, ">= 0"),
                               ("keep_checkpoints", self.keep_checkpoints >= 0, ">= 0"),
                               ("max_skipped_updates", self.max_skipped_updates >= 0, ">= 0"),
                               ("reuse_limit", self.reuse_limit >= 1, ">= 1")):
            if not ok:
                raise ValueError(f"TrainConfig.{name} must be {rule}, got {getattr(self, name)!r}")
        from orchestration.devices import device_problem
        from orchestration.loggers import check_logger_names

        check_logger_names(self.loggers)
        if problem := device_problem(self.device):
            raise ValueError(problem)
        if self.ppo.advantage == "vtrace" and self.policy.recurrent:
            raise ValueError("--ppo.advantage vtrace: feed-forward policies only (a recurrent policy's "
                             "log-probabilities need its sequences); drop --policy.recurrent, or keep --ppo.advantage "
                             "gae")
        if self.curiosity.enabled and self.ray.learners_per_policy > 1:
            raise ValueError("curiosity.coef > 0 with ray.learners_per_policy > 1: the RND predictor is not trained "
                             "data-parallel yet; use one learner per policy")
        if self.train_batch_size and self.train_batch_size % (self.rollout.num_envs * self.rollout.fragment_length):
            raise ValueError(f"train_batch_size {self.train_batch_size} must be a multiple of num_envs * "
                             f"fragment_length = {self.rollout.num_envs * self.rollout.fragment_length}")
        if self.backend == "ray" and self.env.startswith("__main__:"):
            raise ValueError(f"--env {self.env} with --backend ray: Ray's workers are other processes and cannot "
                             f"import the script you run (__main__); move the factory into a module beside it "
                             f"(my_envs.py: --env my_envs:{self.env.split(':', 1)[1]}), or use --backend local")
        world, rows = self.ray.learners_per_policy, self.steps_per_iteration // self.rollout.fragment_length
        if self.backend == "ray" and rows % world:  # found here rather than by the learner actors once Ray runs
            made = (f"--train-batch-size {self.train_batch_size} / --rollout.fragment-length "
                    f"{self.rollout.fragment_length}" if self.train_batch_size else
                    f"--rollout.num-envs {self.rollout.num_envs} x --rollout.num-workers {self.rollout.num_workers}")
            raise ValueError(f"--ray.learners-per-policy {world}: each of a policy's data-parallel learners trains an "
                             f"equal share of a batch's env rows, and a batch holds {rows} ({made}); make it a "
                             f"multiple of {world}")

    def _check_kinds(self) -> None:
        """What Python callers get wrong before any value is read: a dict for a nested config (named with its
        class), a value of another kind than its field's (:func:`check_fields`), a misspelled backend;
        ``env_kwargs`` may be a dict (kept as its ``(name, repr)`` pairs), ``loggers`` one name."""
        for name, kind in field_hints(TrainConfig).items():
            value = getattr(self, name)
            if dataclasses.is_dataclass(kind) and not isinstance(value, kind):
                raise TypeError(f"TrainConfig.{name} must be a {kind.__name__}, got a {type(value).__name__}"
                                f"{f' (write {kind.__name__}(**{value!r}))' if isinstance(value, dict) else ''}")
        if callable(self.env):  # the form a Python caller wants: a factory, named by module path
            raise TypeError(f"TrainConfig.env takes a str: name a factory as 'module:function' (e.g. "
                            f"'{getattr(self.env, '__module__', 'my_envs')}:{getattr(self.env, '__name__', 'make')}'"
                            f"), which every worker imports; got the {type(self.env).__name__} itself")
        pairs = self.env_kwargs.items() if isinstance(self.env_kwargs, Mapping) else self.env_kwargs
        if not isinstance(pairs, (tuple, list, type({}.items()))) or not all(
                isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise TypeError(f"TrainConfig.env_kwargs must be (name, python literal) pairs, e.g. (('max_cycles', "
                            f"'25'),), or a dict {{'max_cycles': 25}}; got {self.env_kwargs!r}")
        if isinstance(self.env_kwargs, Mapping) or not all(isinstance(v, str) for _, v in pairs):
            # a dict, or values a config file wrote as numbers (``[[max_steps, 100]]``): kept as literal text
            object.__setattr__(self, "env_kwargs", tuple((k, _literal(k, v)) for k, v in pairs))
        if isinstance(self.loggers, str):  # a config file's ``loggers: wandb``
            object.__setattr__(self, "loggers", (self.loggers,))
        for config in (self, self.ppo, self.policy):  # the core's configs check values, not every kind
            check_fields(config)

    @property
    def schedule_iterations(self) -> int:
        """Iterations over which the learning rate anneals."""
        return self.anneal_iterations or self.iterations

    @property
    def steps_per_iteration(self) -> int:
        """Env steps collected per iteration."""
        return self.train_batch_size or self.rollout.steps_per_round


__all__ = ["CuriosityConfig", "ExternalConfig", "PretrainConfig", "RayConfig", "RolloutConfig", "TrainConfig"]
