"""The gpt preset, slowed down: each forward of the first block sleeps MLM_TEST_SLEEP_S seconds (default 0), so
reliability tests can kill or signal a worker in the middle of a step. Same parameters and FQNs as the preset."""

import os
import time

from mlm.planner.capture.presets.gpt import build_model as _build_gpt


def _sleep(_module, _inputs):
    delay = float(os.environ.get("MLM_TEST_SLEEP_S", "0"))
    if delay > 0:
        time.sleep(delay)


def build_model(**kwargs):
    model = _build_gpt(**kwargs)
    model.transformer.h[0].register_forward_pre_hook(_sleep)
    return model
