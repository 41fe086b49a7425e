"""The named decisions of routing, chosen by configuration (`RouterConfig`): which worker
(`router.policy`), hand off or run here (`router.split_policy`), which decode worker
(`router.decode_policy`). Torch-free."""

from __future__ import annotations

from typing import NamedTuple

from router.config import RouterConfig
from router.decode_policy import DecodePolicy
from router.policy import RoutingPolicy, configured_policy
from router.split_policy import SplitPolicy, get_split_policy


class Policies(NamedTuple):
    """The orchestrator's decisions: `route`, `split`, `decode`."""

    route: RoutingPolicy
    split: SplitPolicy
    decode: DecodePolicy

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policies:
        """The configured policies; both worker picks price an adapter load at
        `config.lora_load_cost_blocks` (where the policy scores it)."""
        cost = config.lora_load_cost_blocks
        return cls(configured_policy(config.policy, cost, config.policy_options),
                   get_split_policy(config.disagg_policy,
                                    threshold_tokens=config.disagg_threshold_tokens),
                   DecodePolicy(configured_policy(config.decode_policy, cost)))
