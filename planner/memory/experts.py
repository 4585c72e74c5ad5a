"""Where a mixture-of-experts model's states live under expert parallelism (issue 35).

Megatron-Core (parallel_state.initialize_model_parallel: the expert layout ep · etp · pp, its data-parallel
group `expert_data_parallel` the rest of the world) and torchtitan (parallel_dims.py: experts sharded over
`ep`, their FSDP over `dp_shard_mod_ep`) split a routed expert's weights, gradients and optimizer states
over ep · etp ranks, and shard what each rank holds over the expert data-parallel group (edp = world /
(ep · etp · pp)) when the strategy shards states. Everything else (attention, norms, embeddings, the router,
a shared expert) is laid out as the strategy says; under tensor parallelism attention and a shared expert
are split over tp and the routed experts are not (planner.families.forms.moe_gated emits one rank's ops).

So one rank keeps, of a layer's experts: 1 / (ep · etp) of them, times the strategy's share scaled to the
expert data-parallel group (share · ep · etp, at most 1): for a sharding strategy (share 1 / world) that is
1 / world of all experts, as without expert parallelism, but gathered over edp ranks only; for replicated
states (DDP) 1 / (ep · etp).
"""

from __future__ import annotations

from planner.memory.parallel import Sharding


def expert_sharding(share: Sharding, ep_etp: int, tp_cp: int = 1) -> Sharding:
    """The share of its local experts a rank keeps (see the module docstring): a state the strategy shards
    over the data-parallel group (share 1 / dp, dp = world / (tp · cp · pp)) is sharded over the expert
    data-parallel group instead (1 / edp, edp = world / (ep · etp · pp): share · ep · etp / (tp · cp)); a
    replicated one (share 1) stays whole. `tp_cp`: the tensor- and context-parallel degrees, which divide
    the dense part's data-parallel group but not the experts' (Megatron-Core parallel_state
    `initialize_model_parallel` @d98e8a64: the attention layout tp-cp-dp-pp, the experts' tp-ep-dp-pp with
    expert_tensor_parallel_size as its tp)."""
    scale = ep_etp / tp_cp

    def one(x: float) -> float:
        return 1.0 if x >= 1 else min(1.0, x * scale)

    return Sharding(parameters=one(share.parameters), gradients=one(share.gradients),
                    optimizer_states=one(share.optimizer_states))


def split_shapes(shapes: tuple, ep_etp: int) -> tuple[list, list]:
    """(dense shapes, this rank's expert shapes): the routed experts are the model's 3-D parameters
    (gate_up_proj (E, 2i, h), down_proj (E, h, i)); a rank holds E / (ep · etp) of each."""
    dense = [s for s in shapes if len(s) != 3]
    experts = [(s[0] // ep_etp, *s[1:]) for s in shapes if len(s) == 3]
    return dense, experts


def local_parameters(total: int, experts: int, ep_etp: int) -> int:
    """Parameters one rank's model holds: all but the experts other ranks hold."""
    return total - experts + experts // ep_etp
