"""Which MoE auxiliary losses a role's routers record (`moe.aux_metrics.tracked_names`): each
load-balancing type with a non-zero coefficient (a list of types takes a list of coefficients,
as megatron-core reads them), then the z-loss; none for a dense model. The metrics themselves
are checked against transformers in tests/distributed/test_moe_aux_losses.py."""

from megatron_async_rl.moe.aux_metrics import tracked_names


def test_tracked_names_follow_the_coefficients():
    moe = {"num_experts": 4}
    assert tracked_names({"moe_router_load_balancing_type": "aux_loss"}) == []  # dense
    assert tracked_names({**moe, "moe_aux_loss_coeff": 0.0}) == []
    assert tracked_names({**moe, "moe_aux_loss_coeff": 0.01}) == ["load_balancing_loss"]
    assert tracked_names({**moe, "moe_router_load_balancing_type": "none",
                          "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 1e-3}) == ["z_loss"]
    both = {**moe, "moe_router_load_balancing_type": ["seq_aux_loss", "global_aux_loss"],
            "moe_aux_loss_coeff": [0.01, 0.0]}
    assert tracked_names(both) == ["seq_load_balancing_loss"]
