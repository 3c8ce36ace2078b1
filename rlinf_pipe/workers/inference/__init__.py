"""Log-prob workers: old and reference log-probs with Megatron (`InferenceWorker`)."""
