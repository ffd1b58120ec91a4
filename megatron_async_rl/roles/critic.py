"""The learn side's critic and reward model: values, model rewards, GAE, the critic's steps.

Owned here, called by `roles.learn.LearnSide` (its stages of the same names):
- `critic_values`: the `critic` role's values of the step's tokens (the old values V_old, per
  position), and `reward_scores`: the `reward_model` role's score of each sample (its head at
  the last non-pad token), each on its role's own ranks; the reporting rank of each keeps them
  for the train stage's gather.
- `model_rewards`: rule_weight x the reward function's + weight x the reward model's.
- `gae_advantages`: per-token advantages and returns of PPO (`algorithms.ppo`: terminal
  token rewards, GAE over the model tokens, optional whitening) and the critic's metrics.
- `train_critic`: the critic's optimizer steps on the value loss, in mini-batches of its own
  --global-batch-size, `algorithm.ppo_epochs` epochs, exact under micro-batching like the
  actor's (`roles.learn.train_on_batch`).
Column t of every [B, T - 1] tensor describes position t (the state before token t + 1), the
layout of `rollout.batch`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_async_rl.algorithms import minibatch, ppo
from megatron_async_rl.algorithms.config import response_budget
from megatron_async_rl.rollout.batch import padding_BT

CRITIC_LOSS_KEYS = ("critic/value_loss",)
"""Each data-parallel replica reports its share of these: the leader adds them up."""


def _reports(role) -> bool:
    return role.is_last_stage and dist.get_rank(role.pgc.tp) == 0 and \
        dist.get_rank(role.pgc.dp) == 0  # fmt: skip


def critic_values(roles: dict, batch: dict) -> dict[str, torch.Tensor]:
    """The `critic_values` stage: the critic's old values [B, T - 1] on the rank that reports
    them (collective over the critic's ranks; empty elsewhere)."""
    critic = roles.get("critic")
    if critic is None:
        return {}
    size = len(batch["tokens"])
    values = critic.values(batch["tokens"], critic.args.get("micro_batch_size") or size)
    if values is not None and _reports(critic):
        return {"old_values": values[:, :-1].cpu()}
    return {}


def reward_scores(roles: dict, batch: dict, pad_id: int) -> dict[str, torch.Tensor]:
    """The `reward_model` stage: the reward model's scores [B] on the rank that reports them
    (collective over the reward model's ranks; empty elsewhere)."""
    scorer = roles.get("reward_model")
    if scorer is None:
        return {}
    mbs = scorer.args.get("micro_batch_size") or len(batch["tokens"])
    scores = scorer.scores(batch["tokens"], pad_id, mbs)
    if scores is not None and _reports(scorer):
        return {"rm_scores": scores.cpu()}
    return {}


def model_rewards(rewards_B: torch.Tensor, scores_B: torch.Tensor, cfg) -> torch.Tensor:
    """The reward trained on: `reward_model.rule_weight` x the function's reward + `weight` x
    the reward model's score."""
    rm = cfg.reward_model
    return rm.rule_weight * rewards_B + rm.weight * scores_B.to(rewards_B.dtype)


def gae_advantages(rewards_B, model_mask_BT, loss_mask_BT, old_values_BT, cfg):
    """(adv_BT, returns_BT, metrics) of PPO with a critic (`critic:` section): rewards and GAE
    over the model's tokens (`model_mask_BT`: a token rejected by a filter or a correction
    still links its neighbours), whitening and metrics over the tokens trained."""
    critic = cfg.critic
    token_rewards = ppo.token_rewards(rewards_B, model_mask_BT)
    adv, returns = ppo.gae(token_rewards, old_values_BT, model_mask_BT, critic.gamma,
                           critic.lam)  # fmt: skip
    mask_BT = loss_mask_BT
    if critic.whiten_advantages:
        adv = ppo.whiten(adv, mask_BT)
    real = mask_BT.bool()
    metrics = {
        "critic/explained_var": float(ppo.explained_variance(old_values_BT, returns, mask_BT)),
        "critic/values_mean": float(old_values_BT[real].mean()) if real.any() else 0.0,
        "critic/returns_mean": float(returns[real].mean()) if real.any() else 0.0,
        "critic/advantages_mean": float(adv[real].mean()) if real.any() else 0.0,
    }
    return adv, returns, metrics


def train_critic(role, work, cfg) -> dict:
    """The critic's optimizer steps of one RL step; its metrics (`critic/*`)."""
    algo, critic_cfg, batch = cfg.algorithm, cfg.critic, work.batch
    dp_rank, dp_size = dist.get_rank(role.pgc.dp), dist.get_world_size(role.pgc.dp)
    mbs = int(role.args.get("micro_batch_size") or 1)
    plan = minibatch.plan_role_step(role.args, batch["tokens"].shape[0], algo, cfg.seed,
                                    work.step, dp_size)  # fmt: skip
    fields = {"tokens": batch["tokens"], "mask": work.loss_mask_BT,
              "old_values": batch["old_values"], "returns": batch["returns"]}  # fmt: skip
    if role.mask_moe_padding:
        fields["padding"] = padding_BT(batch)
    _, budget = response_budget(cfg)
    steps = []
    for samples in plan:
        samples = torch.tensor(samples)
        mask = fields["mask"][samples]
        counts = {"num_tokens_global": mask.sum(), "num_seqs_global": (mask.sum(-1) > 0).sum(),
                  "token_sum_norm": budget}  # fmt: skip
        rows = samples.chunk(dp_size)[dp_rank]
        micro = [{k: v[chunk] for k, v in fields.items()} for chunk in rows.split(mbs)]

        def loss_fn(values_BT, _unused, mb, counts=counts):
            return ppo.value_loss(values_BT[:, :-1], mb["old_values"], mb["returns"],
                                  mb["mask"], critic_cfg.value_clip, critic_cfg.loss_agg_mode,
                                  **counts)  # fmt: skip

        metrics = role.train_step(micro, loss_fn, outputs="values")
        for key in CRITIC_LOSS_KEYS:  # shares of the step's loss: sum over micro-batches
            if key in metrics:
                metrics[key] *= len(micro)
        steps.append({k.replace("actor/", "critic/", 1): v for k, v in metrics.items()})
    merged = {}
    for key in steps[0]:
        values = [m[key] for m in steps if key in m]
        last = key.startswith(("critic/lr", "critic/wd"))
        merged[key] = values[-1] if last else sum(values) / len(values)
    merged["critic/optimizer_steps"] = float(len(steps))
    return merged
