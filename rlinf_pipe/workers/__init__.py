"""The Ray workers of each placement component: rollout, inference (log-probs), actor (training), reward."""
