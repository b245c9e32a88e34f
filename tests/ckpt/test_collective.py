"""Save and load are collective: what every rank sees when RNG states come back, when one rank's write fails,
and when a save is refused (one 2-rank gloo group runs every case; the assertions run here)."""

from __future__ import annotations

import pytest

from tests.support import ckpt_phases
from tests.support.distributed import run_distributed


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return run_distributed(ckpt_phases.collective_phase, 2, str(tmp_path_factory.mktemp("collective")), timeout=300)


def test_rng_states_come_back_on_the_same_world_size(seen):
    """torch's, Python's and NumPy's generators (cached gaussians included) are restored to the states saved,
    each rank its own."""
    for rank, out in enumerate(seen):
        saved, perturbed, restored = out["rng"]
        assert perturbed != saved, "the test must perturb every generator"
        for part, (a, b) in enumerate(zip(saved, restored, strict=True)):
            assert a == b, (rank, ["torch", "python", "numpy"][part])
    assert seen[0]["rng"][0] != seen[1]["rng"][0], "ranks were seeded differently, so each must get its own state"


def test_an_rng_state_no_generator_accepts_fails_every_rank_before_the_model_is_touched(seen):
    """A resealed torch RNG state of garbage is refused on every rank with the same error naming the file."""
    messages = [out["bad rng"] for out in seen]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "rank-00001.safetensors" in messages[0] and "rng/torch_cpu" in messages[0]
    assert all(out["bad rng left the model alone"] for out in seen)


def test_a_write_failure_on_one_rank_fails_every_rank_and_publishes_nothing(seen):
    """Rank 1's file write fails: every rank raises the same error naming rank 1, no step-2 appears, latest
    stays on step-1, nothing is left behind; the next save of step 2 works."""
    messages = [out["write failure"] for out in seen]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "Rank 1" in messages[0] and "No space left on device (injected)" in messages[0]
    assert seen[0]["after write failure"] == {"latest": "step-1", "steps": ["step-1"], "hidden": []}
    assert seen[0]["after a later save"] == {"latest": "step-2", "steps": ["step-1", "step-2"], "hidden": []}


def test_refused_saves_fail_every_rank_and_change_nothing(seen):
    """A save of a published step and one whose `extra` holds NaN raise the same error on every rank."""
    for key, words in [("save published step", "published"), ("save NaN extra", "extra")]:
        messages = [out[key] for out in seen]
        assert messages[0] is not None and messages[0] == messages[1] and words in messages[0], messages
    assert seen[0]["after refused saves"] == {"latest": "step-2", "steps": ["step-1", "step-2"], "hidden": []}
