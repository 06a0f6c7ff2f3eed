"""``ppo_update_``: learning on a fixed batch, determinism, the NaN guard, masks, a hand-written oracle."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import pathlib
import sys

import pytest
import torch
from tensordict import TensorDict

from core.losses import PPOConfig, ppo_loss, ppo_update_

G, OBS, ACTIONS = "agents", 3, 3


def make_nets(seed: int = 0):
    torch.manual_seed(seed)  # tests only: fixes initial weights
    actor = torch.nn.Sequential(torch.nn.Linear(OBS, 16), torch.nn.Tanh(), torch.nn.Linear(16, ACTIONS))
    critic = torch.nn.Sequential(torch.nn.Linear(OBS, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    nets = torch.nn.ModuleList([actor, critic])
    return nets, torch.optim.Adam(nets.parameters(), lr=1e-2, eps=1e-5, fused=True)


def make_evaluate(nets, poison=None):
    """``poison(call_index, outputs)`` may replace the outputs of a call (NaN injection)."""
    actor, critic = nets
    calls = []

    def evaluate(mb):
        obs, action = mb[G, "observation"], mb[G, "action"]
        log_p = actor(obs).log_softmax(-1)
        out = {"log_prob": log_p.gather(-1, action.unsqueeze(-1)), "state_value": critic(obs),
               "entropy": -(log_p.exp() * log_p).sum(-1, keepdim=True)}
        calls.append(mb.batch_size[0])
        return poison(len(calls) - 1, out) if poison else out

    evaluate.calls = calls
    return evaluate


def make_batch(nets, n: int = 64, agents: int = 2, seed: int = 1, mask: bool = False) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, agents, OBS, generator=g)
    actor, critic = nets
    with torch.no_grad():
        logits = actor(obs)
        action = torch.multinomial(logits.softmax(-1).reshape(-1, ACTIONS), 1, generator=g).reshape(n, agents)
        log_prob = logits.log_softmax(-1).gather(-1, action.unsqueeze(-1))
        value = critic(obs)
    adv = torch.randn(n, agents, 1, generator=g)
    group = TensorDict(observation=obs, action=action, log_prob=log_prob, state_value=value, advantage=adv,
                       value_target=value + adv + 0.5 * torch.randn(n, agents, 1, generator=g), batch_size=[n, agents])
    if mask:
        group["mask"] = torch.rand(n, agents, generator=g) < 0.7
    nxt = TensorDict({G: TensorDict(reward=torch.randn(n, agents, 1, generator=g), batch_size=[n, agents])},
                     batch_size=[n])
    return TensorDict({G: group, "next": nxt}, batch_size=[n])


def snapshot(nets, opt) -> list[torch.Tensor]:
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    return [p.detach().clone() for p in nets.parameters()] + state


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def full_batch_loss(nets, batch, cfg) -> TensorDict:
    with torch.no_grad():
        return ppo_loss(batch[G], make_evaluate(nets)(batch), cfg, batch[G].get("mask", None))


def test_update_lowers_the_loss_on_a_fixed_batch():
    nets, opt = make_nets()
    batch = make_batch(nets)
    cfg = PPOConfig(minibatch_size=16, num_epochs=4, entropy_coef=0.01)
    before, params0 = full_batch_loss(nets, batch, cfg), snapshot(nets, opt)
    metrics = ppo_update_(nets, opt, batch, make_evaluate(nets), cfg, torch.Generator().manual_seed(0), group=G)
    after = full_batch_loss(nets, batch, cfg)
    assert before["loss_policy"].abs().item() < 1e-6  # on-policy: -mean(normalised advantage) = 0
    assert after["loss_policy"].item() < -0.01  # the clipped surrogate improved
    assert after["loss_value"].item() < before["loss_value"].item() - 0.005
    assert after["approx_kl"].item() > 0 and after["clip_fraction"].item() > 0
    assert not same(snapshot(nets, opt)[: len(params0)], params0)
    assert metrics["num_minibatches"].item() == 16 and metrics["skipped_steps"].item() == 0
    assert metrics["num_epochs"].item() == 4
    assert all(math.isfinite(metrics[k].item()) for k in ("loss_policy", "loss_value", "approx_kl", "grad_norm",
                                                          "clip_fraction", "entropy", "explained_variance"))


def test_last_minibatch_may_be_smaller_and_every_sample_is_used_once_per_epoch():
    nets, opt = make_nets()
    evaluate = make_evaluate(nets)
    ppo_update_(nets, opt, make_batch(nets, n=50), evaluate, PPOConfig(minibatch_size=16, num_epochs=2),
                torch.Generator().manual_seed(0), group=G)
    assert evaluate.calls == [16, 16, 16, 2] * 2


def test_same_seed_same_parameters_other_seed_other_parameters():
    results = []
    for seed in (3, 3, 4):
        nets, opt = make_nets()
        ppo_update_(nets, opt, make_batch(nets), make_evaluate(nets), PPOConfig(minibatch_size=16),
                    torch.Generator().manual_seed(seed), group=G)
        results.append(snapshot(nets, opt))
    assert same(results[0], results[1]) and not same(results[0], results[2])


def test_nan_from_evaluate_skips_the_step_and_leaves_params_and_adam_state_untouched():
    nets, opt = make_nets()
    seen = []

    def poison(i, out):
        seen.append(snapshot(nets, opt))  # state before minibatch i
        if i == 2:
            out = dict(out, log_prob=out["log_prob"] * math.nan)
        return out

    cfg = PPOConfig(minibatch_size=16, num_epochs=1)
    metrics = ppo_update_(nets, opt, make_batch(nets), make_evaluate(nets, poison), cfg,
                          torch.Generator().manual_seed(0), group=G)
    assert metrics["skipped_steps"].item() == 1 and metrics["num_minibatches"].item() == 4
    assert not same(seen[1], seen[2])  # minibatch 1 was applied
    assert same(seen[2], seen[3])  # minibatch 2 was skipped: parameters and Adam moments and step count unchanged
    assert math.isfinite(metrics["loss_policy"].item())  # the skipped step is left out of the means


def test_non_finite_gradient_with_finite_loss_is_skipped():
    nets, opt = make_nets()
    first_weight = next(nets.parameters())
    fire = {"on": False}
    first_weight.register_hook(lambda grad: grad * math.inf if fire["on"] else grad)
    seen = []

    def poison(i, out):
        seen.append(snapshot(nets, opt))
        fire["on"] = i == 0
        return out

    metrics = ppo_update_(nets, opt, make_batch(nets), make_evaluate(nets, poison),
                          PPOConfig(minibatch_size=32, num_epochs=1), torch.Generator().manual_seed(0), group=G)
    assert metrics["skipped_steps"].item() == 1
    n_params = len(list(nets.parameters()))
    assert same(seen[0], seen[1]) and len(seen[1]) == n_params  # nothing moved, Adam had not stepped yet
    assert len(snapshot(nets, opt)) > n_params  # ...and it did step on the second minibatch
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in nets.parameters())


def test_nan_in_the_batch_is_counted_once_per_epoch_unless_the_agent_is_masked():
    nets, opt = make_nets()
    batch = make_batch(nets)
    batch[G, "advantage"][5, 1] = math.nan
    metrics = ppo_update_(nets, opt, batch, make_evaluate(nets), PPOConfig(minibatch_size=16, num_epochs=3),
                          torch.Generator().manual_seed(0), group=G)
    assert metrics["skipped_steps"].item() == 3
    assert all(torch.isfinite(p).all() for p in nets.parameters())

    # the same NaN behind a mask is padding: no skip, and the result equals that of zero padding
    results = []
    for pad in (math.nan, 0.0):
        nets, opt = make_nets()
        batch = make_batch(nets, mask=True)
        batch[G, "mask"][5, 1] = False
        for key in ("advantage", "log_prob", "state_value", "value_target"):
            batch[G, key][5, 1] = pad
        metrics = ppo_update_(nets, opt, batch, make_evaluate(nets), PPOConfig(minibatch_size=16),
                              torch.Generator().manual_seed(0), group=G)
        assert metrics["skipped_steps"].item() == 0
        results.append(snapshot(nets, opt))
    assert same(results[0], results[1])


def test_one_step_matches_a_hand_written_torch_step_with_active_clipping():
    cfg = PPOConfig(minibatch_size=64, num_epochs=1, max_grad_norm=0.01, entropy_coef=0.01, value_clip_eps=0.2)
    nets, opt = make_nets()
    batch = make_batch(nets)
    metrics = ppo_update_(nets, opt, batch, make_evaluate(nets), cfg, torch.Generator().manual_seed(0), group=G)

    ref_nets, ref_opt = make_nets()
    b, cur = batch[G], make_evaluate(ref_nets)(batch)  # one minibatch = the whole batch (order is irrelevant)
    adv = (b["advantage"] - b["advantage"].mean()) / (b["advantage"].std() + 1e-8)
    ratio = (cur["log_prob"] - b["log_prob"]).exp()
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    v_clip = b["state_value"] + (cur["state_value"] - b["state_value"]).clamp(-0.2, 0.2)
    v_loss = 0.5 * torch.max((cur["state_value"] - b["value_target"]) ** 2, (v_clip - b["value_target"]) ** 2).mean()
    loss = pg + 0.5 * v_loss - 0.01 * cur["entropy"].mean()
    ref_opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref_nets.parameters(), 0.01)
    ref_opt.step()
    assert norm.item() > 0.01  # clipping was active
    assert metrics["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-5)
    for p, q in zip(nets.parameters(), ref_nets.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_target_kl_stops_after_the_first_epoch():
    nets, opt = make_nets()
    metrics = ppo_update_(nets, opt, make_batch(nets), make_evaluate(nets),
                          PPOConfig(minibatch_size=16, num_epochs=4, target_kl=1e-9),
                          torch.Generator().manual_seed(0), group=G)
    assert metrics["num_epochs"].item() == 1 and metrics["num_minibatches"].item() == 4


def test_one_group_of_a_multi_group_batch_is_trained_and_the_batch_is_checked():
    nets, opt = make_nets()
    batch = make_batch(nets)
    batch["others"] = TensorDict(x=torch.zeros(64, 5, 1), batch_size=[64, 5])  # another group, ignored
    before = batch.clone()
    metrics = ppo_update_(nets, opt, batch, make_evaluate(nets), PPOConfig(minibatch_size=32),
                          torch.Generator().manual_seed(0), group=G)
    assert metrics["skipped_steps"].item() == 0
    assert (batch == before).all()  # the batch itself is not modified
    with pytest.raises(ValueError, match="flat"):
        ppo_update_(nets, opt, batch.reshape(8, 8), make_evaluate(nets), PPOConfig(), torch.Generator(), group=G)
    del batch[G, "value_target"]
    with pytest.raises(KeyError, match="value_target"):
        ppo_update_(nets, opt, batch, make_evaluate(nets), PPOConfig(), torch.Generator(), group=G)


def test_benchmark_quick_run_prints_its_json():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "ppo_update.py"
    spec = importlib.util.spec_from_file_location("benchmark_ppo_update", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, argv, threads = io.StringIO(), sys.argv, torch.get_num_threads()
    try:
        sys.argv = [str(path), "--quick"]
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    result = json.loads(out.getvalue())
    assert result["ours_samples_per_s"] > 0 and result["hand_samples_per_s"] > 0
    assert result["max_param_diff_ours_vs_hand"] < 1e-5  # same data, same permutations, same maths


@pytest.mark.parametrize("mask", [False, True])
def test_reported_diagnostics_are_those_of_every_applied_step_together(monkeypatch, mask):
    """The update reduces its diagnostics' inputs in chunks of steps as it goes (memory: nothing per step
    outlives its chunk); over 2 epochs of 23 minibatches (several chunks, a partial one at each epoch's end)
    the reported values are :func:`core.losses.ppo.diagnostics` of all the steps' inputs at once."""
    import core.losses.update as update_module
    from core.losses.ppo import diagnostics

    seen, loss_terms = [], update_module.loss_terms

    def recording(adv, old_lp, old_v, target, lp, value, entropy, mask_, cfg, **kw):
        out = loss_terms(adv, old_lp, old_v, target, lp, value, entropy, mask_, cfg, **kw)
        seen.append((out[3].detach().clone(), value.detach().clone(), target.clone(), entropy.detach().clone(),
                     None if mask_ is None else mask_.clone()))
        return out

    monkeypatch.setattr(update_module, "loss_terms", recording)
    nets, opt = make_nets()
    cfg = PPOConfig(minibatch_size=8, num_epochs=2)
    metrics = ppo_update_(nets, opt, make_batch(nets, n=180, mask=mask), make_evaluate(nets), cfg,
                          torch.Generator().manual_seed(0), group=G)
    assert len(seen) == 46 and metrics["skipped_steps"].item() == 0
    columns = [None if c[0] is None else torch.cat(c) for c in zip(*seen)]
    expected = diagnostics(*columns, cfg)
    for key, value in zip(("approx_kl", "clip_fraction", "entropy", "explained_variance"), expected):
        torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_a_bfloat16_update_computes_in_bfloat16_keeps_float32_state_and_lands_near_the_float32_one():
    """``compute_dtype="bfloat16"``: the evaluation runs under autocast (the layers' outputs are bfloat16);
    parameters, gradients and Adam's state stay float32; the result differs from the float32 update (it did
    compute otherwise) by a small part of what the update moved."""
    cfg = dict(num_epochs=2, minibatch_size=16)
    start, _ = make_nets()
    initial = [p.detach().clone() for p in start.parameters()]
    params, seen = {}, {}
    for dtype in ("float32", "bfloat16"):
        nets, opt = make_nets()
        batch = make_batch(nets)
        seen[dtype] = set()
        nets[0][0].register_forward_hook(lambda m, i, out, s=seen[dtype]: s.add(out.dtype))
        out = ppo_update_(nets, opt, batch, make_evaluate(nets), PPOConfig(compute_dtype=dtype, **cfg),
                          torch.Generator().manual_seed(3), group=G)
        assert int(out["skipped_steps"]) == 0 and math.isfinite(float(out["loss_policy"]))
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in nets.parameters())
        assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
        params[dtype] = [p.detach().clone() for p in nets.parameters()]
    assert seen == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}
    moved = sum((p - q).norm() ** 2 for p, q in zip(params["float32"], initial)).sqrt()
    apart = sum((p - q).norm() ** 2 for p, q in zip(params["bfloat16"], params["float32"])).sqrt()
    assert 0 < apart < 0.2 * moved, (float(apart), float(moved))


def test_compute_dtype_is_checked():
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        PPOConfig(compute_dtype="float16")
