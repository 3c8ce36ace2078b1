"""The receiving end of weight sync is written once: the rollout and inference workers inherit it and say only what
their versions load into."""

import inspect

from rlinf_pipe.workers.inference import InferenceWorker
from rlinf_pipe.workers.rollout import RolloutWorker
from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker

RECEIVER_CALLS = ("open_weights", "receive_weights", "rewind_weights", "wait_for_weights")


def test_both_receivers_share_the_one_receiving_end():
    for worker in (RolloutWorker, InferenceWorker):
        assert issubclass(worker, WeightReceiverWorker)
        for name in RECEIVER_CALLS:
            assert name not in vars(worker), f"{worker.__name__}.{name} is written again"
        assert "weight_target" in vars(worker)


def test_the_driver_calls_of_a_receiver_are_what_the_weight_sync_calls():
    """(runner/weight_sync.py calls these on every receiver group)"""
    source = inspect.getsource(__import__("rlinf_pipe.runner.weight_sync", fromlist=["x"]))
    for name in ("open_weights", "receive_weights", "weight_group_ranks", "native_weight_receiver"):
        assert name in source and callable(getattr(WeightReceiverWorker, name))
