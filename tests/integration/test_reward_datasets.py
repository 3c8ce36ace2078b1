"""Dataset files through the real dataset builder into the real reward pool (no Ray): an RLinf math file's
`solutions` are several references for the math reward (a response matching any is correct) and a list ground truth
for a reward function; a verl file's data_source, extra_info and ground_truth reach a reward function as verl
passes them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.config.schema import DataConfig, RewardConfig
from rlinf_pipe.data.factory import build_prompt_dataset
from rlinf_pipe.engines.reward import reward_context, reward_pool

PROBE = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Reports what it was given: the reward is 1 when the response names the ground truth's repr."""
    return {"score": float(solution_str == repr(ground_truth)), "index": extra_info.get("index", -1),
            "gsm8k": float(data_source == "openai/gsm8k")}
'''


def items_of(path: Path) -> list:
    dataset = build_prompt_dataset(DataConfig(dataset=str(path), shuffle=False), tiny_tokenizer(), seed=0)
    return [dataset[i] for i in range(dataset.size)]


def test_rlinf_solutions_are_several_references_for_the_math_reward(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Half of one?", "solutions": ["\\frac{1}{2}", "0.5"]},
        {"prompt": "Four times three?", "solutions": ["12", "\\boxed{12.0}"]},
    ]))
    half, twelve = items_of(path)
    responses = [(half, "\\boxed{0.5}"), (half, "so \\boxed{1/2}"), (half, "\\boxed{2}"), (twelve, "\\boxed{12}"),
                 (twelve, "\\boxed{12.00}"), (twelve, "\\boxed{13}")]
    with reward_pool(RewardConfig(timeout_s=10.0)) as pool:
        results = pool.score_batch([(text, reward_context(item)) for item, text in responses])
    assert [r.correct for r in results] == [True, True, False, True, True, False]


def test_a_reward_function_gets_the_solutions_list_and_a_verl_records_own_fields(tmp_path):
    reward_file = tmp_path / "probe.py"
    reward_file.write_text(PROBE)
    rlinf = tmp_path / "math.jsonl"
    rlinf.write_text(json.dumps({"prompt": "Half of one?", "solutions": ["\\frac{1}{2}", "0.5"]}) + "\n")
    verl = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "train", "index": 41}}]),
        verl)
    (from_rlinf,) = items_of(rlinf)
    (from_verl,) = items_of(verl)
    with reward_pool(RewardConfig(function=str(reward_file), timeout_s=10.0)) as pool:
        results = pool.score_batch([
            ("['\\\\frac{1}{2}', '0.5']", reward_context(from_rlinf)),  # the parsed references, as a list
            ("'5'", reward_context(from_verl)),  # the ground truth as stored
        ])
    assert [r.reward for r in results] == [1.0, 1.0]
    assert results[0].extras == {"index": -1.0, "gsm8k": 0.0}  # (no extra_info: {}; data_source: the file's name)
    assert results[1].extras == {"index": 41.0, "gsm8k": 1.0}
    assert reward_context(from_rlinf).data_source == "math"
