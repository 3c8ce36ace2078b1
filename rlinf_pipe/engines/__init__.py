"""Engines: the components' working parts, with no Ray in them. `policy` (Megatron training and log-probs),
`rollout` (generation: the torch engine and the SGLang adapter), `reward` (math verification in a process pool).
The Ray workers (`rlinf_pipe.workers`) are thin shells around them."""
