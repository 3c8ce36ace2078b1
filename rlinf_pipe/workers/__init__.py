"""The Ray workers of each placement component, thin shells over the engines: rollout, reward, inference (log-probs),
actor (training). Importing one never loads the driver stack (`rlinf_pipe.runner`)."""
